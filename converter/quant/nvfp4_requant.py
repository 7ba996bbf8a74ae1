"""NVFP4 -> int4 group 32: decode exactly, then the least-squares bf16 scale per group.

NVFP4 (docs/nvfp4.md) stores E2M1 codes, one FP8 E4M3 scale per 16 inputs and one FP32 scale per
tensor. An int4 group of 32 spans two NVFP4 blocks whose scales differ by any FP8 ratio, so its values
are not one code table times a power of two and the MXFP4 search (a histogram over 16 codes,
``requant.py``) does not apply. Here the bf16 scale is found by a sweep over the points where a value's
int4 code changes (docs/nvfp4.md §3 has the proof):

* For a fixed code vector q the error ``E(S) = A S^2 - 2 B S + C`` is a convex quadratic; q is constant
  between breakpoints ``S = |v_i| / (k + 1/2)``, so per interval only the bf16 numbers around the clipped
  minimiser ``B / A`` can win, and only S >= a/16 at all.
* A group has at most 112 breakpoint slots (2 blocks x 7 E2M1 magnitudes x 8 crossings); A and
  sum q w (w without the global scale) are exact integer-valued sums, so their order cannot matter;
  breakpoints are keyed by their float32 bits (exact order) and the candidates ranked in float64,
  ties to the smaller scale.

``search`` runs it as a numba kernel on every core; the Triton kernel ``kernels/triton_nvfp4.py`` does
the same float64 operations on a GPU, the same bytes (``converter.kernels`` picks one by device, as for
MXFP4: kernels import this module, never the reverse);
``tests/formats/test_nvfp4.py`` and ``tests/quant/kernels/test_nvfp4_gpu.py`` compare with the exhaustive
search over every bf16 scale.
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
    v = _E2M1.to(packed.device)[codes(packed)]
    s = block_scales.to(torch.float64).repeat_interleave(BLOCK, dim=1)
    return gscale.apply(v * s)


# The search's slots: one per (block b of the group's two, E2M1 level l = 1..7, crossing k = 0..7), the
# breakpoint S = L_l e_b / (k + 1/2) where a value of magnitude L_l e_b changes code (docs/nvfp4.md §3).
NSLOT = 2 * 7 * 8 + 1
FLOOR = 127                                           # the slot of the lower bound a / 16
_L2 = np.array([0, 1, 2, 3, 4, 6, 8, 12], np.int64)   # 2 x the E2M1 magnitudes of levels 0..7


@numba.njit(cache=True, nogil=True)
def _bf16_around(x: float) -> tuple[float, float]:
    m, e = math.frexp(x)                        # x = m 2^e, m in [0.5, 1): bf16 keeps 8 significant bits
    return math.ldexp(math.floor(m * 256.0), e - 8), math.ldexp(math.ceil(m * 256.0), e - 8)


@numba.njit(cache=True, nogil=True)
def _group_scale(byts: np.ndarray, e0: float, e1: float, g: float, divide: bool,
                 keys: np.ndarray, f32: np.ndarray, cnt: np.ndarray) -> float:
    """One group's least-squares bf16 scale (0 if all zero); docs/nvfp4.md §3 "The search" is the spec
    and ``kernels/triton_nvfp4.py`` the same steps on a GPU (same keys, same float64 operations).
    ``byts``: the group's 16 packed bytes; ``keys`` int64 [NSLOT], ``f32`` float32 [NSLOT], ``cnt`` int64 [32]:
    scratch."""
    cnt[:] = 0                                      # code counts, block b's at 16 b + code
    for i in range(16):
        cnt[16 * (i // 8) + (byts[i] & 15)] += 1
        cnt[16 * (i // 8) + (byts[i] >> 4)] += 1
    aw = 0.0                                        # the largest |w| (w = E2M1 x block scale, no global)
    for b in range(2):
        e = e0 if b == 0 else e1
        for lv in range(1, 8):
            if cnt[16 * b + lv] + cnt[16 * b + lv + 8] > 0:
                aw = max(aw, (_L2[lv] * e) * 0.5)
    if aw == 0.0:
        return 0.0
    floor = aw / 16                                 # no scale below it wins: breakpoints below are dropped
    f32[0] = floor                                  # and the floor is a breakpoint of no value (slot FLOOR)
    keys[0] = FLOOR << 5
    n = 1
    for b in range(2):
        e = e0 if b == 0 else e1
        for lv in range(1, 8):
            npos, nneg = cnt[16 * b + lv], cnt[16 * b + lv + 8]
            for k in range(8):
                c = (npos if k <= 6 else 0) + nneg          # codes stop at 7 above, -8 below
                bw = (_L2[lv] * e) * 0.5 / (k + 0.5)
                if c == 0 or bw < floor:
                    continue
                f32[n] = bw                         # exact order: distinct breakpoints differ by > 2^-12
                keys[n] = ((b * 56 + (lv - 1) * 8 + k) << 5) | c
                n += 1
    bits = f32.view(np.int32)
    for i in range(n):                              # the sort key: the breakpoint's float32 bits, then the slot
        key = (np.int64(bits[i]) << 12) | keys[i]
        p = i                                       # insertion sort, descending (n <= 112)
        while p > 0 and keys[p - 1] < key:
            keys[p] = keys[p - 1]
            p -= 1
        keys[p] = key
    best, best_k = 0.0, np.inf
    a, n0, n1 = 0, 0, 0
    for p in range(n):                              # breakpoints descending: codes grow as S falls
        key = keys[p]
        j, c = (key >> 5) & 127, key & 31
        b, lv, k = j // 56, (j % 56) // 8 + 1, j % 8
        e = e0 if b == 0 else e1
        a_ex, n0_ex, n1_ex = a, n0, n1
        a += (2 * k + 1) * c                        # sum q^2 grows by (k+1)^2 - k^2 a crossing value
        if b == 0:
            n0 += _L2[lv] * c                       # sum q w grows by |w| (in halves of L e_b)
        else:
            n1 += _L2[lv] * c
        bw = floor if j == FLOOR else (_L2[lv] * e) * 0.5 / (k + 0.5)
        hi = bw / g if divide else bw * g
        for side in range(2):                       # 0: the interval below the breakpoint, 1: above it
            aa = a if side == 0 else a_ex
            if aa == 0:
                continue
            bsum = (n0 * e0 + n1 * e1) * 0.5 if side == 0 else (n0_ex * e0 + n1_ex * e1) * 0.5   # exact
            bb = bsum / g if divide else bsum * g
            m = bb / aa
            c2 = min(m, hi) if side == 0 else max(m, hi)
            down, up = _bf16_around(c2)
            for s in (down, up):
                if (s <= hi) if side == 0 else (s >= hi):
                    kk = (aa * s) * s - (2.0 * bb) * s   # the error less sum v^2
                    if kk < best_k or (kk == best_k and s < best):   # ties: the smaller scale
                        best, best_k = s, kk
    return best


@numba.njit(parallel=True, cache=True, nogil=True)
def _search_groups(byts: np.ndarray, e: np.ndarray, g: float, divide: bool) -> np.ndarray:
    out = np.empty(byts.shape[0])
    step = 1024
    for ch in numba.prange((byts.shape[0] + step - 1) // step):
        keys, f32, cnt = np.empty(NSLOT, np.int64), np.empty(NSLOT, np.float32), np.empty(32, np.int64)
        for i in range(ch * step, min(byts.shape[0], (ch + 1) * step)):
            out[i] = _group_scale(byts[i], e[i, 0], e[i, 1], g, divide, keys, f32, cnt)
    return out


def search(packed: torch.Tensor, block_scales: torch.Tensor, gscale: GlobalScale) -> torch.Tensor:
    """The least-squares bf16 scale (float64; 0 for an all-zero group) of every int4 group of an NVFP4
    tensor: packed uint8 [R, C/2], block scales float8_e4m3fn [R, C/16], on the CPU (the numba kernel,
    every core). ``converter.kernels.nvfp4_searcher`` picks this or the Triton kernel by device: the same
    bytes either way."""
    groups = packed.reshape(-1, 16)
    e = block_scales.reshape(-1, 2).to(torch.float64)
    return torch.from_numpy(_search_groups(groups.contiguous().numpy(), e.contiguous().numpy(),
                                           gscale.value, gscale.divide))


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


def out_of_range(s: torch.Tensor) -> torch.Tensor:
    """Groups whose nonzero scale is not a normal bf16 number (subnormal or past bf16's largest)."""
    return (s != 0) & ((s < BF16_MIN_NORMAL) | (s > BF16_MAX))


def optimal(values: torch.Tensor, scales: torch.Tensor) -> GroupResult:
    """The least-squares int4 (codes -8..7) of groups ``values`` float64 [G, 32] given their scales
    (``search``'s, float64 [G])."""
    bad = out_of_range(scales)
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


def requantize_module(packed: torch.Tensor, block_scales: torch.Tensor, gscale: GlobalScale,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None) -> ModuleResult:
    """An NVFP4 linear (uint8 [R, C/2], float8_e4m3fn [R, C/16], its global scale) as int4 group 32, on
    the CPU (``converter.kernels.nvfp4_requantizer`` gives the GPU's, the same bytes). ``out``: buffers
    for the words and the scales (any 4- and 2-byte dtype), else new tensors."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    groups = decode(packed, block_scales, gscale).reshape(-1, GROUP)
    theirs = server_rule(groups)
    ours = optimal(groups, search(packed, block_scales, gscale))
    diff = ours.q.double() * ours.scale.double().unsqueeze(1) - groups
    words, scales = pack_int4(ours.q.reshape(rows, cols)), ours.scale.reshape(rows, cols // GROUP)
    if out is not None:
        words = out[0].view(torch.int32).reshape(rows, cols // 8).copy_(words)
        scales = out[1].view(torch.bfloat16).reshape(rows, cols // GROUP).copy_(scales)
    return ModuleResult(words, scales, float(ours.err2.sum()), float((groups * groups).sum()), float(theirs.err2.sum()),
                        float(diff.abs().max()) if diff.numel() else 0.0, int(ours.out_of_range.sum()))
