"""What ``--fp8-bf16-at-tp`` costs (issue 35 §2): MiMo-V2-Flash-shaped q/k/v of one full-attention
layer (hidden 4096; q 64 heads x 192, k 4 x 192, v 4 x 128 rows), weights drawn Student-t (4 degrees of
freedom) / sqrt(in) as a trained model's, made FP8 by the plain block rule (e4m3, fp32 scale =
amax / 448 per 128x128 block), then written as bf16 by ``converter.formats.fp8_block.to_bf16`` (what
the converter writes). Prints, per tensor: the bf16 value's error against the FP8 value (max per value,
relative RMS), FP8's own error against the original weight and the bf16's, and for y = W x over 64
heavy-tailed tokens the output error against the original of the layer vLLM serves each way: FP8
(W8A8: weights e4m3, activations quantized dynamically per token and 128, as vLLM's block FP8 linear
does) and bf16 (W16A16: the unquantized layer the option gives). All in float64.

    PYTHONPATH=. python scripts/benchmarks/bench_fp8_bf16.py [--seed 0]
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from converter.formats import fp8_block

SHAPES = (("q_proj", 64 * 192), ("k_proj", 4 * 192), ("v_proj", 4 * 128))
HIDDEN, BLOCK = 4096, 128


def heavy_tailed(*shape: int) -> torch.Tensor:
    return torch.distributions.StudentT(4.0).sample(shape) / math.sqrt(shape[-1])


def fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [out, in] and fp32 [out/128, in/128] with w ~ q * s (amax / 448 per block)."""
    r, c = w.shape
    blocks = w.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn).reshape(r, c)
    return q, s


def act_fp8(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token, per-128 e4m3 activation quantization, dequantized (float64)."""
    g = x.reshape(x.shape[0], -1, BLOCK)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((g / s).float().to(torch.float8_e4m3fn).double() * s).reshape(x.shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    torch.manual_seed(ap.parse_args().seed)
    x = heavy_tailed(64, HIDDEN).double()
    for name, rows in SHAPES:
        w = heavy_tailed(rows, HIDDEN)
        q, s = fp8(w)
        exact = q.double() * s.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        t = time.perf_counter()
        b = fp8_block.to_bf16(q, s, (BLOCK, BLOCK))
        took = time.perf_counter() - t
        worst, added = fp8_block.rel_error(q, s, (BLOCK, BLOCK))
        ref = w.double()
        rel = lambda a, r: float((a - r).norm() / r.norm())  # noqa: E731
        y = x @ ref.T
        print(f"{name} [{rows}, {HIDDEN}]: bf16 vs FP8 values: max {worst:.2e}, rel RMS {added:.2e}; "
              f"vs original weight: FP8 {rel(exact, ref):.4e}, bf16 {rel(b.double(), ref):.4e}; "
              f"y = W x vs original: FP8 layer (W8A8) {rel(act_fp8(x) @ exact.T, y):.4e}, "
              f"bf16 layer (W16A16) {rel(x.bfloat16().double() @ b.double().T, y):.4e}; decode {took:.2f} s")


if __name__ == "__main__":
    main()
