"""GPU benchmark (issue: GPU conversion), in one run on the device machine.

1. kernel throughput (bytes in + out per second) against a device-to-device copy, same run;
2. end-to-end wall time against ``cp`` of the same checkpoint to the same disk, page cache
   dropped before each (cold) and not (warm);
3. one GPU against all visible GPUs, warm;
4. the CPU path (every core) on the same machine, warm.

    PYTHONPATH=. python scripts/bench_gpu.py --dir /tmp/k3gpu --gb 20 [--skip-cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

CLI = [sys.executable, "-m", "converter"]


def sh(cmd: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout.decode()[-4000:]}")
    return time.perf_counter() - t0


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def kernel_rate(groups: int = 1 << 26) -> dict:
    """Kernel bytes (17 in + 18 out per group) per second vs a same-size device copy."""
    import triton.testing

    from converter.kernels.triton_requant import requantize
    from converter.quant import requant

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    w = torch.randn(groups, 32, device=dev, generator=gen)
    w = w / torch.sqrt(torch.empty_like(w).exponential_(0.5, generator=gen) / 2)
    from converter.formats.mxfp4 import encode
    packed, scales = encode(w.reshape(-1, 32 * 64))  # rows of 64 groups
    packed, scales = packed.reshape(-1, 16), scales.reshape(-1)
    del w
    offsets = torch.arange(0, groups + 1, groups // 256, device=dev)  # 256 tensors in the batch
    ms = triton.testing.do_bench(lambda: requantize(packed, scales, offsets), return_mode="median")
    nbytes = groups * (17 + 18)
    buf = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    out = torch.empty_like(buf)
    copy_ms = triton.testing.do_bench(lambda: out.copy_(buf), return_mode="median")
    res = requantize(packed[: 1 << 20], scales[: 1 << 20])
    ref = requant.requantize(packed[: 1 << 20].cpu(), scales[: 1 << 20].cpu())
    same = torch.equal(res.packed.cpu(), ref.packed) and torch.equal(
        res.scales.cpu().view(torch.int16), ref.scales.view(torch.int16))
    return {"groups": groups, "kernel_ms": ms, "kernel_GBps": nbytes / ms / 1e6,
            "copy_GBps": 2 * buf.numel() / copy_ms / 1e6, "ratio": (nbytes / ms) / (2 * buf.numel() / copy_ms),
            "bytes_equal_cpu_on_1M_groups": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/k3gpu")
    ap.add_argument("--gb", type=float, default=20.0, help="size of the MXFP4 checkpoint to build")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--cold-only", action="store_true", help="only the cold-cache runs (saves device time)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res: dict = {"date": time.strftime("%Y-%m-%d"), "gpus": torch.cuda.device_count(),
                 "gpu": torch.cuda.get_device_name(0), "cpus": os.cpu_count()}
    res["kernel"] = kernel_rate()
    print(json.dumps(res["kernel"]), flush=True)

    src = os.path.join(args.dir, "src")
    per_expert = 3 * (3072 * 3584 // 2 + 3072 * 3584 // 32)
    layers = args.shards + 1
    experts = max(1, int(args.gb * 1e9 / per_expert / (layers - 1)))
    if not os.path.exists(os.path.join(src, "config.json")):
        res["build_s"] = sh(CLI + ["make-fixture", src, "--real-dims", "--layers", str(layers), "--experts",
                                   str(experts), "--shards", str(args.shards), "--device", "cuda"])
    size = sum(e.stat().st_size for e in os.scandir(src) if e.name.endswith(".safetensors"))
    res["checkpoint_GB"] = size / 1e9
    print(f"checkpoint {size / 1e9:.1f} GB, {experts} experts x {layers - 1} MoE layers", flush=True)

    def run(name: str, cmd: list[str], dst: str, cold: bool) -> None:
        shutil.rmtree(dst, ignore_errors=True)
        dropped = drop_caches() if cold else None
        t = sh(cmd)
        res[name] = {"s": t, "GBps_in": size / t / 1e9, "cache_dropped": dropped}
        print(f"{name:24} {t:7.2f} s  {size / t / 1e9:6.2f} GB/s", flush=True)
        shutil.rmtree(dst, ignore_errors=True)

    cp_dst, out = os.path.join(args.dir, "cp"), os.path.join(args.dir, "out")
    conv = CLI + ["mxfp4-to-int4", src, "-o", out, "--progress", "none"]
    run("cp_cold", ["cp", "-r", src, cp_dst], cp_dst, cold=True)
    # cp returns with its writes still in the page cache; k3convert fsyncs every shard (a DST
    # is complete only when durable), so the like-for-like copy is cp followed by sync
    run("cp_sync_cold", ["sh", "-c", f"cp -r {src} {cp_dst} && sync"], cp_dst, cold=True)
    run("convert_1gpu_cold", conv + ["--devices", "cuda:0"], out, cold=True)
    if not args.cold_only:
        run("cp_warm", ["cp", "-r", src, cp_dst], cp_dst, cold=False)
        run("cp_sync_warm", ["sh", "-c", f"cp -r {src} {cp_dst} && sync"], cp_dst, cold=False)
        run("convert_1gpu_warm", conv + ["--devices", "cuda:0"], out, cold=False)
    if torch.cuda.device_count() > 1:
        devs = ",".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))
        run("convert_allgpu_cold", conv + ["--devices", devs], out, cold=True)
        if not args.cold_only:
            run("convert_allgpu_warm", conv + ["--devices", devs], out, cold=False)
            res["scaling_warm"] = res["convert_1gpu_warm"]["s"] / res["convert_allgpu_warm"]["s"]
    if not args.skip_cpu:
        run("convert_cpu_warm", conv + ["--devices", "cpu", "--workers", str(max(1, (os.cpu_count() or 2) // 2))],
            out, cold=False)
    res["ratio_1gpu_cold_vs_cp_cold"] = res["convert_1gpu_cold"]["s"] / res["cp_cold"]["s"]
    res["ratio_1gpu_cold_vs_cp_sync_cold"] = res["convert_1gpu_cold"]["s"] / res["cp_sync_cold"]["s"]
    print(json.dumps(res, indent=2))
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
