"""Throughput of the exact MXFP4 -> bf16 decode (converter.formats.mxfp4.to_bf16), the work a reader
thread does for each 4 MiB piece of a module written as bf16 (items.Dequant: the shared experts of
amd-quark's templates). Realistic groups as bench_cpu_kernel's; prints the best of ``--repeats`` per
piece (its buffers reused, as ShardConverter's readers do), as GB/s of MXFP4 read and of bf16 written, on one thread (``ShardConverter`` runs 3 readers).

    PYTHONPATH=. python scripts/benchmarks/bench_dequant.py [--cols 4096] [--repeats 20]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from bench_cpu_kernel import realistic_groups

from converter.formats import mxfp4
from converter.run.shard import DEQUANT_PIECE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols", type=int, default=4096, help="the module's in-dim (a multiple of 32)")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    rows = max(1, DEQUANT_PIECE // (2 * a.cols))
    groups = rows * a.cols // 32
    packed, scales = realistic_groups(-(-groups // 64) * 64)   # it makes groups 64 at a time
    packed = packed[:groups].numpy().reshape(rows, a.cols // 2)
    scales = scales[:groups].numpy().reshape(rows, a.cols // 32)
    out, scratch = np.empty(rows * a.cols, np.uint16), np.empty(rows * a.cols, np.float32)  # reused, as a reader's
    mxfp4.to_bf16(packed, scales, out, scratch)
    best = float("inf")
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        mxfp4.to_bf16(packed, scales, out, scratch)
        best = min(best, time.perf_counter() - t0)
    size_in, size_out = packed.nbytes + scales.nbytes, rows * a.cols * 2
    print(f"piece {rows} x {a.cols}: {best * 1e3:.2f} ms; {size_in / best / 1e9:.2f} GB/s MXFP4 in, "
          f"{size_out / best / 1e9:.2f} GB/s bf16 out (one thread)")


if __name__ == "__main__":
    main()
