"""End-to-end benchmark on a GPU machine, side by side with ``cp``, in one run.

For each conversion: wall time, start-up (command to the first shard started), the steady
rate (source bytes from the first shard's start to the last shard's fsync), peak RSS of the
largest process, and where the time went per stage (summed over shards from the shard
records in DST/.k3convert). Outputs of every run must be byte-identical (checked).

    # memory-resident: source and output in tmpfs, so the disk plays no part
    PYTHONPATH=. python scripts/benchmarks/bench_gpu.py --memory --gb 12 --shards 8
    # from disk, page cache dropped before each run
    PYTHONPATH=. python scripts/benchmarks/bench_gpu.py --dir /var/tmp/k3 --gb 12 --shards 8 --cold
    # before/after: also run an older checkout of the package (a directory holding converter/)
    PYTHONPATH=. python scripts/benchmarks/bench_gpu.py --memory --old /path/to/old/checkout

The kernel alone is measured by scripts/bench_kernel.py.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

STAGES = ("read", "wait_read", "compute", "compute_sync", "sample", "write", "hash", "wait_write", "close_fsync")


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def sh(cmd: list[str], cwd: str | None = None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout.decode()[-4000:]}")
    return time.perf_counter() - t0


def convert(code: str, src: str, dst: str, devices: str, workers: int | str, cold: bool, io: str | None = None,
            extra: tuple[str, ...] = ()) -> dict:
    """One conversion with the package found in ``code``; timings from its JSON events."""
    shutil.rmtree(dst, ignore_errors=True)
    dropped = drop_caches() if cold else None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (code, os.environ.get("PYTHONPATH")) if x)}
    if devices == "cpu":  # older versions ignored --devices cpu when a GPU was visible
        env["CUDA_VISIBLE_DEVICES"] = ""
    if io:
        env["K3CONVERT_IO_THREADS"] = io
    # a wrapper process reports the peak RSS of the largest process below it (CLI or worker)
    wrap = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print('{\"maxrss_kB\": %d}' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
            "sys.exit(r.returncode)")
    cmd = [sys.executable, "-c", wrap, sys.executable, "-m", "converter", "mxfp4-to-int4", src, "-o", dst,
           "--progress", "json", "--devices", devices, "--workers", str(workers), *extra]
    t0 = time.time()
    # cwd too: ``python -m`` puts the working directory first on sys.path
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=code)
    wall = time.time() - t0
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr.decode()[-4000:]}")
    events = [json.loads(line) for line in r.stderr.decode().splitlines() if line.startswith("{")]
    starts = [e["time"] for e in events if e.get("event") == "start"]
    dones = [e["time"] for e in events if e.get("event") == "done"]
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(src, "*.safetensors")))
    stages: dict[str, float] = {}
    for rec in glob.glob(os.path.join(dst, ".k3convert", "*.done.json")):
        with open(rec) as f:
            for k, v in (json.load(f).get("stages") or {}).items():
                stages[k] = stages.get(k, 0.0) + v
    with open(os.path.join(dst, "k3convert_manifest.json")) as f:
        shas = {n: r["sha256"] if "sha256" in r else r.get("digest") for n, r in json.load(f)["shards"].items()}
    steady = max(dones) - min(starts)
    ready = [e["time"] for e in events if e.get("event") == "ready"]  # workers imported and warmed up
    parts = [e for e in events if e.get("event") == "ready"]
    plan = [e["time"] for e in events if e.get("event") == "plan"]   # preflight done
    note = next((e.get("workers") for e in events if e.get("event") == "plan"), None)  # workers, and why
    return {"wall_s": wall, "startup_s": min(starts) - t0, "workers_ready_s": max(ready) - t0 if ready else None,
            "preflight_s": plan[0] - t0 if plan else None,
            "ready_parts": {k: max(e.get(k, 0) for e in parts) for k in ("import_torch_s", "warm_up_s")} if parts else None, "steady_s": steady, "steady_GBps": size / steady / 1e9,
            "wall_GBps": size / wall / 1e9, "cache_dropped": dropped, "stages": stages, "digests": shas,
            "workers": note,
            "maxrss_GB": next(e["maxrss_kB"] for e in events if "maxrss_kB" in e) * 1024 / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp/k3bench", help="where source and outputs go (--memory: /dev/shm)")
    ap.add_argument("--memory", action="store_true", help="source and output in tmpfs (/dev/shm)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (disk mode)")
    ap.add_argument("--gb", type=float, default=12.0, help="size of the MXFP4 checkpoint to build")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--new", default=None, help="the checkout to measure [default: this script's]")
    ap.add_argument("--old", default=None, help="an older checkout (holding converter/) to measure too")
    ap.add_argument("--cpu-workers", default="", help="also run --devices cpu with these many workers, e.g. 8,16")
    ap.add_argument("--aligned", action="store_true", help="modules kept in one shard (as with --old)")
    ap.add_argument("--runs", default="1gpu,allgpu", help="comma list of 1gpu, allgpu")
    ap.add_argument("--straddled", action="store_true", help="also convert a size-sharded copy (1 GPU, new code)")
    ap.add_argument("--io-threads", default="", help="also 1 GPU with these K3CONVERT_IO_THREADS, e.g. '2,3;4,6'")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import torch

    root = "/dev/shm/k3bench" if args.memory else args.dir
    os.makedirs(root, exist_ok=True)
    src = os.path.join(root, "src")
    here = os.path.abspath(args.new or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpus": torch.cuda.device_count(),
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                 "cpus": os.cpu_count(), "memory_resident": args.memory, "cold": args.cold, "runs": {}}
    per_expert = 3 * (3072 * 3584 // 2 + 3072 * 3584 // 32)
    layers = args.shards + 1
    experts = max(1, int(args.gb * 1e9 / per_expert / (layers - 1)))
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def build(path: str, *extra: str) -> None:
        if not os.path.exists(os.path.join(path, "config.json")):
            sh([sys.executable, "-m", "converter", "make-fixture", path, "--real-dims", *extra, "--device", device],
               cwd=here)

    # an older version cannot read modules split across shards: compare them on module-aligned shards
    aligned = ["--keep-modules"] if args.old or args.aligned else []
    t0 = time.perf_counter()
    build(src, "--layers", str(layers), "--experts", str(experts), "--shards", str(args.shards), *aligned)
    res["build_s"] = time.perf_counter() - t0
    warm = os.path.join(root, "warm")  # a small checkpoint to fill the Triton and numba caches
    build(warm, "--layers", "2", "--experts", "2", "--shards", "1", "--keep-modules")
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(src, "*.safetensors")))
    res["checkpoint_GB"] = size / 1e9
    print(f"checkpoint {size / 1e9:.2f} GB in {args.shards} shards, {experts} experts x {layers - 1} MoE layers "
          f"({'tmpfs' if args.memory else root}{', modules kept in one shard' if aligned else ''})", flush=True)

    cp_dst = os.path.join(root, "cp")
    for name, cmd in (("cp", f"cp -r {src} {cp_dst}"), ("cp_sync", f"cp -r {src} {cp_dst} && sync")):
        shutil.rmtree(cp_dst, ignore_errors=True)
        dropped = drop_caches() if args.cold else None
        t = sh(["sh", "-c", cmd])
        res["runs"][name] = {"wall_s": t, "wall_GBps": size / t / 1e9, "cache_dropped": dropped}
        print(f"{name:22} {t:7.2f} s  {size / t / 1e9:6.2f} GB/s", flush=True)
    shutil.rmtree(cp_dst, ignore_errors=True)

    gpus = torch.cuda.device_count()
    plans = []
    if "1gpu" in args.runs and gpus:
        plans.append(("1gpu", "cuda:0", 1))
    if "allgpu" in args.runs and gpus > 1:
        plans.append((f"{gpus}gpu", ",".join(f"cuda:{i}" for i in range(gpus)), 1))
    for n in filter(None, args.cpu_workers.split(",")):
        plans.append((f"cpu{n}", "cpu", int(n)))
    codes = [("new", here)] + ([("old", os.path.abspath(args.old))] if args.old else [])
    out = os.path.join(root, "out")
    reference = None
    runs = [(f"{v}_{label}", code, src, devices, workers, None, ())
            for label, devices, workers in plans for v, code in codes]
    if gpus and "1gpu" in args.runs:  # the default is two workers per GPU: one worker alone, for the goal
        runs.append(("new_1gpu_1worker", here, src, "cuda:0", 1, None, ("--workers-per-gpu", "1")))
    for io in filter(None, args.io_threads.split(";")):  # K3CONVERT_IO_THREADS variants, 1 GPU, new code
        runs.append((f"new_1gpu_io{io.replace(',', '_')}", here, src, "cuda:0", 1, io, ()))
    if args.straddled and gpus:  # the same size, shards cut by size (pairs split across shards)
        straddled = os.path.join(root, "src_straddled")
        build(straddled, "--layers", str(layers), "--experts", str(experts), "--shards", str(args.shards))
        runs.append(("new_1gpu_straddled", here, straddled, "cuda:0", 1, None, ()))
    for name, code, source, devices, workers, io, extra in runs:
        convert(code, warm, out, devices, workers, False, io, extra)  # caches warm, as after any first run
        r = convert(code, source, out, devices, workers, args.cold, io, extra)
        if source != src:  # another checkpoint: nothing to compare bytes with
            r["identical_to_first_run"] = None
        else:
            if reference is None:  # the first run's shards are the reference for every other run
                reference = os.path.join(root, "ref")
                shutil.rmtree(reference, ignore_errors=True)
                shutil.copytree(out, reference, ignore=shutil.ignore_patterns(".k3convert"))
            r["identical_to_first_run"] = all(
                subprocess.run(["cmp", "-s", os.path.join(out, n), os.path.join(reference, n)]).returncode == 0
                for n in r["digests"])
        r.pop("digests")
        res["runs"][name] = r
        st = " ".join(f"{k}={v:.1f}" for k, v in sorted(r["stages"].items()))
        print(f"{name:22} {r['wall_s']:7.2f} s  {r['wall_GBps']:6.2f} GB/s wall, steady {r['steady_GBps']:.2f} "
              f"GB/s, start-up {r['startup_s']:.2f} s (workers ready {r['workers_ready_s'] or 0:.2f}: "
              f"{r['ready_parts']}, preflight {r['preflight_s'] or 0:.2f}), maxrss {r['maxrss_GB']:.2f} GB, "
              f"same bytes {r['identical_to_first_run']} | {st}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(os.path.join(root, "ref"), ignore_errors=True)
    with open(os.path.join(args.out, f"bench_gpu_{'mem' if args.memory else 'disk'}.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
