"""``optimal-pm7`` applied to int4 groups already stored: re-optimize groups that use code -8 over [-7, 7].

Why: a kernel that misreads code -8 (the vLLM plugin's self-test finds it on the user's GPU) can still
serve a checkpoint converted with ``optimal`` if every group holding -8 is replaced by the exact
least-squares optimum over codes [-7, 7] (the ``optimal-pm7`` rule, rules.OPTIMA) of the values the
checkpoint stores, ``q * s``. The rule's MXFP4 tables (tables.py) are built for E2M1 inputs; here the
inputs are int4 codes, so the same optimum (every positive normal bf16 scale, nearest code, ties to
the larger scale) is searched over the int4 alphabet with tables of the same kind: a group's error
depends only on its code histogram, its scale's bf16 mantissa and the candidate scale. Exact: every
quantity is a small integer times a power of two in float64. ``verify.brute_force_min`` (an
independent search) checks it in tests/test_int4_pm7.py.

Candidates: a group holding -8 has largest |value| a = 8|s|; verify.brute_force_min shows that only
scales in [a/16, 2a] = [|s|/2, 16|s|] can win. Narrower, still exact: above a every code is -1, 0 or
1 and lowering the scale to a (a bf16 value) brings each nonzero code's value closer, so no S > a
wins; and every S in [|s|/2, |s|) has, code by code, at least the error of S = |s| (checked on the
whole table when it is built: `_tables`), so with ties to the larger scale it never wins. That leaves
the 385 bf16 bit patterns from bits(|s|) to bits(|s|) + 384 = bits(a).

Cost: groups are taken by scale mantissa (128 classes), one float64 matmul [groups, 17] x [17, 385]
per class and chunk; on the CPU of the bench machine about 10^4-10^5 groups/s (BENCHMARKS.md).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .rules import OPTIMA

QMIN = OPTIMA["optimal-pm7"]   # -7
QMAX = 7
CODES = torch.arange(-8, 9)    # |s| folds a negative scale's sign into the codes: -q may be +8
LO, HI = 0, 384                # candidate bit offsets from bits(|s|) (see the module docstring)
BELOW = 128                    # offsets [-BELOW, 0): shown dominated by offset 0 when the table is built
BF16_MIN_NORMAL, BF16_MAX_FINITE = 0x0080, 0x7F7F
CHUNK_GROUPS = 1 << 15


def _score(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scale mantissa (128), candidate offset lo..hi and code (-8..8): the new code, and the squared
    error in units of 2**(2e) (e: the old scale's exponent), exact in float64."""
    mb = torch.arange(128, dtype=torch.int64)[:, None]
    j = torch.arange(lo, hi + 1, dtype=torch.int64)[None, :]
    rel = mb + j                                                 # candidate bits - exponent bits of s
    big = torch.ldexp(1.0 + (rel % 128).double() / 128, (rel // 128).to(torch.int32))   # S / 2**e
    small = 1.0 + mb.double() / 128                              # |s| / 2**e
    v = CODES.double()[None, None, :] * small[:, :, None]        # the stored value / 2**e
    # nearest code in [QMIN, QMAX], ties towards zero (tables.best_q's rule): try every level
    levels = torch.arange(QMIN, QMAX + 1).double()
    levels = levels[torch.argsort(levels.abs(), stable=True)]
    err = (levels[None, None, None, :] * big[:, :, None, None] - v[..., None]) ** 2
    best = err.argmin(dim=-1)
    return levels[best].to(torch.int8), err.gather(-1, best[..., None]).squeeze(-1)


@functools.lru_cache(maxsize=None)
def _tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The new codes [128, 385, 17] and the scores transposed for the matmul [128, 17, 385], both with
    the candidates largest first (index i is offset HI - i)."""
    _, below = _score(-BELOW, 0)
    if not (below[:, :-1] >= below[:, -1:]).all():     # every S < |s| is at least S = |s| code by code
        raise AssertionError("int4_pm7: a scale below the stored one can win; widen the window")
    q, score = _score(LO, HI)
    # candidates largest first: argmin keeps the first minimum, i.e. ties go to the larger scale
    return q.flip(1).contiguous().to(device), score.flip(1).transpose(1, 2).contiguous().to(device)


@dataclass
class Repair:
    """What re-optimizing cost, in absolute float64 units over the groups given."""

    groups: int          # groups given
    repaired: int        # groups that held -8 and were re-optimized
    err2: float          # sum (new value - stored value)^2
    ref2: float          # sum stored value^2

    @property
    def rel_rmse(self) -> float:
        return (self.err2 / self.ref2) ** 0.5 if self.ref2 > 0 else 0.0

    def __add__(self, other: "Repair") -> "Repair":
        return Repair(self.groups + other.groups, self.repaired + other.repaired,
                      self.err2 + other.err2, self.ref2 + other.ref2)


def repair_groups_(codes: torch.Tensor, scales: torch.Tensor) -> Repair:
    """In place: every group [32] of ``codes`` (int8 [G, 32], in [-8, 7]) that holds -8 gets the
    ``optimal-pm7`` codes and bf16 scale (``scales`` bf16 [G]) of its stored values q * s.

    Groups without -8 are left as stored (a kernel that misreads only -8 reads them right). A group
    whose scale is 0, subnormal or not finite has its -8 codes set to 0 (its values are 0, or the
    layer is not servable anyway). ``err2``/``ref2`` cover the re-optimized groups only.
    """
    if codes.numel() == 0:
        return Repair(0, 0, 0.0, 0.0)
    rows = (codes == -8).any(dim=1).nonzero().squeeze(1)
    out = Repair(codes.shape[0], int(rows.numel()), 0.0, 0.0)
    mb = scales.index_select(0, rows).abs().view(torch.int16).long() & 127
    order = torch.argsort(mb, stable=True)                       # one scale mantissa at a time
    rows, mb = rows[order], mb[order]
    bounds = torch.searchsorted(mb, torch.arange(129, device=mb.device)).tolist()
    for m in range(128):
        for lo in range(bounds[m], bounds[m + 1], CHUNK_GROUPS):  # bounds the [groups, 385] error matrix
            err2, ref2 = _repair_rows_(codes, scales, rows[lo:min(lo + CHUNK_GROUPS, bounds[m + 1])], m)
            out.err2 += err2
            out.ref2 += ref2
    return out


def _repair_rows_(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, m: int) -> tuple[float, float]:
    """Repair ``rows`` (groups holding -8 whose scales all have mantissa bits ``m``) in place."""
    q, score_t = _tables(str(codes.device))
    c = codes.index_select(0, rows)
    s = scales.index_select(0, rows)
    sf = s.float()
    bad = ~torch.isfinite(sf) | (s.abs().view(torch.int16) < BF16_MIN_NORMAL)   # 0, subnormal
    sign = torch.where(sf < 0, -1, 1).to(torch.int8)
    k = (c * sign[:, None]).long() + 8                           # index into CODES (-8..8)
    bits = s.abs().view(torch.int16).long()
    ebits = bits >> 7                                            # exponent field
    hist = torch.zeros(c.shape[0], CODES.numel(), dtype=torch.float64, device=c.device)
    hist.scatter_add_(1, k, torch.ones_like(k, dtype=torch.float64))
    err = hist @ score_t[m]                                      # [groups, 385], largest scale first
    if int(bits.max()) + HI > BF16_MAX_FINITE:                   # candidates past bf16's largest finite
        cand = bits[:, None] + torch.arange(HI, LO - 1, -1, device=c.device)[None, :]
        err = torch.where(cand <= BF16_MAX_FINITE, err, torch.inf)
    i = err.argmin(dim=1)                                        # ties: the larger scale (first)
    new_codes = q[m][i[:, None], k] * sign[:, None]
    new_bits = (bits + HI - i).to(torch.int16)
    new_s = new_bits.view(torch.bfloat16) * torch.where(sf < 0, -1.0, 1.0).to(torch.bfloat16)
    unit = torch.ldexp(torch.ones_like(sf, dtype=torch.float64), (ebits - 127).to(torch.int32))
    best = err.gather(1, i[:, None]).squeeze(1) * unit * unit
    stored = (c.double() * sf.double()[:, None]).pow(2).sum(1)
    zeroed = torch.where(c == -8, torch.zeros_like(c), c)
    codes[rows] = torch.where(bad[:, None], zeroed, new_codes)
    scales[rows] = torch.where(bad, s, new_s)
    good = ~bad
    return float(best[good].sum()), float(stored[good].sum())


def stored_ref2(codes: torch.Tensor, scales: torch.Tensor) -> float:
    """sum (q * s)^2 over groups [G, 32] int8 codes and [G] scales: the denominator of a layer's figure."""
    return float((codes.double().pow(2).sum(1) * scales.double().pow(2)).sum())
