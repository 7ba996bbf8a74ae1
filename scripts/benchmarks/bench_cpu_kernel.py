"""Throughput of the numba CPU requantizer, per thread, on realistic MXFP4 groups.

Groups come from Student-t weights (heavy tails, as in real expert matrices) through the OCP
MX scale rule (converter.formats.mxfp4.encode). Prints M groups/s per thread on 1 thread and
on all of numba's threads (total / threads), the best of ``--repeats`` timed calls after a
warm-up call (compilation excluded), and the matching GB/s of MXFP4 input (17 bytes a group).
``--kernel FILE`` times another version of converter/quant/cpu_kernel.py (e.g. an older one
from ``git show REV:converter/quant/cpu_kernel.py``), after checking it gives the same bytes.

    PYTHONPATH=. python scripts/benchmarks/bench_cpu_kernel.py [--groups 1048576] [--repeats 5] [--kernel FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from types import ModuleType

import numba
import torch

from converter.formats.mxfp4 import encode
from converter.quant import cpu_kernel

IN_BYTES = 17  # 16 packed bytes + 1 E8M0 scale byte


def realistic_groups(groups: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``groups`` (a multiple of 64) MXFP4 groups of Student-t weights: packed [G, 16], scales [G]."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(groups // 64, 64 * 32, generator=gen)
    w = w / torch.sqrt(torch.empty_like(w).exponential_(0.5, generator=gen) / 2)  # Student t, 2 degrees of freedom
    packed, scales = encode(w)
    return packed.reshape(-1, 16).contiguous(), scales.reshape(-1).contiguous()


def load_kernel(path: str) -> ModuleType:
    """A cpu_kernel.py from elsewhere, imported inside converter.quant so its relative imports work."""
    spec = importlib.util.spec_from_file_location("converter.quant._bench_kernel", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rate(kernel: ModuleType, packed: torch.Tensor, scales: torch.Tensor, threads: int, repeats: int) -> float:
    """Best M groups/s per thread of ``kernel.requantize`` on ``threads`` numba threads."""
    numba.set_num_threads(threads)
    out = (torch.empty_like(packed), torch.empty(scales.shape, dtype=torch.bfloat16))
    kernel.requantize(packed, scales, out=out)  # compile / load from cache
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        kernel.requantize(packed, scales, out=out)
        best = min(best, time.perf_counter() - t0)
    return packed.shape[0] / best / 1e6 / threads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kernel", help="another cpu_kernel.py to time instead of the package's")
    args = ap.parse_args()
    packed, scales = realistic_groups(-(-args.groups // 64) * 64)
    kernel = cpu_kernel
    if args.kernel:
        kernel = load_kernel(args.kernel)
        a, b = kernel.requantize(packed, scales), cpu_kernel.requantize(packed, scales)
        same = torch.equal(a.packed, b.packed) and torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))
        if not same:
            print(f"{args.kernel}: different bytes from converter/quant/cpu_kernel.py", file=sys.stderr)
            return 1
    print(f"{packed.shape[0]} groups, kernel {args.kernel or cpu_kernel.__file__}")
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        r = rate(kernel, packed, scales, threads, args.repeats)
        print(f"{threads:3d} thread(s): {r:7.2f} M groups/s per thread, {r * threads:7.2f} M groups/s in all "
              f"= {r * threads * IN_BYTES / 1e3:5.2f} GB/s of MXFP4 input")
    return 0


if __name__ == "__main__":
    sys.exit(main())
