"""The NVFP4 -> int4 scale search on a GPU: ``quant/nvfp4_requant._group_scale``'s steps, one group a
row of a [BG, 128] tile (plain Triton; HIP-portable).

Per group: the 112 breakpoint slots (block, E2M1 level, crossing) and the floor slot are keyed by the
breakpoint's float32 bits and the slot, sorted descending (``tl.sort``), and the integer sums of the
codes (sum q^2, and sum q w in halves of each block's scale) are prefix sums (``tl.cumsum``): exact
integers, so the order of the additions cannot matter. Each breakpoint then proposes the bf16 numbers
around the clipped minimiser of the interval below it and of the one above it, ranked by the same
float64 operations as the CPU kernel (compiled without FMA contraction, ``enable_fp_fusion=False``):
the least, ties to the smaller scale. So the scales are the CPU's, bit for bit (tests/quant/kernels/test_nvfp4_gpu.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import server_rule

BG = 8           # groups per program (H100: 8 x 4 warps 1.7x faster than 16 x 4; BENCHMARKS.md)
NUM_WARPS = 4
SLOTS = 128      # 112 breakpoint slots, the floor slot (127), padding
FLOOR = tl.constexpr(127)   # the floor slot (nvfp4_requant.FLOOR)
AMAX_FLOOR = tl.constexpr(float(torch.tensor(1e-6).bfloat16()))   # server_rule.AMAX_FLOOR as bf16
RECIP7 = tl.constexpr(float(server_rule.RECIP7))                    # float32(1 / 7), exact in a float


@triton.jit
def _bf16_pair(x):
    """The bf16 numbers just below and above positive float64 ``x`` (equal when x is one)."""
    bits = x.to(tl.int64, bitcast=True)
    low = bits & ((1 << 45) - 1)                 # float64 keeps 52 fraction bits, bf16 7
    down = bits - low
    up = down + tl.where(low != 0, 1 << 45, 0)
    return down.to(tl.float64, bitcast=True), up.to(tl.float64, bitcast=True)


@triton.jit
def _pick(best_k, best_s, aa, bb, s, ok):
    """Fold candidate scales ``s`` (where ``ok``) of quadratics (aa, bb) into the running best."""
    kk = tl.where(ok, (aa * s) * s - (2.0 * bb) * s, float("inf"))
    better = (kk < best_k) | ((kk == best_k) & (s < best_s))
    return tl.where(better, kk, best_k), tl.where(better, s, best_s)


@triton.jit
def _side(best_k, best_s, a, n0, n1, e0, e1, g, hi, below: tl.constexpr, DIVIDE: tl.constexpr):
    """The candidates of the interval below (``below``) or above a breakpoint ``hi`` whose codes give
    sum q^2 = ``a`` and sum q w = (n0 e0 + n1 e1) / 2."""
    bsum = (n0.to(tl.float64) * e0 + n1.to(tl.float64) * e1) * 0.5      # exact
    if DIVIDE:
        bb = bsum / g
    else:
        bb = bsum * g
    af = a.to(tl.float64)
    m = bb / tl.where(a > 0, af, 1.0)
    if below:
        c = tl.minimum(m, hi)
    else:
        c = tl.maximum(m, hi)
    down, up = _bf16_pair(c)
    live = (a > 0) & (hi > 0)
    if below:
        best_k, best_s = _pick(best_k, best_s, af, bb, down, live & (down <= hi))
        best_k, best_s = _pick(best_k, best_s, af, bb, up, live & (up <= hi))
    else:
        best_k, best_s = _pick(best_k, best_s, af, bb, down, live & (down >= hi))
        best_k, best_s = _pick(best_k, best_s, af, bb, up, live & (up >= hi))
    return best_k, best_s


@triton.jit
def _l2(code):
    """2 x the E2M1 magnitude of level ``code & 7``."""
    lv = code & 7
    return tl.where(lv <= 4, lv, tl.where(lv == 5, 6, tl.where(lv == 6, 8, 12)))


@triton.jit
def _e4m3(byte):
    """float64 value of E4M3 bytes (sign, NaN and negatives are refused before: nvfp4.scale_problem)."""
    ex, mn = (byte >> 3) & 15, byte & 7
    normal = (((ex + 1016).to(tl.int64) << 52) | (mn.to(tl.int64) << 49)).to(tl.float64, bitcast=True)
    return tl.where(ex == 0, mn.to(tl.float64) * 0.001953125, normal)


@triton.jit
def _bf16(x):
    """float32 ``x`` rounded to bf16 (to nearest, ties to even), as float32: by its bits, so every
    backend rounds alike."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _server_err2(v):
    """Per group (row of float64 ``v``), the squared error of the server's load-time rule
    (``nvfp4_requant.server_rule``): the values as bf16 (float64 -> float32 -> bf16, as torch casts),
    then aiter's per_1x32_i4_quant: scale bf16(max(amax, bf16(1e-6)) * fp32(1/7)), codes
    round-half-even(bf16(w / scale)) clamped to +-7; inf where a value is not finite in bf16."""
    w = _bf16(tl.abs(v).to(tl.float32))                          # |w|: the rounding is symmetric
    amax = tl.maximum(tl.max(w, axis=1), AMAX_FLOOR)[:, None]
    scale = _bf16(amax * RECIP7)
    x = _bf16((w.to(tl.float64) / scale.to(tl.float64)).to(tl.float32))   # fp32 w / s, rounded once
    r = tl.floor(x)
    d = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    q = tl.minimum(tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r), 7.0)
    q = tl.where(v < 0, -q, q)
    diff = q.to(tl.float64) * scale.to(tl.float64) - v
    err = tl.sum(diff * diff, axis=1)
    return tl.where(tl.max(w, axis=1) < float("inf"), err, float("inf"))


