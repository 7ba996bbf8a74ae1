"""NVFP4 -> int4 group 32 on the CPU: decode exactly, then the least-squares bf16 scale per group.

NVFP4 (docs/nvfp4.md) stores E2M1 codes, one FP8 E4M3 scale per 16 inputs and one FP32 scale per
tensor. An int4 group of 32 spans two NVFP4 blocks whose scales differ by any FP8 ratio, so its values
are not one code table times a power of two and the MXFP4 search (a histogram over 16 codes,
``requant.py``) does not apply. Here a group's 32 values are decoded to float64 (exact for the
multiplying convention; correctly rounded once for the dividing one) and the bf16 scale is found by a
sweep over the points where a value's int4 code changes:

* For a fixed code vector q the error ``E(S) = A S^2 - 2 B S + C`` (A = sum q^2, B = sum q v,
  C = sum v^2) is a convex quadratic. q is constant between consecutive breakpoints
  ``S = |v_i| / (k + 1/2)`` (k = 0..6 for v > 0, 0..7 for v < 0: codes stop at 7 and -8); at a
  breakpoint both codes give the same error, so E is continuous.
* On one interval the best bf16 S is one of the two bf16 numbers around the interval's minimiser
  ``B / A`` clipped to the interval (a convex function's best grid point is next to its minimum).
* Only S in [a/16, 2a] (a = the largest |v|) can win (``verify.optimum.brute_force_min`` proves it),
  so the candidates are at most two per interval of that range: a set that contains the optimum over
  every positive bf16 scale.

The candidates are ranked by the closed form in float64 (the first exact minimum in sweep order wins),
then the winner's error is recomputed directly; the sweep is a numba kernel, one group per iteration.
float64 rounding can only confuse candidates whose errors agree to about 1e-13 relative;
``tests/formats/test_nvfp4.py`` compares with the exhaustive search over every bf16 scale. There is no GPU
path (docs/nvfp4.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from .server_rule import server_ops
from .tables import E2M1_VALUES

QMIN, QMAX = -8, 7
GROUP, BLOCK = 32, 16
BF16_MIN_NORMAL = 2.0 ** -126
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_E2M1 = torch.from_numpy(E2M1_VALUES).to(torch.float64)


@dataclass(frozen=True)
class GlobalScale:
    """The per-tensor FP32 scale and how it applies: compressed-tensors divides by
    ``weight_global_scale``; ModelOpt multiplies by ``weight_scale_2``."""

    value: float
    divide: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.value if self.divide else x * self.value


def codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] -> E2M1 codes int64 [R, C], element 2j from the low nibble."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()


def decode(packed: torch.Tensor, block_scales: torch.Tensor, gscale: GlobalScale) -> torch.Tensor:
    """float64 [R, C] NVFP4 values: E2M1(code) * e4m3(scale of its 16) applied to the global scale.

    E2M1 (2 significant bits) times E4M3 (4) times FP32 (24) is exact in float64; the dividing
    convention rounds once. ``block_scales``: float8_e4m3fn [R, C/16].
    """
    v = _E2M1[codes(packed)]
    s = block_scales.to(torch.float64).repeat_interleave(BLOCK, dim=1)
    return gscale.apply(v * s)


@numba.njit(cache=True, nogil=True)
def _bf16_around(x: float) -> tuple[float, float]:
    m, e = math.frexp(x)                        # x = m 2^e, m in [0.5, 1): bf16 keeps 8 significant bits
    return math.ldexp(math.floor(m * 256.0), e - 8), math.ldexp(math.ceil(m * 256.0), e - 8)


@numba.njit(cache=True, nogil=True)
def _group_scale(v: np.ndarray, bp: np.ndarray, da: np.ndarray, db: np.ndarray) -> float:
    """One group's least-squares bf16 scale (0 if all zero): the sweep of the module docstring.
    ``bp``/``da``/``db``: scratch of 256 (breakpoints and what crossing each adds to A and B)."""
    a, c, n = 0.0, 0.0, 0
    for i in range(GROUP):
        a = max(a, abs(v[i]))
        c += v[i] * v[i]
    if a == 0.0:
        return 0.0
    floor = a / 16                                # no scale below it wins (module docstring)
    for i in range(GROUP):
        x = abs(v[i])
        for k in range(8 if v[i] < 0 else 7):     # codes stop at 7 above, -8 below
            b = x / (k + 0.5)
            if b < floor:                         # never crossed in [a/16, 2a]: q stays at k there
                break
            bp[n], da[n], db[n] = b, 2 * k + 1, x
            n += 1
    key = np.empty(n)
    for i in range(n):                            # descending by breakpoint, ties by index: a fixed order
        key[i] = -bp[i]
    order = np.argsort(key, kind="mergesort")
    A, B, best, best_err = 0.0, 0.0, 0.0, np.inf
    for j in range(n):
        o = order[j]
        A += da[o]
        B += db[o]
        hi = bp[o]
        lo = max(bp[order[j + 1]] if j + 1 < n else 0.0, floor)
        if hi < lo:
            continue
        mid = min(max(B / A, lo), hi)
        if A * mid * mid - 2.0 * B * mid + c > best_err:   # the interval's continuous minimum already loses
            continue
        down, up = _bf16_around(mid)
        for s in (down, up):                      # the first exact minimum in this order wins
            if lo <= s <= hi:
                err = A * s * s - 2.0 * B * s + c
                if err < best_err:
                    best, best_err = s, err
    return best


@numba.njit(parallel=True, cache=True, nogil=True)
def _sweep_groups(v: np.ndarray) -> np.ndarray:
    out = np.empty(v.shape[0])
    step = 256
    for c in numba.prange((v.shape[0] + step - 1) // step):
        bp, da, db = np.empty(256), np.empty(256), np.empty(256)
        for g in range(c * step, min(v.shape[0], (c + 1) * step)):
            out[g] = _group_scale(v[g], bp, da, db)
    return out


def _sweep(v: torch.Tensor) -> torch.Tensor:
    """The least-squares bf16 scale of each group [G, 32] float64 (0 for an all-zero group)."""
    return torch.from_numpy(_sweep_groups(np.ascontiguousarray(v.numpy())))


def quantize(v: torch.Tensor, scale: torch.Tensor, qmin: int = QMIN) -> torch.Tensor:
    """int8 codes clamp(round(v / S), qmin, 7) per group [G, 32] (0 where S = 0)."""
    safe = torch.where(scale > 0, scale, torch.ones(()))
    q = torch.clamp(torch.round(v / safe.unsqueeze(1)), qmin, QMAX)
    return torch.where((scale > 0).unsqueeze(1), q, torch.zeros(())).to(torch.int8)


@dataclass
class GroupResult:
    """Per 32-group: int4 codes, bf16 scale, squared error against the NVFP4 values, and whether the
    scale left bf16's normal range (such a tensor must not be written)."""

    q: torch.Tensor          # int8 [G, 32]
    scale: torch.Tensor      # bfloat16 [G]
    err2: torch.Tensor       # float64 [G]
    out_of_range: torch.Tensor  # bool [G]


