"""FP8 block linears (e4m3 weight, one fp32 scale per block) decoded to bf16 (``items.Fp8Dequant``).

The value is what a server's block dequantization computes: each e4m3 value as fp32 times its
block's fp32 scale (one correctly rounded fp32 product), then rounded to bf16 (round to nearest
even). With power-of-two scales (``scale_fmt: ue8m0``) every step is exact; otherwise the bf16
value is within 2^-8 of the product, relative (bf16's unit roundoff; e4m3's own is 2^-4).
"""
from __future__ import annotations

import torch


def to_bf16(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], first_row: int = 0) -> torch.Tensor:
    """bf16 ``[rows, cols]`` of ``weight`` (e4m3 or its uint8 bytes, rows ``first_row``.. of the
    tensor) under ``scales`` (fp32, the whole tensor's ``[ceil(R / bn), ceil(C / bk)]``)."""
    w = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
    rows, cols = w.shape
    bn, bk = block
    r = torch.arange(first_row, first_row + rows) // bn
    c = torch.arange(cols) // bk
    return (w.float() * scales.float()[r][:, c]).to(torch.bfloat16)


def rel_error(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> tuple[float, float]:
    """(max |bf16 - exact| / |exact| over non-zero values, ||bf16 - exact|| / ||exact||): what
    ``to_bf16`` adds to the FP8 values (exact: float64 holds every e4m3 x fp32 product)."""
    w = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
    rows, cols = w.shape
    r, c = torch.arange(rows) // block[0], torch.arange(cols) // block[1]
    exact = w.double() * scales.double()[r][:, c]
    diff = to_bf16(w, scales, block).double() - exact
    nz = exact != 0
    worst = float((diff[nz].abs() / exact[nz].abs()).max()) if bool(nz.any()) else 0.0
    norm = float(exact.norm())
    return worst, float(diff.norm()) / norm if norm else 0.0
