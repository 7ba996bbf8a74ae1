"""Exact lookup tables for MXFP4 -> int4 group-32 requantization (docs/spec.md §5).

A block's values are ``LUT[c] * 2**(s-127)`` and its int4 scale is ``m * 2**(s-127)`` for
a bf16 multiplier ``m``; the block's error then depends only on the histogram of its codes
and on ``m``. The tables here are functions of the candidate multipliers, computed once in
float64, where every quantity involved is exact (docs/maths.md).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .candidates import BY_QMIN

# FP4 E2M1 code -> value; codes 8..15 are the negatives (8 is -0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float64,
)
QMIN, QMAX = -8, 7  # the format's code range; ``--scale-rule optimal-pm7`` searches [-7, 7] (rules.OPTIMA)
GROUP = 32
E8M0_NAN = 255


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> exact float64 values."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def best_q(values: np.ndarray, m: np.ndarray, qmin: int = QMIN) -> np.ndarray:
    """Nearest int4 level in ``[qmin, 7]`` for each (value, multiplier), ties towards zero: ``[V, K]`` int8.

    Every level is tried, so no library's rounding mode is involved.
    """
    levels = np.arange(qmin, QMAX + 1, dtype=np.float64)
    order = np.argsort(np.abs(levels), kind="stable")  # argmin keeps the first: smallest |q|
    levels = levels[order]
    err = (levels[None, None, :] * m[None, :, None] - values[:, None, None]) ** 2
    return levels[np.argmin(err, axis=2)].astype(np.int8)


def score_table(m: np.ndarray, qmin: int = QMIN) -> tuple[np.ndarray, np.ndarray]:
    """Per (code, candidate): the int4 level in ``[qmin, 7]``, and ``(q m - L)^2 - L^2``.

    Summed over a block's codes the second ranks candidates exactly like the squared error,
    and every partial sum is exact in float64.
    """
    q = best_q(E2M1_VALUES, m, qmin)
    qm = q.astype(np.float64) * m[None, :]
    return q, qm * qm - 2.0 * qm * E2M1_VALUES[:, None]


@dataclass(frozen=True)
class Tables:
    """Everything a requantizer needs, indexed by candidate k (priority order)."""

    q: np.ndarray          # [16, K] int8: int4 level for each code
    score: np.ndarray      # [16, K] float64: ranking score per code
    err2: np.ndarray       # [16, K] float64: (q m - L)^2
    abserr: np.ndarray     # [16, K] float64: |q m - L|
    byte_map: np.ndarray   # [K, 256] uint8: MXFP4 byte (two codes) -> int4 byte (two q+8)
    exp: np.ndarray        # [K] int32: bf16 exponent field of m
    mant: np.ndarray       # [K] int32: bf16 mantissa bits of m
    members: dict[int, np.ndarray]  # largest-magnitude level -> candidate indices


@functools.cache
def tables(qmin: int = QMIN) -> Tables:
    """The tables of the optimum over codes ``[qmin, 7]`` (-8: ``optimal``, -7: ``optimal-pm7``)."""
    bits_t, class_members = BY_QMIN[qmin]
    bits = np.array(bits_t, dtype=np.uint32)
    m = bf16_bits_to_float(bits)
    q, score = score_table(m, qmin)
    d = q.astype(np.float64) * m[None, :] - E2M1_VALUES[:, None]
    b = np.arange(256)
    nib = (q.astype(np.int16) + 8).astype(np.uint8)  # [16, K]
    byte_map = (nib[b & 15, :] | (nib[b >> 4, :] << 4)).T.copy()
    return Tables(
        q=q, score=score, err2=d * d, abserr=np.abs(d), byte_map=byte_map,
        exp=((bits >> 7) & 0xFF).astype(np.int32), mant=(bits & 0x7F).astype(np.int32),
        members={lv: np.array(ix, dtype=np.int64) for lv, ix in class_members.items()},
    )


@functools.cache
def torch_tables(device: str = "cpu", qmin: int = QMIN) -> dict[str, torch.Tensor]:
    """The same tables as torch tensors on ``device`` (cached per device and code range)."""
    t = tables(qmin)
    out = {name: torch.from_numpy(np.ascontiguousarray(getattr(t, name))).to(device)
           for name in ("q", "score", "err2", "abserr", "byte_map", "exp", "mant")}
    for lv, ix in t.members.items():
        out[f"members{lv}"] = torch.from_numpy(ix).to(device)
        out[f"split{lv}"] = torch.from_numpy(split_score(t.score[:, ix])).to(device)
    return out


def class_int_scores(score: np.ndarray, level: int) -> np.ndarray:
    """A class's ``[16, K]`` scores as exact int32 (codes above ``level`` zeroed).

    Within a class the scores are multiples of a power of two ``u`` with
    ``32 * max|score| / u < 2**31``, so integer sums over a block's codes (counts <= 32)
    rank candidates exactly as the true errors do, ties included.
    """
    allowed = np.array([(c & 7) <= level for c in range(16)])
    s = np.where(allowed[:, None], score, 0.0)
    for e in range(0, 40):
        scaled = s * 2.0**e
        if np.all(scaled == np.round(scaled)):
            break
    assert 32 * np.abs(scaled).max() < 2**31, "class scores do not fit int32"
    return scaled.astype(np.int32)


def split_score(score: np.ndarray) -> np.ndarray:
    """``[16, K]`` scores -> ``[16, 2K]`` float32 (high part | low part), each exact.

    Scores are multiples of 2**-22 below 2**6; the high part keeps multiples of 2**-9
    (< 2**15 units) and the low part the rest (< 2**13 units). A histogram (counts summing
    to at most 32) times either part sums to under 2**24 units, so a float32 GEMM computes
    both exactly in any order, and their float64 sum is the exact score.
    """
    hi = np.round(score * 2.0**9) / 2.0**9
    lo = score - hi
    assert np.all(np.abs(hi) * 2.0**9 < 2**15) and np.all(np.abs(lo) * 2.0**22 <= 2**13)
    return np.concatenate([hi, lo], axis=1).astype(np.float32)
