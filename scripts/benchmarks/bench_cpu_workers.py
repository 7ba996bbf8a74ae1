"""CPU worker-count sweep: ``--workers`` 1, 2, 4, 8, 16 and ``auto`` on one memory-resident checkpoint.

Source and outputs live in tmpfs (``/dev/shm``), so the page cache holds everything and the
disk plays no part; the conversions run with ``--devices cpu`` and no GPU visible. Each
setting runs ``--runs`` times (in order, then in reverse order, ...), the best wall time is
kept; an untimed warm-up conversion of a small checkpoint first fills the numba cache, and
an untimed full-size one touches the memory the runs will use (on a VM that grows its memory
on first touch, the first run would otherwise pay for it). Every run's shard digests (the
chunked SHA-256 of the written files) must equal the first run's: byte-identical outputs.

    PYTHONPATH=. python scripts/benchmarks/bench_cpu_workers.py --gb 12 --shards 16   # the BENCHMARKS.md run
    PYTHONPATH=. python scripts/benchmarks/bench_cpu_workers.py --gb 0.3 --shards 4 --workers 1,2,auto --runs 1  # smoke

Prints a table and whether ``auto`` is within 10% of the best setting's wall time; writes
``bench_cpu_workers.json`` to --out. Timing helpers are bench_gpu.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_gpu import convert, sh  # noqa: E402  (one timing harness for every end-to-end benchmark)

PER_EXPERT = 3 * (3072 * 3584 // 2 + 3072 * 3584 // 32)  # one real-dims expert's MXFP4 bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm/k3workers", help="source and outputs (tmpfs: memory-resident)")
    ap.add_argument("--gb", type=float, default=12.0, help="size of the MXFP4 checkpoint to build")
    ap.add_argument("--shards", type=int, default=16, help="shards (cut by size); one MoE layer per shard")
    ap.add_argument("--workers", default="1,2,4,8,16,auto", help="the settings to sweep")
    ap.add_argument("--runs", type=int, default=2, help="runs of each setting; the best is kept")
    ap.add_argument("--fixture-device", default=None, help="where make-fixture draws weights [cuda if any]")
    ap.add_argument("--build-only", action="store_true", help="only build the checkpoints (a first, shorter command)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    code = os.path.dirname(os.path.dirname(HERE))  # the repository: scripts/benchmarks/..
    settings = [w.strip() for w in args.workers.split(",") if w.strip()]
    os.makedirs(args.dir, exist_ok=True)
    src, warm, out = (os.path.join(args.dir, n) for n in ("src", "warm", "out"))
    layers = args.shards + 1
    experts = max(1, int(args.gb * 1e9 / PER_EXPERT / args.shards))
    device = args.fixture_device
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    for path, shape in ((src, ("--layers", str(layers), "--experts", str(experts), "--shards", str(args.shards))),
                        (warm, ("--layers", "2", "--experts", "2", "--shards", "1"))):
        if not os.path.exists(os.path.join(path, "config.json")):
            sh([sys.executable, "-m", "converter", "make-fixture", path, "--real-dims", *shape, "--device", device],
               cwd=code)
    build_s = time.perf_counter() - t0
    files = [e for e in os.scandir(src) if e.name.endswith(".safetensors")]
    size, shards = sum(e.stat().st_size for e in files), len(files)
    cores = len(os.sched_getaffinity(0))
    print(f"checkpoint {size / 1e9:.2f} GB in {shards} shards (built in {build_s:.0f} s), {cores} cores, "
          f"tmpfs {args.dir}", flush=True)
    if args.build_only:
        return 0

    convert(code, warm, out, "cpu", 1, False)              # numba's compiled kernels cached
    convert(code, src, out, "cpu", settings[-1], False)    # memory touched once, untimed
    runs: dict[str, list[dict]] = {w: [] for w in settings}
    reference: dict | None = None
    for r in range(args.runs):
        for w in settings if r % 2 == 0 else settings[::-1]:
            res = convert(code, src, out, "cpu", w, False)
            digests = res.pop("digests")
            reference = reference or digests
            res["identical"] = digests == reference
            runs[w].append(res)
            print(f"  --workers {w:>4}: {res['wall_s']:6.2f} s wall, steady {res['steady_GBps']:.2f} GB/s, "
                  f"start-up {res['startup_s']:.2f} s, same bytes {res['identical']} ({res['workers']})", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    results = {w: {**min(rs, key=lambda x: x["wall_s"]), "identical": all(x["identical"] for x in rs)}
               for w, rs in runs.items()}

    best = min(results, key=lambda w: results[w]["wall_s"])
    # stage seconds summed over shards: the compute thread's own work (kernel + sampled output
    # error) and its waits for reads and for buffers the writers hold; what limits each setting
    print(f"\n{'--workers':>10} {'chosen':>28} {'wall s':>7} {'GB/s':>5} {'steady':>6} {'start s':>7} "
          f"{'vs best':>7} {'compute':>8} {'sample':>7} {'w_read':>7} {'w_write':>7} {'RSS GB':>6} same")
    for w, res in results.items():
        chosen = (res["workers"] or "").split(" (")[0].removeprefix("cpu: ")
        st = res["stages"]
        print(f"{w:>10} {chosen:>28} {res['wall_s']:7.2f} {res['wall_GBps']:5.2f} {res['steady_GBps']:6.2f} "
              f"{res['startup_s']:7.2f} {res['wall_s'] / results[best]['wall_s']:6.2f}x {st.get('compute', 0):8.1f} "
              f"{st.get('sample', 0):7.1f} {st.get('wait_read', 0):7.1f} {st.get('wait_write', 0):7.1f} "
              f"{res['maxrss_GB']:6.2f} {res['identical']}")
    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": cores,
               "checkpoint_GB": size / 1e9, "shards": shards, "runs": args.runs, "best": best,
               "results": results, "all_runs": runs}
    if "auto" in results:
        ratio = results["auto"]["wall_s"] / results[best]["wall_s"]
        summary["auto_vs_best"] = ratio
        print(f"\nauto chose {results['auto']['workers']}: {ratio:.3f}x the best (--workers {best}); "
              f"goal <= 1.10x: {'met' if ratio <= 1.10 else 'MISSED'}")
    identical = all(r["identical"] for r in results.values())
    print(f"every run byte-identical to the first: {identical}")
    with open(os.path.join(args.out, "bench_cpu_workers.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
