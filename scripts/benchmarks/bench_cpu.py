"""CPU benchmark: k3convert against the route users have today, on the same checkpoint.

The baseline is llm-compressor's model_free_ptq with compressed-tensors'
CompressedTensorsDequantizer and a W4A16 group-32 symmetric scheme
(scripts/benchmarks/baseline_model_free_ptq.py), run from its own virtual environment because
llmcompressor pins other compressed-tensors/transformers versions. Both run as
subprocesses on a K3-shaped checkpoint with the real expert dims, cold start included;
peak RSS is the largest sum over each process tree, sampled every 20 ms.

    python scripts/benchmarks/bench_cpu.py [--src DIR] [--baseline-python /tmp/llmc_venv/bin/python]

Needs psutil (pip install psutil) besides k3convert, and the baseline venv (BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(cmd: list[str]) -> dict:
    """Wall time and peak RSS (sum over the process tree) of one command."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    out = proc.stdout.read().decode(errors="replace")
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return {"wall_s": wall, "peak_rss_bytes": peak}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="/tmp/k3bench/src", help="fixture dir (made if missing)")
    ap.add_argument("--layers", type=int, default=5, help="layers of the fixture (layer 0 dense)")
    ap.add_argument("--experts", type=int, default=14)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--baseline-python", default="/tmp/llmc_venv/bin/python")
    ap.add_argument("--runs", type=int, default=2, help="runs of each; the best is reported")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.src, "config.json")):
        subprocess.run(["k3convert", "make-fixture", args.src, "--real-dims", "--layers", str(args.layers),
                        "--experts", str(args.experts), "--shards", str(args.shards)], check=True)
    size = sum(e.stat().st_size for e in os.scandir(args.src) if e.name.endswith(".safetensors"))
    work = os.path.dirname(os.path.abspath(args.src))
    results: dict[str, list[dict]] = {"k3convert": [], "baseline": []}
    for _ in range(args.runs):
        for name, cmd, dst in (
            ("k3convert", ["k3convert", "mxfp4-to-int4", args.src, "-o", f"{work}/out-k3", "--progress", "none"],
             f"{work}/out-k3"),
            ("baseline", [args.baseline_python, os.path.join(HERE, "baseline_model_free_ptq.py"), args.src,
                          f"{work}/out-baseline"], f"{work}/out-baseline"),
        ):
            shutil.rmtree(dst, ignore_errors=True)
            results[name].append(measure(cmd))
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in results.items()}
    k3, base = best["k3convert"], best["baseline"]
    summary = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB", "checkpoint_bytes": size,
        "k3convert": k3, "baseline": base,
        "speedup": base["wall_s"] / k3["wall_s"], "rss_ratio": k3["peak_rss_bytes"] / base["peak_rss_bytes"],
        "all_runs": results,
    }
    print(json.dumps(summary, indent=2))
    print(f"\n{'':12}{'wall s':>9}{'GB/s':>8}{'peak RSS GB':>13}")
    for name, r in best.items():
        print(f"{name:12}{r['wall_s']:>9.2f}{size / r['wall_s'] / 1e9:>8.3f}{r['peak_rss_bytes'] / 1e9:>13.2f}")
    print(f"speed-up {summary['speedup']:.2f}x (target >= 5), RSS ratio {summary['rss_ratio']:.2f} (target <= 0.3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