@triton.jit
def _search_kernel(packed_ptr, sbytes_ptr, g_ptr, scale_ptr, words_ptr, err_ptr, ref_ptr, amax_ptr, srv_ptr, G,
                   DIVIDE: tl.constexpr, BG: tl.constexpr, SLOTS: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.load(g_ptr)                           # the global scale, float64
    rows = pid * BG + tl.arange(0, BG)
    rmask = rows < G
    r64 = rows.to(tl.int64)
    e0 = _e4m3(tl.load(sbytes_ptr + r64 * 2, mask=rmask, other=0).to(tl.int32))[:, None]
    e1 = _e4m3(tl.load(sbytes_ptr + r64 * 2 + 1, mask=rmask, other=0).to(tl.int32))[:, None]

    # code counts per block, 5 bits a level: positives (codes 1-7) and negatives (9-15) apart
    col = tl.arange(0, 16)[None, :]
    byte = tl.load(packed_ptr + r64[:, None] * 16 + col, mask=rmask[:, None], other=0).to(tl.int64)
    one = tl.full([1, 1], 1, tl.int64)
    pos, neg = tl.zeros([BG, 16], tl.int64), tl.zeros([BG, 16], tl.int64)
    for half in tl.static_range(2):
        c = (byte >> (4 * half)) & 15
        pos += tl.where((c >= 1) & (c <= 7), one << (5 * c), 0)
        neg += tl.where(c >= 9, one << (5 * (c - 8)), 0)
    pos0 = tl.sum(tl.where(col < 8, pos, 0), axis=1)[:, None]
    pos1 = tl.sum(tl.where(col < 8, 0, pos), axis=1)[:, None]
    neg0 = tl.sum(tl.where(col < 8, neg, 0), axis=1)[:, None]
    neg1 = tl.sum(tl.where(col < 8, 0, neg), axis=1)[:, None]

    j = tl.arange(0, SLOTS)[None, :]
    b, lv, k = j // 56, (j % 56) // 8 + 1, j % 8
    real = j < 112
    l2 = _l2(lv)
    npos = ((tl.where(b == 0, pos0, pos1) >> (5 * lv)) & 31).to(tl.int32)
    nneg = ((tl.where(b == 0, neg0, neg1) >> (5 * lv)) & 31).to(tl.int32)
    e = tl.where(b == 0, e0, e1)
    present = real & ((npos + nneg) > 0)
    aw = tl.max(tl.where(present, (l2.to(tl.float64) * e) * 0.5, 0.0), axis=1)[:, None]
    floor = aw / 16
    c = tl.where(k <= 6, npos, 0) + nneg
    bw = (l2.to(tl.float64) * e) * 0.5 / (k.to(tl.float64) + 0.5)
    bw = tl.where(j == FLOOR, floor, bw)
    keep = ((real & (c > 0) & (bw >= floor)) | (j == FLOOR)) & (aw > 0)
    bits = bw.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(keep, (bits << 12) | (j.to(tl.int64) << 5) | c.to(tl.int64), 0)
    key = tl.sort(key, dim=1, descending=True)

    js = ((key >> 5) & 127).to(tl.int32)
    cs = (key & 31).to(tl.int32)
    b, lv, k = js // 56, (js % 56) // 8 + 1, js % 8
    l2 = _l2(lv)
    da = (2 * k + 1) * cs
    dn = l2 * cs
    dn0 = tl.where(b == 0, dn, 0)
    dn1 = tl.where(b == 0, 0, dn)
    a = tl.cumsum(da, axis=1)
    n0 = tl.cumsum(dn0, axis=1)
    n1 = tl.cumsum(dn1, axis=1)
    e = tl.where(b == 0, e0, e1)
    bw = (l2.to(tl.float64) * e) * 0.5 / (k.to(tl.float64) + 0.5)
    bw = tl.where(js == FLOOR, floor, bw)
    if DIVIDE:
        hi = bw / g
    else:
        hi = bw * g
    hi = tl.where(key > 0, hi, 0.0)

    best_k = tl.full([BG, SLOTS], float("inf"), tl.float64)
    best_s = tl.zeros([BG, SLOTS], tl.float64)
    best_k, best_s = _side(best_k, best_s, a, n0, n1, e0, e1, g, hi, True, DIVIDE)
    best_k, best_s = _side(best_k, best_s, a - da, n0 - dn0, n1 - dn1, e0, e1, g, hi, False, DIVIDE)
    kmin = tl.min(best_k, axis=1)
    s = tl.min(tl.where(best_k == kmin[:, None], best_s, float("inf")), axis=1)
    s = tl.where(kmin < float("inf"), s, 0.0)
    tl.store(scale_ptr + rows, s, mask=rmask)

    # the codes clamp(round-half-even(v / s), -8, 7) as nvfp4_requant.quantize computes them, packed
    idx = tl.arange(0, 32)[None, :]
    code = (tl.load(packed_ptr + r64[:, None] * 16 + idx // 2, mask=rmask[:, None], other=0).to(tl.int32)
            >> (4 * (idx % 2))) & 15
    w = (_l2(code).to(tl.float64) * tl.where(idx < 16, e0, e1)) * 0.5
    w = tl.where(code >= 8, -w, w)
    if DIVIDE:
        v = w / g
    else:
        v = w * g
    s2 = s[:, None]
    x = v / tl.where(s2 > 0, s2, 1.0)
    r = tl.floor(x)
    d = x - r                                    # exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)
    q = tl.where(s2 > 0, tl.minimum(tl.maximum(r, -8.0), 7.0), 0.0)
    nib = (q.to(tl.int64) + 8) << (4 * (idx % 8)).to(tl.int64)
    words = tl.sum(tl.reshape(nib, [BG, 4, 8]), axis=2).to(tl.int32)
    wc = tl.arange(0, 4)[None, :]
    tl.store(words_ptr + r64[:, None] * 4 + wc, words, mask=rmask[:, None])
    diff = q * s2 - v
    tl.store(err_ptr + rows, tl.sum(diff * diff, axis=1), mask=rmask)
    tl.store(ref_ptr + rows, tl.sum(v * v, axis=1), mask=rmask)
    tl.store(amax_ptr + rows, tl.max(tl.abs(diff), axis=1), mask=rmask)
    tl.store(srv_ptr + rows, _server_err2(v), mask=rmask)


def requantize(packed: torch.Tensor, block_scales: torch.Tensor, g: float, divide: bool, bg: int = BG,
               num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, ...]:
    """NVFP4 groups (packed uint8 [G, 16], float8_e4m3fn block scales [G, 2]) on a GPU -> per group the
    scale (float64, a bf16 number), the int4 words (int32 [G, 4], compressed-tensors pack-quantized),
    the squared error, the sum of the values squared, the largest |error| and the server rule's squared
    error (float64; inf where that rule cannot hold the values in bf16)."""
    n = packed.shape[0]
    dev = packed.device
    scale, err, ref, amax, srv = (torch.empty(n, dtype=torch.float64, device=dev) for _ in range(5))
    words = torch.empty(n, 4, dtype=torch.int32, device=dev)
    gt = torch.full((1,), g, dtype=torch.float64, device=dev)
    if n:
        _search_kernel[(triton.cdiv(n, bg),)](
            packed.contiguous(), block_scales.contiguous().view(torch.uint8), gt, scale, words, err, ref, amax, srv, n,
            DIVIDE=bool(divide), BG=bg, SLOTS=SLOTS, num_warps=num_warps, enable_fp_fusion=False)
    return scale, words, err, ref, amax, srv


def search(packed: torch.Tensor, block_scales: torch.Tensor, gscale) -> torch.Tensor:
    """``nvfp4_requant.search`` on a GPU: the scale of every group (float64), the CPU's bits."""
    return requantize(packed.reshape(-1, 16), block_scales.reshape(-1, 2), gscale.value, gscale.divide)[0]


def requantize_module(packed: torch.Tensor, block_scales: torch.Tensor, gscale, device,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """``nvfp4_requant.requantize_module`` on ``device`` (a GPU): one kernel for the scales, the codes and
    both rules' figures, then one wait (the figures' copy, ordered after the outputs'). ``out``: host
    buffers (pinned, for copies that do not stage) for the words and the bf16 scales."""
    from ..quant.nvfp4_requant import GROUP, ModuleResult, out_of_range

    rows, cols = packed.shape[0], packed.shape[1] * 2
    n = rows * cols // GROUP
    p = packed.to(device, non_blocking=True).reshape(-1, 16)
    b = block_scales.to(device, non_blocking=True).reshape(-1, 2)
    s, words, err, ref, amax, srv = requantize(p, b, gscale.value, gscale.divide)
    if out is None:
        out = (torch.empty(rows, cols // 8, dtype=torch.int32), torch.empty(rows, cols // GROUP, dtype=torch.bfloat16))
    host_words, host_scales = out[0].view(torch.int32).reshape(rows, cols // 8), out[1].view(torch.bfloat16)
    host_words.copy_(words.reshape(rows, cols // 8), non_blocking=True)
    host_scales = host_scales.reshape(rows, cols // GROUP)
    host_scales.copy_(s.to(torch.bfloat16).reshape(rows, cols // GROUP), non_blocking=True)
    zero = torch.zeros((), dtype=torch.float64, device=p.device)
    figs = torch.stack([err.sum(), ref.sum(), srv.sum(), amax.max() if n else zero,
                        out_of_range(s).sum().to(torch.float64)]).tolist()   # waits for the copies too
    return ModuleResult(host_words, host_scales, figs[0], figs[1], figs[2], figs[3], int(figs[4]))
