"""``optimal-pm7`` applied to int4 groups already stored: re-optimize groups that use code -8 over [-7, 7].

Why: a kernel that misreads code -8 (the vLLM plugin's self-test finds it on the user's GPU) can still
serve a checkpoint converted with ``optimal`` if every group holding -8 is replaced by the exact
least-squares optimum over codes [-7, 7] (the ``optimal-pm7`` rule, rules.OPTIMA) of the values the
checkpoint stores, ``q * s``. The rule's MXFP4 tables (tables.py) are built for E2M1 inputs; here the
inputs are int4 codes, so the same optimum (every positive normal bf16 scale, nearest code, ties to
the larger scale) is searched over the int4 alphabet with tables of the same kind: a group's error
depends only on its code histogram, its scale's bf16 mantissa and the candidate scale. Exact: every
quantity is a small integer times a power of two in float64. ``verify.brute_force_min`` (an
independent search) checks it in tests/quant/test_int4_pm7.py.

Candidates: a group holding -8 has largest |value| a = 8|s|; verify.brute_force_min shows that only
scales in [a/16, 2a] = [|s|/2, 16|s|] can win. Narrower, still exact: above a every code is -1, 0 or
1 and lowering the scale to a (a bf16 value) brings each nonzero code's value closer, so no S > a
wins; and every S in [|s|/2, |s|) has, code by code, at least the error of S = |s| (checked on the
whole table when it is built: `_tables`), so with ties to the larger scale it never wins. That leaves
the 385 bf16 bit patterns from bits(|s|) to bits(|s|) + 384 = bits(a).

Cost: groups are sorted by scale mantissa (128 classes) and padded to tiles of one class, so on a GPU
one float64 batched matmul [tiles, TILE, 17] x [tiles, 17, 385] scores a whole step of groups with no
Python loop over classes (on the CPU one matmul per class present in the step, faster there). The
per-group result does not depend on step or tile sizes (every sum is exact; tests check it). Steps by
device (``step_groups``): on the CPU 8,192 groups (the [groups, 385] errors stay in cache); on a GPU
(CUDA or ROCm) up to 2^18 groups, bounded by GPU_STEP_BYTES of transient memory. Host syncs: a few
per call, none per step (the CPU has none to make). Speeds: BENCHMARKS.md, scripts/benchmarks/bench_repair.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .rules import OPTIMA, ScaleRule

QMIN = OPTIMA[ScaleRule.OPTIMAL_PM7]   # -7
QMAX = 7
CODES = torch.arange(-8, 9)    # |s| folds a negative scale's sign into the codes: -q may be +8
LO, HI = 0, 384                # candidate bit offsets from bits(|s|) (see the module docstring)
BELOW = 128                    # offsets [-BELOW, 0): shown dominated by offset 0 when the table is built
BF16_MIN_NORMAL, BF16_MAX_FINITE = 0x0080, 0x7F7F
CHUNK_GROUPS = 1 << 13         # groups per step on the CPU: its [groups, 385] errors (25 MB) stay in cache
GPU_STEP_GROUPS = 1 << 18      # groups per step on a GPU, at most ...
GPU_STEP_BYTES = 1 << 30       # ... this transient memory per step
STEP_BYTES_PER_GROUP = 4096    # err [385] f64 (3080) + hist, codes, indices, the tile's table share
TILE_CPU, TILE_GPU = 16, 256   # groups per tile (one scale class): padding waste <= 128 * TILE per call


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


def step_groups(device: torch.device) -> tuple[int, int]:
    """(groups per step, groups per tile) for ``device``: small on the CPU, large but bounded on a GPU."""
    if device.type == "cpu":
        return CHUNK_GROUPS, TILE_CPU
    step = min(GPU_STEP_GROUPS, GPU_STEP_BYTES // STEP_BYTES_PER_GROUP)
    return max(TILE_GPU, step // TILE_GPU * TILE_GPU), TILE_GPU


def repair_groups_(codes: torch.Tensor, scales: torch.Tensor) -> Repair:
    """In place: every group [32] of ``codes`` (int8 [G, 32], in [-8, 7]) that holds -8 gets the
    ``optimal-pm7`` codes and bf16 scale (``scales`` bf16 [G]) of its stored values q * s.

    Groups without -8 are left as stored (a kernel that misreads only -8 reads them right). A group
    whose scale is 0, subnormal or not finite has its -8 codes set to 0 (its values are 0, or the
    layer is not servable anyway). ``err2``/``ref2`` cover the re-optimized groups only.
    """
    if codes.numel() == 0:
        return Repair(0, 0, 0.0, 0.0)
    dev = codes.device
    rows = (codes == -8).any(dim=1).nonzero().squeeze(1)         # sync: the count
    n = int(rows.numel())
    if n == 0:
        return Repair(codes.shape[0], 0, 0.0, 0.0)
    step, tile = step_groups(dev)
    q, score_t = _tables(str(dev))
    bits = scales.index_select(0, rows).view(torch.int16).long() & 0x7FFF    # bits of |s|
    mb, order = torch.sort(bits & 127, stable=True)              # one scale mantissa class after another
    rows, bits = rows[order], bits[order]
    counts = torch.bincount(mb, minlength=128)
    tiles = (counts + tile - 1) // tile
    ntiles, top = torch.stack((tiles.sum(), bits.max())).tolist()   # sync: sizes and the largest scale
    mask = top + HI > BF16_MAX_FINITE                            # some candidates past bf16's largest finite
    tile_start = torch.cumsum(tiles, 0) - tiles
    cls_start = torch.cumsum(counts, 0) - counts
    tile_cls = torch.repeat_interleave(torch.arange(128, device=dev), tiles, output_size=ntiles)
    # slot p of the padded order takes sorted row src[p]; a padding slot repeats its tile's first row
    # (same class, same tile, so same step: it is read before any write and writes the same bytes)
    first = cls_start[tile_cls] + (torch.arange(ntiles, device=dev) - tile_start[tile_cls]) * tile
    src = first.repeat_interleave(tile)
    pos = tile_start[mb] * tile + torch.arange(n, device=dev) - cls_start[mb]
    src[pos] = torch.arange(n, device=dev)
    real = torch.zeros(ntiles * tile, dtype=torch.bool, device=dev)
    real[pos] = True
    del mb, order, counts, tiles, tile_start, cls_start, first, pos
    err2 = torch.zeros((), dtype=torch.float64, device=dev)
    ref2 = torch.zeros((), dtype=torch.float64, device=dev)
    for lo in range(0, ntiles * tile, step):                     # bounds the [groups, 385] error matrix
        hi = min(lo + step, ntiles * tile)
        e, r = _repair_step_(codes, scales, rows, bits, src[lo:hi], real[lo:hi],
                             tile_cls[lo // tile:hi // tile], q, score_t, mask)
        err2 += e
        ref2 += r
    err2, ref2 = torch.stack((err2, ref2)).tolist()              # sync: the figures
    return Repair(codes.shape[0], n, err2, ref2)


def batched(device: torch.device) -> bool:
    """Whether the scores of a step are one batched matmul (GPU) or one matmul per class run (CPU)."""
    return device.type != "cpu"


def _errors(hist: torch.Tensor, tile_cls: torch.Tensor, score_t: torch.Tensor) -> torch.Tensor:
    """hist [groups, 17] (tiles of one scale class ``tile_cls`` each) times its class's scores: [groups, 385].

    On a GPU one batched matmul (no loop over classes); on the CPU, where a batch of small matmuls is
    about 2x slower than one per class, one matmul per run of tiles of the same class (tile_cls is on
    the host there, no sync). Exact either way, so the same result."""
    nt = tile_cls.numel()
    if batched(hist.device):
        err = torch.bmm(hist.view(nt, -1, hist.shape[1]), score_t.index_select(0, tile_cls))
        return err.view(hist.shape[0], -1)
    tile = hist.shape[0] // nt
    err = torch.empty(hist.shape[0], score_t.shape[2], dtype=torch.float64)
    cls = tile_cls.tolist()
    lo = 0
    for j in range(1, nt + 1):
        if j == nt or cls[j] != cls[lo]:
            torch.mm(hist[lo * tile:j * tile], score_t[cls[lo]], out=err[lo * tile:j * tile])
            lo = j
    return err


def _repair_step_(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor,
                  src: torch.Tensor, real: torch.Tensor, tile_cls: torch.Tensor, q: torch.Tensor,
                  score_t: torch.Tensor, mask: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Repair the groups ``rows[src]`` (tiles of one scale class each, ``tile_cls``) in place; returns
    (err2, ref2) over the real slots as device scalars."""
    r = rows.index_select(0, src)
    b = bits.index_select(0, src)
    c = codes.index_select(0, r)
    s = scales.index_select(0, r)
    sf = s.float()
    bad = ~torch.isfinite(sf) | (b < BF16_MIN_NORMAL)            # 0, subnormal
    neg = sf < 0
    sign = torch.where(neg, -1, 1).to(torch.int8)
    k = (c * sign[:, None]).long() + 8                           # index into CODES (-8..8)
    hist = torch.zeros(c.shape[0], CODES.numel(), dtype=torch.float64, device=c.device)
    hist.scatter_add_(1, k, torch.ones_like(k, dtype=torch.float64))
    err = _errors(hist, tile_cls, score_t)                       # [groups, 385], largest scale first
    del hist
    if mask:
        past = torch.arange(HI, LO - 1, -1, device=c.device)[None, :] > (BF16_MAX_FINITE - b)[:, None]
        err.masked_fill_(past, torch.inf)
        del past
    i = err.argmin(dim=1)                                        # ties: the larger scale (first)
    best = err.gather(1, i[:, None]).squeeze(1)
    del err
    m = b & 127
    new_codes = q.view(-1)[((m * q.shape[1] + i) * CODES.numel())[:, None] + k] * sign[:, None]
    new_s = (b + HI - i).to(torch.int16).view(torch.bfloat16)
    new_s = torch.where(neg, -new_s, new_s)
    unit = torch.ldexp(torch.ones_like(sf, dtype=torch.float64), ((b >> 7) - 127).to(torch.int32))
    best = best * unit * unit
    stored = (c.double() * sf.double()[:, None]).pow(2).sum(1)
    zeroed = torch.where(c == -8, torch.zeros_like(c), c)
    codes.index_copy_(0, r, torch.where(bad[:, None], zeroed, new_codes))
    scales.index_copy_(0, r, torch.where(bad, s, new_s))
    good = real & ~bad
    return torch.where(good, best, 0.0).sum(), torch.where(good, stored, 0.0).sum()


def stored_ref2(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """sum (q * s)^2 over groups [G, 32] int8 codes and [G] scales: the denominator of a layer's figure,
    a float64 scalar on the codes' device (no host sync; int16 squares, exact)."""
    sq = codes.to(torch.int16)
    sq.mul_(sq)                                                   # <= 64 * 32 per group
    return (sq.sum(1, dtype=torch.int32).double() * scales.double().pow(2)).sum()
