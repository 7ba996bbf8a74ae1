"""Cost of the scale rules and of the report's server-rule comparison on the CPU (numba).

Times, on one numba thread and in CPU seconds (so other load on a shared machine counts
less than in wall time), interleaved and best of ``--repeats``:

* ``optimal``: today's requantizer (it computes the server rule's error on the way);
* ``optimal-pm7``: the same kernel on the [-7, 7] range's tables;
* ``optimal, before``: the same kernel from ``--before`` (e.g. ``git show REV:converter/quant/cpu_kernel.py``),
  without the comparison: the difference is the comparison's cost;
* ``vllm-gfx942``: the server rule's kernel alone (a ``--scale-rule vllm-gfx942`` run also runs
  the optimal one, for the comparison).

    PYTHONPATH=. python scripts/benchmarks/bench_scale_rule.py [--groups 1048576] [--repeats 7] [--before FILE]

The GPU counterpart (run on a GPU machine): ``python scripts/benchmarks/bench_scale_rule.py --device cuda``
times the Triton server-rule kernel (the optimal run's extra pass) against the Triton optimal
kernel, in CUDA-event milliseconds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu_kernel import load_kernel, realistic_groups  # noqa: E402


def cpu_seconds(fn, repeats: int) -> float:
    fn()  # compile / load from cache
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def gpu_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--before", help="an older cpu_kernel.py to time the optimal kernel without the comparison")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    packed, scales = realistic_groups(-(-args.groups // 64) * 64)
    g = packed.shape[0]
    if args.device != "cpu":
        from converter.kernels import triton_requant, triton_server_rule

        p, s = packed.to(args.device), scales.to(args.device)
        opt = triton_requant.prepare(p, s)
        t_opt = gpu_ms(opt, args.repeats)
        t_srv = gpu_ms(lambda: triton_server_rule.requantize(p, s), args.repeats)
        print(f"{g} groups on {torch.cuda.get_device_name(p.device)}: optimal kernel {t_opt:.3f} ms, "
              f"server-rule pass {t_srv:.3f} ms = +{100 * t_srv / t_opt:.1f}% for the optimal run's comparison")
        return 0

    import numba

    from converter.quant import cpu_kernel

    numba.set_num_threads(1)
    out = (torch.empty_like(packed), torch.empty(scales.shape, dtype=torch.bfloat16))
    runs = {"optimal": lambda: cpu_kernel.requantize(packed, scales, out=out),
            "optimal-pm7": lambda: cpu_kernel.requantize(packed, scales, out=out, qmin=-7),
            "vllm-gfx942": lambda: cpu_kernel.server_requantize(packed, scales, out=out)}
    if args.before:
        old = load_kernel(args.before)
        runs["optimal, before"] = lambda: old.requantize(packed, scales, out=out)
    best = {k: float("inf") for k in runs}
    for _ in range(args.repeats):  # interleaved: drifting load hits every variant alike
        for k, fn in runs.items():
            best[k] = min(best[k], cpu_seconds(fn, 1))
    for k, t in best.items():
        print(f"{k:>16}: {t * 1e9 / g:6.1f} ns/group on one thread ({g / t / 1e6:5.2f} M groups/s)")
    if args.before:
        extra = best["optimal"] / best["optimal, before"] - 1
        print(f"comparison figures cost the optimal kernel {100 * extra:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
