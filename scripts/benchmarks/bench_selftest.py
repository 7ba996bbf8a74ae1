"""What the vLLM plugin's load-time kernel self-test costs at Kimi K3's real sizes (BENCHMARKS.md).

    python scripts/benchmarks/bench_selftest.py [--device cuda] [--repeat 5]

Times converter.vllm_plugin.selftest as moe_method runs it on the first routed-experts layer: the
copies of the sampled experts (selftest.expert_copy, first to last local expert: printed), one probe
per aiter tile variant (8, 1025 and 8193 tokens: selftest.TILE_BANDS), the float32 reference and the
comparison, with the kernel call itself replaced by a float32 reference computation of every row
(AITER's kernel is not available here), timed apart: the self-test's own cost is the total without
it; the kernel's own time is three MoE calls of 8, 1025 and 8193 tokens. Also times the diagnosis
that runs only when the kernel is wrong (at decode size). Deployments: TP 8 (896 local experts, 384
channels per rank) and TP 8 with expert parallelism over 8 ranks (112 local experts, all 3072 channels).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from converter.vllm_plugin import selftest  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 3584, 3072, 896, 16


def layer(local: int, inter: int, device: str) -> tuple[torch.Tensor, ...]:
    """Random CT int4 words and bf16 scales of `local` experts (int32 [E, 2I, H/8] etc.)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = torch.randint(-2**31, 2**31 - 1, (local, 2 * inter, HIDDEN // 8), dtype=torch.int32, generator=g)
    w2 = torch.randint(-2**31, 2**31 - 1, (local, HIDDEN, inter // 8), dtype=torch.int32, generator=g)
    s13 = (torch.rand(local, 2 * inter, HIDDEN // 32, generator=g) * 0.01).to(torch.bfloat16)
    s2 = (torch.rand(local, HIDDEN, inter // 32, generator=g) * 0.01).to(torch.bfloat16)
    return tuple(t.to(device) for t in (w13, s13, w2, s2))


def one(w13, s13, w2, s2, emap, inter: int, act, device: str) -> tuple[float, float, float]:
    """(seconds of a passing self-test, seconds of its kernel stand-in, seconds of the diagnosis a
    failing one adds)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    local_ids = selftest.local_ids(emap, EXPERTS)
    chosen, remote = selftest.choose_experts(local_ids, EXPERTS, TOP_K)
    experts = {}
    for gid in chosen:
        i = gid if emap is None else int(emap[gid])
        experts[gid] = selftest.expert_copy(w13[i], s13[i], w2[i], s2[i], inter)
    kernel = [0.0]

    def apply(p):          # stands in for the kernel: the float32 reference of every row (timed apart)
        sync()
        t = time.perf_counter()
        y = selftest.reference(p.x, p.topk_weights, p.topk_ids, {g: experts[g] for g in p.local},
                               act).to(torch.bfloat16)
        sync()
        kernel[0] += time.perf_counter() - t
        return y
    sync()
    t_setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    out = selftest.run(apply, experts, remote, act)
    sync()
    passed = t_setup + time.perf_counter() - t1
    stand_in = kernel[0]
    assert out.problem is None, out
    probe = selftest.make_probe(experts, remote, act)
    y = apply(probe)
    sync()
    t2 = time.perf_counter()
    selftest.diagnose(probe, y * 0, experts, act, out.minus_eight)
    sync()
    return passed, stand_in, time.perf_counter() - t2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    act = selftest.Activation(4.0, 25.0)
    cases = {"TP 8": (EXPERTS, INTER // 8, None),
             "TP 8 + EP 8": (EXPERTS // 8, INTER, torch.cat((torch.arange(EXPERTS // 8, dtype=torch.int32),
                                                            torch.full((EXPERTS - EXPERTS // 8,), -1,
                                                                       dtype=torch.int32))))}
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"device: {args.device} ({name}), torch {torch.__version__}")
    for case, (local, inter, emap) in cases.items():
        chosen, remote = selftest.choose_experts(selftest.local_ids(emap, EXPERTS), EXPERTS, TOP_K)
        print(f"{case}: sampled local experts {chosen} of {local} ({len(remote)} remote); probes of "
              f"{', '.join(str(selftest.probe_tokens(t)) for _, t in selftest.TILE_BANDS)} tokens")
        tensors = layer(local, inter, args.device)
        emap = None if emap is None else emap.to(args.device)
        runs = [one(*tensors, emap, inter, act, args.device) for _ in range(args.repeat + 1)][1:]
        del tensors
        ok = statistics.median(r[0] for r in runs)
        kernel = statistics.median(r[1] for r in runs)
        ours = statistics.median(r[0] - r[1] for r in runs)
        diag = statistics.median(r[2] for r in runs)
        print(f"{case}: self-test {ok * 1e3:.1f} ms with the float32 kernel stand-in ({kernel * 1e3:.1f} ms of it), "
              f"{ours * 1e3:.1f} ms without (median of {args.repeat}, after one warm-up); "
              f"diagnosis on failure +{diag * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