def optimal(values: torch.Tensor) -> GroupResult:
    """The least-squares int4 (codes -8..7) with one bf16 scale per group of 32 (``values`` float64 [G, 32])."""
    scales = _sweep(values.contiguous()) if values.shape[0] else torch.zeros(0, dtype=torch.float64)
    bad = (scales != 0) & ((scales < BF16_MIN_NORMAL) | (scales > BF16_MAX))
    q = quantize(values, scales)
    err2 = ((q.double() * scales.unsqueeze(1) - values) ** 2).sum(1)
    return GroupResult(q, scales.to(torch.bfloat16), err2, bad)   # the scales are bf16 numbers: exact


def server_rule(values: torch.Tensor) -> GroupResult:
    """What a server's load-time rule makes of the same weights: the values rounded to bf16 (what
    a dequantizing loader holds), then aiter's ``per_1x32_i4_quant`` (RTN, amax / 7, codes -7..7;
    ``server_rule.server_ops``). Error against the NVFP4 values themselves."""
    w = values.to(torch.bfloat16)
    q, scale = server_ops(w)
    err2 = ((q.double() * scale.double().unsqueeze(1) - values) ** 2).sum(1)
    return GroupResult(q, scale, err2, ~torch.isfinite(w).all(1))


def brute_force(values: torch.Tensor, qmin: int = QMIN) -> tuple[torch.Tensor, torch.Tensor]:
    """(least error, a best scale) per group over every positive normal bf16 scale: the exhaustive
    search the sweep must agree with (tests only: 32,512 candidates a group)."""
    bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32).to(torch.int16)
    scales = bits.view(torch.bfloat16).double()
    errs, best = [], []
    for v in values:
        q = torch.clamp(torch.round(v[None, :] / scales[:, None]), qmin, QMAX)
        e = ((q * scales[:, None] - v[None, :]) ** 2).sum(1)
        i = int(e.argmin())
        errs.append(e[i])
        best.append(scales[i])
    return torch.stack(errs), torch.stack(best)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [R, C] codes in [-8, 7] -> compressed-tensors ``pack-quantized`` int32 [R, C/8]
    (q + 8 at nibble k of little-endian word k // 8; docs/spec.md §3)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(q.shape[0], -1, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous().view(torch.int32)


@dataclass
class ModuleResult:
    """One NVFP4 linear requantized: the output tensors and the error figures of both rules."""

    words: torch.Tensor      # int32 [R, C/8]
    scales: torch.Tensor     # bfloat16 [R, C/32]
    err2: float              # ours, against the NVFP4 values
    ref2: float              # sum of the NVFP4 values squared
    server_err2: float       # the server's load-time rule (bf16 then RTN amax/7)
    max_abs: float
    out_of_range: int


def requantize_module(packed: torch.Tensor, block_scales: torch.Tensor, gscale: GlobalScale) -> ModuleResult:
    """An NVFP4 linear (uint8 [R, C/2], float8_e4m3fn [R, C/16], its global scale) as int4 group 32."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    v = decode(packed, block_scales, gscale)
    groups = v.reshape(-1, GROUP)
    ours, theirs = optimal(groups), server_rule(groups)
    diff = ours.q.double() * ours.scale.double().unsqueeze(1) - groups
    return ModuleResult(pack_int4(ours.q.reshape(rows, cols)), ours.scale.reshape(rows, cols // GROUP),
                        float(ours.err2.sum()), float((groups * groups).sum()), float(theirs.err2.sum()),
                        float(diff.abs().max()) if diff.numel() else 0.0, int(ours.out_of_range.sum()))
