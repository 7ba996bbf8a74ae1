"""Reference MXFP4 -> int4 requantization on the CPU (torch), exact and deterministic.

The unit of work is a flat run of 32-element groups: ``packed [G, 16]`` uint8 (two E2M1
codes a byte, low nibble first) and ``scales [G]`` uint8 (E8M0). A matrix ``[out, in]`` is
``G = out * in / 32`` groups in row-major order, so batching tensors is concatenation.
The GPU kernel (converter/kernels) implements the same function and must give the same bytes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .tables import E2M1_VALUES, E8M0_NAN, QMIN, torch_tables

CHUNK_GROUPS = 1 << 15  # bounds the [groups, candidates] float64 score matrix (~30 MB)


STAT_FIELDS = ("err2", "ref2", "max_abs", "nan_scale", "out_of_range")


@dataclass
class Result:
    """Output of one batch: int4 bytes, bf16 scales, and per-tensor figures.

    ``stats[t]`` holds, for tensor t of the batch, in float64 and absolute units:
    sum (W_int4 - W_mxfp4)^2, sum W_mxfp4^2, max |W_int4 - W_mxfp4|, count of NaN E8M0
    scale bytes (255), count of groups whose int4 scale would leave bf16's normal range.
    A tensor with either count > 0 must not be written (its bytes here are meaningless).
    """

    packed: torch.Tensor   # [G, 16] uint8; little-endian int32 words of compressed-tensors
    scales: torch.Tensor   # [G] bfloat16
    stats: torch.Tensor    # [T, 5] float64, columns STAT_FIELDS
    # [T] float64: sum of squared errors the server's load-time rule (server_rule.py) would give
    # on the same groups, where a kernel computes it on the way (the numba CPU one); else None
    server_err2: torch.Tensor | None = None


def histogram(packed: torch.Tensor) -> torch.Tensor:
    """Code histogram per group: ``[G, 16]`` int32 from ``[G, 16]`` packed bytes."""
    codes = torch.cat((packed & 15, packed >> 4), dim=1).long()
    hist = torch.zeros(packed.shape[0], 16, dtype=torch.int32)
    return hist.scatter_add_(1, codes, torch.ones_like(codes, dtype=torch.int32))


def choose(hist: torch.Tensor, qmin: int = QMIN) -> tuple[torch.Tensor, torch.Tensor]:
    """Winning candidate per group (smallest error, ties to the larger multiplier), and level,
    for codes in ``[qmin, 7]``.

    Groups are split by their largest |value| level (0 = all zero), each searched over only
    the candidates that can win at that level (scripts/tools/derive_candidates.py).
    """
    t = torch_tables(qmin=qmin)
    present = hist > 0
    mag = present[:, :8] | present[:, 8:]
    level = (mag * torch.arange(8, dtype=torch.int64)).amax(dim=1)
    best = torch.zeros(hist.shape[0], dtype=torch.int64)
    h32 = hist.to(torch.float32)
    for lv in range(1, 8):
        rows = (level == lv).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        cand = t[f"members{lv}"]
        parts = h32.index_select(0, rows) @ t[f"split{lv}"]  # exact: see tables.split_score
        k = len(cand)
        score = parts[:, :k].to(torch.float64) + parts[:, k:].to(torch.float64)
        best[rows] = cand[score.argmin(dim=1)]
    return best, level


def _chunk(packed: torch.Tensor, scales: torch.Tensor, qmin: int = QMIN
           ) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    t = torch_tables(qmin=qmin)
    hist = histogram(packed)
    best, level = choose(hist, qmin)
    nonzero = level > 0
    field = t["exp"][best] + scales.to(torch.int32) - 127
    nan = scales == E8M0_NAN
    bad = nonzero & ~nan & ((field < 1) | (field > 254))
    bits = torch.where(nonzero & ~bad & ~nan, (field << 7) | t["mant"][best], 0)
    out = t["byte_map"][best.unsqueeze(1), packed.long()]

    h = hist.to(torch.float64)
    unit = torch.ldexp(torch.ones_like(h[:, 0]), scales.to(torch.int64) - 127)
    unit = torch.where(nan, 0.0, unit)
    err2 = (h * t["err2"].T[best]).sum(1) * unit * unit
    ref2 = (h @ torch.from_numpy(E2M1_VALUES**2)) * unit * unit
    abserr = torch.where(hist > 0, t["abserr"].T[best], 0.0).amax(1) * unit
    figures = [float(err2.sum()), float(ref2.sum()), float(abserr.max()),
               float(nan.sum()), float(bad.sum())]
    return out, bits.to(torch.int16), figures


def requantize(packed: torch.Tensor, scales: torch.Tensor, offsets: list[int] | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None, qmin: int = QMIN) -> Result:
    """Requantize a batch of tensors given as ``G`` groups (CPU reference).

    ``offsets``: group index where each tensor starts, plus ``G`` at the end (default: one
    tensor). The int4 bytes keep the input's nibble positions: a group's 32 values q+8 sit at
    nibble k of little-endian int32 word k//8, as compressed-tensors packs them. ``qmin``: the
    lowest code allowed, -8 (``optimal``) or -7 (``optimal-pm7``: no code -8 is written).
    """
    return by_chunks(functools.partial(_chunk, qmin=qmin), packed, scales, offsets, out)


def by_chunks(chunk, packed: torch.Tensor, scales: torch.Tensor, offsets: list[int] | None = None,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> Result:
    """Apply a rule's ``chunk(packed, scales) -> (bytes, bf16 bits, figures)`` to a batch, a
    bounded chunk at a time, with the fast kernels' contract (shapes, offsets, ``out``)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError("packed and scales must be uint8")
    if packed.dim() != 2 or packed.shape[1] != 16 or scales.shape != packed.shape[:1]:
        raise ValueError(
            f"expected packed [G, 16] and scales [G], got {tuple(packed.shape)} and {tuple(scales.shape)}")
    offsets = list(offsets) if offsets is not None else [0, packed.shape[0]]
    result = torch.empty_like(packed)
    out_scale = torch.empty(scales.shape, dtype=torch.int16, device=packed.device)
    stats = torch.zeros(len(offsets) - 1, len(STAT_FIELDS), dtype=torch.float64)
    for ti, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        for lo in range(start, end, CHUNK_GROUPS):
            hi = min(lo + CHUNK_GROUPS, end)
            result[lo:hi], out_scale[lo:hi], fig = chunk(packed[lo:hi], scales[lo:hi])
            row = stats[ti]
            row[0] += fig[0]
            row[1] += fig[1]
            row[2] = max(float(row[2]), fig[2])
            row[3] += fig[3]
            row[4] += fig[4]
    if out is None:
        return Result(result, out_scale.view(torch.bfloat16), stats)
    out[0].copy_(result)  # same interface as the fast kernels: fill the caller's buffers
    out[1].view(torch.int16).copy_(out_scale)
    return Result(out[0], out[1], stats)
