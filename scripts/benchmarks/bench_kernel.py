"""Throughput of the Triton MXFP4 -> int4 requantizer on a CUDA GPU, against a plain copy.

Generates realistic MXFP4 groups on the GPU (Gaussian and Student-t weights through the OCP
MX scale rule, a few all-zero groups), checks the kernel's bytes against the CPU reference
on a sample (plus adversarial groups, several tensors per batch), then times each kernel
variant with ``triton.testing.do_bench`` (median) and a device-to-device copy of the same
number of bytes in the same run. Throughput counts bytes in + out: 17 + 18 per group.

    PYTHONPATH=. python scripts/benchmarks/bench_kernel.py [--gb 3] [--check 1000000] [--variants all]

Prints a table last; with $OUT set, also writes $OUT/bench_kernel.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

IN_BYTES, OUT_BYTES = 17, 18
MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # E2M1 magnitude boundaries (0,.5,1,1.5,2,3,4,6)

VARIANTS = {  # the first one is the reference for "same bytes"
    "default": {},
    "nsplit2": {"nsplit": 2},
    "bg64": {"block_groups": 64},
    "warps8": {"num_warps": 8},
    "pps1": {"programs_per_sm": 1},
    "pps4": {"programs_per_sm": 4},
    "stages1": {"num_stages": 1},  # = launch_config("gfx942"/"gfx90a")
    "gfx950": {"block_groups": 64, "nsplit": 2, "num_stages": 1},  # = launch_config("gfx950"), other gfx
    "regs168": {"maxnreg": 168, "programs_per_sm": 3},
    "no_stats": {"stats": False},
    "force_exact": {"force_exact": True},
}
QUICK = ("default", "nsplit2", "no_stats", "force_exact")


def copy_time(nbytes: int, device: torch.device, rep: int) -> float:
    """Median ms of a device-to-device copy of ``nbytes`` (buffers freed on return)."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 256)
    dst = torch.empty_like(src)
    return do_bench(lambda: dst.copy_(src), warmup=25, rep=rep, return_mode="median")


