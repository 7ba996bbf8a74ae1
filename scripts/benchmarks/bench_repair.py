"""How long the vLLM plugin's load-time repair of int4 code -8 takes on one rank, per K3 layer.

The plugin (converter/vllm_plugin/repair.py) repairs a laid-out layer when its self-test finds that
the kernel misreads code -8: unlayout, int4_pm7's exact ``optimal-pm7`` re-optimization of every group
holding -8, layout again. This times ``repair.repair_layer_`` on random K3-shaped layers, laid out by
``layout.convert_experts_`` as the plugin does, at TP 8 (per rank: w13 [896, 768, 3584] and w2
[896, 3584, 384] codes) and TP 8 + EP 8 ([112, 6144, 3584] and [112, 3584, 3072]): about 2.4% of codes
are -8 (about 55% of groups hold one), scales random bf16 around 1e-3. Reports seconds per layer (the
first layer apart: it compiles the layout kernel), the 92-layer figure per rank, groups/s, the peak
transient device memory (torch.cuda.max_memory_allocated minus what the layer holds), what the call
leaves allocated on the device after it returns (0: nothing cached, e.g. the inverse layout index), and
checks on a sample (some rows of the first and last expert of each weight) that the device's bytes
equal the CPU's.

    PYTHONPATH=. python scripts/benchmarks/bench_repair.py --device cuda              # one H200: about 1-2 min
    PYTHONPATH=. python scripts/benchmarks/bench_repair.py --device cuda --quick      # 1/8 of the experts
    PYTHONPATH=. python scripts/benchmarks/bench_repair.py --device cpu --experts 2   # the CPU, tiny

Needs only torch (and triton on a GPU, for the layout kernel).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from converter.quant import int4_pm7 as pm7  # noqa: E402
from converter.vllm_plugin import layout, repair  # noqa: E402

# per rank: (experts, 2 * intermediate, hidden) for w13; w2 is [experts, hidden, intermediate]
CONFIGS = {"tp8": (896, 768, 3584), "tp8-ep8": (112, 6144, 3584)}
LAYERS = 92
MINUS8 = 0.024                 # share of codes -8: 1 - (1 - 0.024)^32 = 54% of groups hold one
GEN_CODES = 1 << 26            # codes generated per step (bounds the generator's float32 transient)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def fill_(words: torch.Tensor, scales: torch.Tensor, gen: torch.Generator) -> None:
    """Random K3-like CT words [E, N, K/8] (codes ~ round(2.5 N(0,1)) in [-7, 7], MINUS8 of them -8)
    and bf16 scales [E, N, K/32] (1e-3 * exp(N(0, 0.5^2))), in place, a few experts at a time."""
    e, n, k8 = words.shape
    step = max(1, GEN_CODES // (n * k8 * 8))
    for lo in range(0, e, step):
        hi = min(lo + step, e)
        x = torch.randn(hi - lo, n, k8 * 8, device=words.device, generator=gen)
        codes = (x * 2.5).round_().clamp_(-7, 7).to(torch.int8)
        x.uniform_(generator=gen)
        codes.masked_fill_(x < MINUS8, -8)
        del x
        words[lo:hi].copy_(repair.codes_to_words(codes))
        del codes
    s = torch.randn(scales.shape, device=scales.device, generator=gen).mul_(0.5).exp_().mul_(1e-3)
    scales.copy_(s.to(torch.bfloat16))


def sample(words: torch.Tensor, scales: torch.Tensor, rows: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """CPU copies of the first ``rows`` rows of the first and last expert (CT order)."""
    return [(i, words[i, :rows].cpu().clone(), scales[i, :rows].cpu().clone())
            for i in sorted({0, words.shape[0] - 1})]


def check(packed: torch.Tensor, flat: torch.Tensor, n: int, k: int, ref: list, what: str) -> int:
    """The device's repaired rows equal the CPU's repair of the same rows, byte for byte; returns the
    groups compared."""
    g = k // layout.GROUP
    compared = 0
    for i, w, s in ref:
        dw, ds = repair.unlayout_(packed[i:i + 1].clone(), flat[i * n * g:(i + 1) * n * g].clone(), n, k)
        cw, cs = w.unsqueeze(0).clone(), s.unsqueeze(0).clone()
        repair.repair_ct_(cw, cs)
        rows = w.shape[0]
        if not (torch.equal(dw[0, :rows].cpu(), cw[0])
                and torch.equal(ds[0, :rows].cpu().view(torch.int16), cs[0].view(torch.int16))):
            raise SystemExit(f"bench_repair: {what} expert {i}: the device's repair differs from the CPU's")
        compared += cs.numel()
    return compared


def run(name: str, shape: tuple[int, int, int], args: argparse.Namespace, dev: torch.device,
        deadline: float) -> None:
    e, inter2, hidden = shape
    e = args.experts or (max(1, e // 8) if args.quick else e)
    inter = inter2 // 2
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    w13 = torch.empty(e, inter2, hidden // 8, dtype=torch.int32, device=dev)
    s13 = torch.empty(e, inter2, hidden // layout.GROUP, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(e, hidden, inter // 8, dtype=torch.int32, device=dev)
    s2 = torch.empty(e, hidden, inter // layout.GROUP, dtype=torch.bfloat16, device=dev)
    groups = (w13.numel() + w2.numel()) // 4
    print(f"[{name}] per rank and layer: w13 [{e}, {inter2}, {hidden}], w2 [{e}, {hidden}, {inter}] codes, "
          f"{groups:,} groups, {(w13.numel() + w2.numel()) * 4 / 2**20:,.0f} MiB packed", flush=True)
    times, repaired = [], 0
    for layer in range(args.layers):
        fill_(w13, s13, gen)
        fill_(w2, s2, gen)
        refs = (sample(w13, s13, args.sample_rows), sample(w2, s2, args.sample_rows)) if layer == 0 else None
        p13, f13 = layout.convert_experts_(w13, s13)
        p2, f2 = layout.convert_experts_(w2, s2)
        sync(dev)
        if dev.type == "cuda":
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        got = repair.repair_layer_(p13, f13, p2, f2)
        sync(dev)
        dt = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else None
        left = torch.cuda.memory_allocated(dev) - base if dev.type == "cuda" else None
        times.append(dt)
        repaired = got.repaired
        mem = "" if peak is None else f", peak transient {peak / 2**30:.2f} GiB, left after {left / 2**20:.0f} MiB"
        print(f"[{name}] layer {layer}{' (compiles the layout kernel)' if layer == 0 else ''}: "
              f"{dt:.2f} s, {got.repaired:,}/{got.groups:,} groups repaired ({got.repaired / got.groups:.0%}), "
              f"{got.groups / dt:,.0f} groups/s ({got.repaired / dt:,.0f} repaired/s), "
              f"rel RMSE {got.rel_rmse:.4f}{mem}", flush=True)
        if refs is not None:
            n = check(p13, f13, inter2, hidden, refs[0], f"{name} w13") + check(p2, f2, hidden, inter, refs[1], f"{name} w2")
            print(f"[{name}] sample: {n:,} groups of experts {sorted({0, e - 1})} equal to the CPU's repair, "
                  f"byte for byte", flush=True)
        if time.perf_counter() > deadline and layer + 1 < args.layers:
            print(f"[{name}] time budget spent: {layer + 1} layers", flush=True)
            break
    steady = sum(times[1:]) / len(times[1:]) if len(times) > 1 else times[0]
    full = "" if e == shape[0] else f" (these {e} experts; the full {shape[0]} scale about x{shape[0] / e:.0f})"
    print(f"[{name}] RESULT {steady:.2f} s per layer, {LAYERS} layers per rank: {times[0] + steady * (LAYERS - 1):.0f} s"
          f"{full}; {groups / steady:,.0f} groups/s; {repaired:,} repaired per layer", flush=True)
    del w13, s13, w2, s2, p13, f13, p2, f2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=3, help="layers timed per config (default 3)")
    ap.add_argument("--experts", type=int, default=0, help="experts per rank (default: K3's)")
    ap.add_argument("--quick", action="store_true", help="1/8 of the experts")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--sample-rows", type=int, default=256, help="rows per sampled expert checked on the CPU")
    ap.add_argument("--budget-s", type=float, default=150, help="stop adding layers after this many seconds")
    ap.add_argument("--step-groups", type=int, default=0,
                    help="GPU: groups per matmul step (default int4_pm7's, 2^18; transient 4 KiB per group)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.step_groups:
        pm7.GPU_STEP_GROUPS, pm7.GPU_STEP_BYTES = args.step_groups, args.step_groups * pm7.STEP_BYTES_PER_GROUP
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if dev.index is not None:
            torch.cuda.set_device(dev)
        print(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; steps of "
              f"{pm7.step_groups(dev)[0]:,} groups", flush=True)
    else:
        print(f"device cpu ({torch.get_num_threads()} threads), torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    for i, name in enumerate(names):
        if name not in CONFIGS:
            raise SystemExit(f"bench_repair: unknown config {name!r} (known: {', '.join(CONFIGS)})")
        share = (args.budget_s - (time.perf_counter() - t0)) / (len(names) - i)
        run(name, CONFIGS[name], args, dev, time.perf_counter() + share)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
