"""The fast CPU requantizer: the same function as requant.requantize, compiled with numba.

One pass per group, nothing materialized: histogram, an int32 score per candidate of the
group's class accumulated over the codes present only, argmin, then the byte and scale
lookups. The integer scores are exact (tables.class_int_scores), so threads and vector
widths cannot change a single output byte.
"""
from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch

from .requant import STAT_FIELDS, Result
from .tables import E2M1_VALUES, class_int_scores, tables

CHUNK = 4096  # groups per parallel work item


@functools.cache
def _packed_tables():
    """Class-major int32 tables, indexed [level, magnitude, j] for the j-th member of the class."""
    t = tables()
    kpad = -(-max(len(ix) for ix in t.members.values()) // 16) * 16  # whole SIMD vectors
    score = np.zeros((8, 16, kpad), dtype=np.int32)
    init = np.full((8, kpad), 1 << 30, dtype=np.int32)  # padding never wins: sums stay < 2**27
    members = np.zeros((8, kpad), dtype=np.int64)
    for lv, ix in t.members.items():
        score[lv, :, :len(ix)] = class_int_scores(t.score[:, ix], lv)
        init[lv, :len(ix)] = 0
        members[lv, :len(ix)] = ix
    # +L and -L score alike except where the int4 range clamps asymmetrically (-8 vs 7): fold
    # each magnitude's two codes into one row and keep the (rare) -L difference apart.
    # int32 arithmetic wraps modulo 2**32, and the true sum fits, so the fold stays exact.
    fold = score[:, :8, :].copy()
    diff = score[:, 8:, :] - score[:, :8, :]
    has_diff = np.any(diff != 0, axis=2)
    return (fold, diff, has_diff, init, members, t.byte_map, t.exp, t.mant,
            np.ascontiguousarray(t.err2.T), np.ascontiguousarray(t.abserr.T), E2M1_VALUES**2,
            np.ldexp(1.0, np.arange(256) - 127))


@numba.njit(parallel=True, cache=True, nogil=True)
def _run(packed, scales, out, out_scale, partial, fold, diff, has_diff, init, members, byte_map, exp, mant,
         err2_t, abserr_t, ref2, units):  # pragma: no cover - compiled
    n = packed.shape[0]
    nchunks = (n + CHUNK - 1) // CHUNK
    kpad = fold.shape[2]
    for ci in numba.prange(nchunks):
        hist = np.zeros(16, dtype=np.int32)
        sc = np.empty(kpad, dtype=np.int32)
        e2 = 0.0
        r2 = 0.0
        mx = 0.0
        nan = 0
        bad = 0
        for g in range(ci * CHUNK, min(n, (ci + 1) * CHUNK)):
            hist[:] = 0
            for j in range(16):
                b = packed[g, j]
                hist[b & 15] += 1
                hist[b >> 4] += 1
            level = 0
            for c in range(1, 8):
                if hist[c] + hist[c + 8] > 0:
                    level = c
            s = np.int64(scales[g])
            kg = 0
            if level > 0:
                for j in range(kpad):
                    sc[j] = init[level, j]
                for mag in range(1, level + 1):
                    h = hist[mag] + hist[mag + 8]
                    if h > 0:
                        for j in range(kpad):
                            sc[j] += h * fold[level, mag, j]
                    h = hist[mag + 8]
                    if h > 0 and has_diff[level, mag]:
                        for j in range(kpad):
                            sc[j] += h * diff[level, mag, j]
                low = sc[0]
                for j in range(kpad):  # a vectorized min, then its first index: the tie rule
                    low = min(low, sc[j])
                best = 0
                while sc[best] != low:
                    best += 1
                kg = members[level, best]
            for j in range(16):
                out[g, j] = byte_map[kg, packed[g, j]]
            field = exp[kg] + s - 127
            if s == 255:
                nan += 1
                out_scale[g] = 0
                continue
            if level == 0:
                out_scale[g] = 0
                continue
            if field < 1 or field > 254:
                bad += 1
                out_scale[g] = 0
                continue
            out_scale[g] = (field << 7) | mant[kg]
            unit = units[s]
            ge = 0.0
            gr = 0.0
            ga = 0.0
            for c in range(16):
                h = hist[c]
                if h > 0:
                    ge += h * err2_t[kg, c]
                    gr += h * ref2[c]
                    if abserr_t[kg, c] > ga:
                        ga = abserr_t[kg, c]
            e2 += ge * unit * unit
            r2 += gr * unit * unit
            if ga * unit > mx:
                mx = ga * unit
        partial[ci, 0] = e2
        partial[ci, 1] = r2
        partial[ci, 2] = mx
        partial[ci, 3] = nan
        partial[ci, 4] = bad


def requantize(packed: torch.Tensor, scales: torch.Tensor, offsets: list[int] | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> Result:
    """Same contract and bytes as ``requant.requantize``, for CPU tensors, much faster.

    ``out``: (uint8 [G, 16], bf16 [G]) buffers to write into, e.g. reused ones.
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or packed.dim() != 2 \
            or packed.shape[1] != 16 or scales.shape != packed.shape[:1]:
        raise ValueError(f"expected uint8 packed [G, 16] and scales [G], got {tuple(packed.shape)}, {tuple(scales.shape)}")
    offsets = list(offsets) if offsets is not None else [0, packed.shape[0]]
    p, s = packed.numpy(), scales.numpy()
    if out is None:
        out = (torch.empty_like(packed), torch.empty(scales.shape, dtype=torch.bfloat16))
    result_packed, result_scales = out
    out, out_scale = result_packed.numpy(), result_scales.view(torch.int16).numpy()
    stats = np.zeros((len(offsets) - 1, len(STAT_FIELDS)))
    tabs = _packed_tables()
    for ti, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        if hi == lo:
            continue
        partial = np.zeros(((hi - lo + CHUNK - 1) // CHUNK, len(STAT_FIELDS)))
        _run(p[lo:hi], s[lo:hi], out[lo:hi], out_scale[lo:hi], partial, *tabs)
        stats[ti] = partial.sum(0)
        stats[ti, 2] = partial[:, 2].max()
    return Result(result_packed, result_scales, torch.from_numpy(stats))


@numba.njit(parallel=True, cache=True, nogil=True)
def _matvec_error(packed, scales, out, out_scale, cols, x, lut):  # pragma: no cover - compiled
    gpr = cols // 32  # groups per row
    rows = packed.shape[0] // gpr
    num = np.zeros(rows)
    den = np.zeros(rows)
    for r in numba.prange(rows):
        y = 0.0
        yq = 0.0
        for gi in range(gpr):
            g = r * gpr + gi
            unit = math.ldexp(1.0, np.int64(scales[g]) - 127)
            sq = out_scale[g]
            acc = 0.0
            accq = 0.0
            for j in range(16):
                b = packed[g, j]
                o = out[g, j]
                x0 = x[gi * 32 + 2 * j]
                x1 = x[gi * 32 + 2 * j + 1]
                acc += lut[b & 15] * x0 + lut[b >> 4] * x1
                accq += ((o & 15) - 8.0) * x0 + ((o >> 4) - 8.0) * x1
            y += acc * unit
            yq += accq * sq
        num[r] = (yq - y) ** 2
        den[r] = y * y
    return math.sqrt(num.sum()), math.sqrt(den.sum())


def output_error(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, out_scales: torch.Tensor,
                 cols: int, x: torch.Tensor) -> float:
    """||(W_int4 - W) x|| / ||W x|| for one matrix given as groups, without decoding it whole."""
    num, den = _matvec_error(packed.numpy(), scales.numpy(), out.numpy(), out_scales.double().numpy(),
                             cols, x.double().numpy(), E2M1_VALUES)
    return num / den if den > 0 else 0.0