def stream_floor(packed: torch.Tensor, scales: torch.Tensor):
    """A Triton kernel with the requantizer's memory traffic and no arithmetic (a floor)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, ssrc, dst, sdst, G, BG: tl.constexpr):
        rows = tl.program_id(0) * BG + tl.arange(0, BG)
        m = rows < G
        offs = rows.to(tl.int64)[:, None] * 16 + tl.arange(0, 16)[None, :]
        b = tl.load(src + offs, mask=m[:, None], other=0)
        s = tl.load(ssrc + rows, mask=m, other=0)
        tl.store(dst + offs, b ^ 0x88, mask=m[:, None])
        tl.store(sdst + rows, s.to(tl.int16) << 7, mask=m)

    g = packed.shape[0]
    out = torch.empty_like(packed)
    osc = torch.empty(g, dtype=torch.int16, device=packed.device)
    grid = (triton.cdiv(g, 256),)
    return lambda: _copy[grid](packed, scales, out, osc, g, BG=256, num_warps=4)


def realistic_groups(g: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 groups as a checkpoint would hold them, made on ``device`` in chunks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    packed = torch.empty(g, 16, dtype=torch.uint8, device=device)
    scales = torch.empty(g, dtype=torch.uint8, device=device)
    mids = torch.tensor(MIDS, device=device)
    chunk = 1 << 22
    for lo in range(0, g, chunk):
        n = min(chunk, g - lo)
        w = torch.randn(n, 32, device=device, generator=gen)
        heavy = torch.rand(n, 1, device=device, generator=gen) < 0.25   # Student-t(3) rows
        chi = torch.randn(n, 32, 3, device=device, generator=gen).square().sum(-1) / 3
        w = torch.where(heavy, w / chi.sqrt(), w)
        w = w * torch.exp2(torch.randint(-14, 4, (n, 1), device=device, generator=gen).float())
        w[torch.rand(n, device=device, generator=gen) < 1e-3] = 0.0      # a few all-zero groups
        amax = w.abs().amax(1)
        e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
        x = w.abs() / torch.exp2(e)[:, None]
        codes = torch.bucketize(x, mids).to(torch.uint8) | ((w < 0).to(torch.uint8) << 3)
        packed[lo:lo + n] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales[lo:lo + n] = (e + 127).clamp(0, 254).to(torch.uint8)
    return packed, scales


def adversarial_groups(device: torch.device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows, sc = [], []
    for s in (0, 1, 2, 126, 127, 200, 253, 254, 255):
        for c in (0, 8, 7, 15):
            rows.append(torch.full((32,), c, dtype=torch.uint8))
            sc.append(s)
        for lv in range(1, 8):
            for _ in range(4):
                mag = torch.randint(0, lv + 1, (32,), generator=gen)
                rows.append((mag | (torch.randint(0, 2, (32,), generator=gen) << 3)).to(torch.uint8))
                sc.append(s)
    for _ in range(2000):
        rows.append(torch.randint(0, 16, (32,), generator=gen).to(torch.uint8))
        sc.append(int(torch.randint(0, 256, (1,), generator=gen)))
    codes = torch.stack(rows)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.to(device), torch.tensor(sc, dtype=torch.uint8, device=device)


def check_against_cpu(kernel_mod, packed: torch.Tensor, scales: torch.Tensor, offsets: list[int],
                      **knobs) -> dict:
    from converter.quant.requant import requantize as cpu_requantize

    got = kernel_mod.requantize(packed, scales, offsets, **knobs)
    if packed.is_cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    ref = cpu_requantize(packed.cpu(), scales.cpu(), offsets)
    cpu_s = time.perf_counter() - t
    bytes_ok = torch.equal(got.packed.cpu(), ref.packed)
    scales_ok = torch.equal(got.scales.view(torch.int16).cpu(), ref.scales.view(torch.int16))
    st = got.stats.cpu()
    rel = ((st[:, :2] - ref.stats[:, :2]).abs() / ref.stats[:, :2].abs().clamp_min(1e-300)).max().item()
    exact = torch.equal(st[:, 2:], ref.stats[:, 2:])
    return {"groups": packed.shape[0], "bytes_equal": bytes_ok, "scales_equal": scales_ok,
            "stats_max_rel_err": rel, "stats_exact_cols_equal": exact, "cpu_seconds": cpu_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=3.0, help="input bytes to generate, in GB")
    ap.add_argument("--check", type=int, default=1_000_000, help="groups checked against the CPU")
    ap.add_argument("--variants", default="quick", help="quick, all, or comma-separated names")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2

    import triton
    from triton.testing import do_bench

    from converter.kernels import triton_requant as K

    dev = torch.device("cuda")
    prop = torch.cuda.get_device_properties(dev)
    info = {"device": prop.name, "sms": prop.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(json.dumps(info), flush=True)
    report: dict = {"info": info, "checks": {}, "variants": {}}

    g = int(args.gb * 1e9) // IN_BYTES
    t0 = time.perf_counter()
    packed, scales = realistic_groups(g, dev)
    torch.cuda.synchronize()
    print(f"generated {g} groups ({g * IN_BYTES / 1e9:.2f} GB in) in {time.perf_counter() - t0:.1f} s",
          flush=True)

    # ---- correctness on a sample, several uneven tensors, and adversarial groups ----------
    n = min(args.check, g)
    cuts = sorted({0, n} | {int(n * f) for f in (0.001, 0.3, 0.3, 0.5501, 0.9)})
    t0 = time.perf_counter()
    report["checks"]["realistic_sample"] = check_against_cpu(K, packed[:n], scales[:n], cuts)
    ap_, as_ = adversarial_groups(dev)
    report["checks"]["adversarial"] = check_against_cpu(K, ap_, as_, [0, 100, len(as_)])
    report["checks"]["adversarial_force_exact"] = check_against_cpu(
        K, ap_, as_, [0, 100, len(as_)], force_exact=True)
    print(json.dumps(report["checks"]), f"({time.perf_counter() - t0:.1f} s)", flush=True)

    # ---- copy ceiling: same bytes as the kernel moves (read + write) ------------------------
    nbytes = g * (IN_BYTES + OUT_BYTES) // 2
    copy_ms = copy_time(nbytes, dev, args.rep)
    copy_bps = 2 * nbytes / (copy_ms * 1e-3)
    report["copy"] = {"bytes_moved": 2 * nbytes, "ms": copy_ms, "TBps": copy_bps / 1e12}
    print(f"copy: {copy_ms:.3f} ms, {copy_bps / 1e12:.3f} TB/s (read+write)", flush=True)

    try:
        fl = stream_floor(packed, scales)
        ms = do_bench(fl, warmup=25, rep=args.rep, return_mode="median")
        report["stream_floor"] = {"ms": ms, "TBps": g * (IN_BYTES + OUT_BYTES) / (ms * 1e-3) / 1e12}
        print(f"stream floor (same traffic, no math): {ms:.3f} ms, {report['stream_floor']['TBps']:.3f} TB/s",
              flush=True)
    except Exception:  # the floor is only a reference
        traceback.print_exc()

    # ---- kernel variants -----------------------------------------------------------------------
    names = (list(VARIANTS) if args.variants == "all" else list(QUICK) if args.variants == "quick"
             else args.variants.split(","))
    base = None
    for name in names:
        knobs = VARIANTS[name]
        row: dict = {"knobs": knobs}
        try:
            t0 = time.perf_counter()
            run = K.prepare(packed, scales, None, **knobs)
            res = run()
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            k0 = run.compiled
            row["regs"], row["spills"] = getattr(k0, "n_regs", None), getattr(k0, "n_spills", None)
            if base is None:
                base = (res.packed.clone(), res.scales.view(torch.int16).clone(), res.stats.clone())
                row["same_bytes_as_default"] = True
            else:
                row["same_bytes_as_default"] = bool(
                    torch.equal(res.packed, base[0]) and torch.equal(res.scales.view(torch.int16), base[1]))
            if knobs.get("stats", True):
                row["stats"] = res.stats.cpu().tolist()
            ms = do_bench(run, warmup=25, rep=args.rep, return_mode="median")
            bps = g * (IN_BYTES + OUT_BYTES) / (ms * 1e-3)
            row.update({"ms": ms, "groups_per_s": g / (ms * 1e-3), "TBps": bps / 1e12,
                        "ratio_to_copy": bps / copy_bps})
        except Exception as exc:  # keep measuring the other variants
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        report["variants"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "stats"}), flush=True)

    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "bench_kernel.json"), "w") as f:
            json.dump(report, f, indent=1)

    # ---- table ------------------------------------------------------------------------------------
    print()
    print(f"{prop.name}, {g} groups ({g * (IN_BYTES + OUT_BYTES) / 1e9:.2f} GB in+out), "
          f"copy {copy_bps / 1e12:.3f} TB/s, stream floor "
          f"{report.get('stream_floor', {}).get('TBps', float('nan')):.3f} TB/s")
    for k, c in report["checks"].items():
        print(f"check {k:24s} groups={c['groups']:>8d} bytes={c['bytes_equal']} scales={c['scales_equal']} "
              f"stats_rel={c['stats_max_rel_err']:.1e} exact_cols={c['stats_exact_cols_equal']}")
    print(f"{'variant':17s} {'ms':>9s} {'Ggroups/s':>10s} {'TB/s':>7s} {'vs copy':>8s} {'regs':>5s} "
          f"{'spill':>5s} same_bytes")
    for name, row in report["variants"].items():
        if "ms" in row:
            print(f"{name:17s} {row['ms']:9.3f} {row['groups_per_s'] / 1e9:10.2f} {row['TBps']:7.3f} "
                  f"{row['ratio_to_copy']:8.1%} {str(row.get('regs')):>5s} {str(row.get('spills')):>5s} "
                  f"{row['same_bytes_as_default']}")
        else:
            print(f"{name:17s} ERROR {row.get('error', '')[:80]}")
    ok = all(c["bytes_equal"] and c["scales_equal"] and c["stats_exact_cols_equal"]
             for c in report["checks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
