"""CPU seconds of one shard's conversion, counted rather than timed: for comparing two trees on a
shared machine, where wall time says more about the neighbours than about the code.

Converts SRC into DST in this process (``inline``: the worker's threads are this process's
threads), then prints one JSON line: the process's CPU seconds (user + system, every thread),
wall seconds, and the shard record's busy seconds per stage. Run it alternately with two trees:

    git archive 74b0137 | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    k3convert make-fixture /tmp/shard --real-dims --layers 5 --experts 16 --shards 1   # 1.32 GB
    for i in 1 2 3 4; do
      PYTHONPATH=/tmp/old python scripts/benchmarks/bench_shard_cpu.py /tmp/shard /tmp/out
      PYTHONPATH=$PWD python scripts/benchmarks/bench_shard_cpu.py /tmp/shard /tmp/out
    done

Run each tree once first: numba compiles the CPU kernels into the tree's cache on its first run.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import time

import torch  # noqa: F401  (imported here: the conversion runs inline, in this process)

from converter.run.options import Options
from converter.run.pipeline import convert


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst", help="replaced")
    args = ap.parse_args()
    shutil.rmtree(args.dst, ignore_errors=True)
    c0, t0 = cpu_seconds(), time.perf_counter()
    convert(args.src, args.dst, Options(devices=["cpu"], workers=1, inline=True))
    cpu, wall = cpu_seconds() - c0, time.perf_counter() - t0
    stages: dict[str, float] = {}
    for path in glob.glob(os.path.join(args.dst, ".k3convert", "*.done.json")):
        with open(path) as f:
            for k, v in json.load(f)["stages"].items():
                stages[k] = round(stages.get(k, 0.0) + v, 2)
    import converter
    print(json.dumps({"tree": os.path.dirname(os.path.dirname(os.path.abspath(converter.__file__))),
                      "cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "stages": stages}))


if __name__ == "__main__":
    main()
