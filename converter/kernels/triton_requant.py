"""MXFP4 -> int4 group-32 requantization on the GPU (Triton), byte-identical to the CPU.

``requantize(packed, scales, offsets)`` computes exactly what
``converter.quant.requant.requantize`` computes (same int4 bytes, same bf16 scale bits;
per-tensor stats equal up to float64 summation order, max_abs and the counts exactly), for
a whole batch of tensors in one launch, on the tensors' device (CUDA, ROCm, or the Triton
interpreter on CPU with ``TRITON_INTERPRET=1``); ``qmin=-7`` (``--scale-rule optimal-pm7``) runs
the same kernel on the [-7, 7] range's tables, whose sizes and bounds ``_build_tables`` asserts
alike (149 level-6/7 candidates, 13 low ones). Plain Triton only: no inline asm, no
libdevice, so the same source builds for NVIDIA and for AMD gfx942 (compiled, not run).

How a group is searched (docs/spec.md §5; the bounds used are asserted in ``_build_tables``)
-----------------------------------------------------------------------------------
* Histogram: a group's 4 words become 4 bit-planes (one uint32 each); code c's count is
  popcount(AND of the planes or their complements): ~60 integer ops, not 512 compares.
* Levels 6 and 7 (every realistic group: OCP MX scaling puts the block maximum at 4 or 6)
  share one table over the union of their candidates (0..149, multipliers >= 0.375), where
  each squared error (q m - L)^2 is an integer in units of 2**-18. Entries are clipped at
  2**21 - 1 (a candidate with such an entry loses to a member whose total is provably
  smaller) and split into fp16 digits lo = e & 1023, hi = e >> 10; A = [hist, 1024 hist]
  makes one fp16 tensor-core product with fp32 accumulation give every total below 2**24
  units exactly -- the winner's included, its terms being non-negative and below the
  total. Non-members of a row's level get +2**21 through the rows of codes 0 and 8, whose
  errors are always 0.
* Exact argmin with one integer min per column: block 2 (candidates 128..149 and 10
  duplicated level-7 "helpers") gives v = min(total), which sampled data keeps within
  2**17 units of the winner. Block 1 (candidates 0..127, in NSPLIT slices) gets -vv,
  vv = v - (2**17 - 2), through a third fp16 K-slice, so its accumulator is T - vv and
  key = (T - vv) * 128 + column is an exact non-negative fp32 integer for the winner and
  order-preserving for the rest; its bits compare as int32, and min(key) yields the
  winner's index (key & 127) and exact error (vv + key >> 7) at once. If any level-6/7 row
  of a block fails that window check (not seen on realistic data) the block reruns an
  exact two-pass argmin over absolute totals.
* Levels 1..5 (tiny or hand-made blocks) take a per-block branch: a 16-column table in
  units of 2**-22, three fp16 digits, float64 combine, members masked by level.
* Output bytes are a gather from the [K, 256] byte map. err2 is the winner's exact total;
  ref2, max_abs, the NaN and range counts are per row, kept as per-row partial vectors
  while a program stays in one tensor and flushed with float64 atomics when it changes
  (persistent grid, contiguous chunks of blocks per program).

Throughput: prediction and measurement
--------------------------------------
35 bytes move per group (17 in, 18 out); 60% of an H200's ~4.3 TB/s copy is ~7.4e10
groups/s, ~3.4 SM-cycles a group. Per group the tensor cores do ~14 kFLOP (~4.5 SM-cycles
at ~790 TFLOP/s) and the SIMT side ~1200 instructions (~9.5 SM-cycles at 4 issues/cycle:
~450 for the 160-column argmin, ~250 histogram and fp16 staging, ~260 gather/scale/stats),
so even perfectly issue-bound the exact search tops out near 2.5e10 groups/s (~20% of
copy). Measured on one H200 (Triton 3.6, 2026-11-30; scripts/benchmarks/bench_kernel.py, 1.76e8
realistic groups): 38.9 ms = 4.5e9 groups/s = 0.16 TB/s = 3.7% of copy (copy 4.28 TB/s);
without statistics 29 ms. The kernel is latency-bound, ~5x off its issue bound: 255
registers/thread allow 8 warps per SM, and Triton's layout conversions put dozens of
block barriers in every iteration. Reaching 60% needs far fewer instructions per group
(finer LP-proven candidate classes) and register-resident, warp-specialized code that
plain Triton does not express; an attempt to split the rare paths into a second kernel
and prefetch by hand ran 3x slower and was reverted.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import triton
import triton.language as tl

from converter.quant.candidates import BY_QMIN
from converter.quant.requant import STAT_FIELDS, Result
from converter.quant.tables import E2M1_VALUES, QMIN, tables

# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------
FAST_SHIFT = 18                 # levels 6/7: errors are integers in units of 2**-18
LOW_SHIFT = 22                  # levels 1..5: units of 2**-22 (multipliers down to 1/16)
CLIP = (1 << 21) - 1            # fast-table entries clipped here (hi digit <= 2047)
PEN_A, PEN_B = 1024.0, 2048.0   # non-member penalty: 1024 * 2048 = 2**21 units
N1, N2, NL = 128, 32, 16        # columns of block 1, block 2, the low-level table
# Helpers duplicated into block 2 so that min(block 2) is close to typical level-7 winners
# (chosen greedily on Gaussian/Student-t/Laplace/uniform/random-code groups). Only speed
# depends on them: a bad choice just sends more blocks down the exact fallback.
HELPER_BITS = (0x3F46, 0x3F7C, 0x3F55, 0x3F37, 0x3FBF, 0x3F41, 0x3F58, 0x3F7F, 0x3F51, 0x3F44)


@dataclass(frozen=True)
class _HostTables:
    b1: np.ndarray        # [32, N1] float16: rows 0..15 lo digits, 16..31 hi digits
    b2: np.ndarray        # [32, N2] float16
    cand1: np.ndarray     # [N1] int32 candidate index of each block-1 column
    cand2: np.ndarray     # [N2] int32
    bl: np.ndarray        # [3, 16, NL] float16 digits (2**0, 2**11, 2**22) of the low table
    lowcand: np.ndarray   # [NL] int32
    lowmask: np.ndarray   # [8, NL] int32: 1 where column is a member of the row's level
    bits: np.ndarray      # [K] int32 bf16 bits of each candidate
    bmap: np.ndarray      # [K, 256] uint8
    abserr: np.ndarray    # [K, 16] float32 (exact)
    l2x4: np.ndarray      # [16] int32: 4 * value^2 of each code


def _as_int(x: np.ndarray, what: str) -> np.ndarray:
    r = np.round(x)
    if not np.array_equal(r, x):
        raise AssertionError(f"{what}: not an integer grid")
    return r.astype(np.int64)


@functools.cache
def _build_tables(qmin: int = QMIN) -> _HostTables:
    """Derive the kernel's tables from converter.quant.tables for codes ``[qmin, 7]``, checking
    every bound used (the kernel is the same for both code ranges, only its tables differ)."""
    t = tables(qmin)
    candidate_bits, class_members = BY_QMIN[qmin]
    k_all = t.err2.shape[1]
    mem = {lv: set(int(i) for i in ix) for lv, ix in class_members.items()}
    codes_upto = {lv: [c for c in range(16) if (c & 7) <= lv] for lv in range(8)}

    # ---- fast table: levels 6 and 7 ------------------------------------------------------
    fast = sorted(mem[6] | mem[7])
    block1, overflow = fast[:N1], fast[N1:]
    helpers = [i for i, b in enumerate(candidate_bits) if b in HELPER_BITS and i in mem[7]]
    helpers = [i for i in helpers if i not in overflow][: N2 - len(overflow)]
    if len(overflow) > N2:
        raise AssertionError("candidate table too large for the two-block kernel")
    cols2 = sorted(overflow + helpers)
    pad2 = N2 - len(cols2)
    cand1 = np.array(block1 + [block1[0]] * (N1 - len(block1)), dtype=np.int32)
    cand2 = np.array(cols2 + [fast[0]] * pad2, dtype=np.int32)

    e = t.err2 * 2.0 ** FAST_SHIFT
    units = np.zeros((16, k_all), dtype=np.int64)
    units[:, fast] = _as_int(e[:, fast], "fast errors")
    # The winner's total error is at most that of any member; bound it per level.
    for lv in (6, 7):
        per_member = [32 * units[codes_upto[lv], k].max() for k in sorted(mem[lv])]
        bound = min(per_member)
        # winner entries unclipped, penalty beats it, v stays < 2**22, fp32 exact < 2**24
        assert bound < CLIP < PEN_A * PEN_B <= 2 ** 22 and bound + 2 ** 17 < 2 ** 22, (lv, bound)
    clipped = np.minimum(units, CLIP)
    assert np.all(clipped[[0, 8], :] == 0)  # codes 0 and 8 (zero) carry the penalty rows

    def fast_block(cols: np.ndarray, pad_from: int) -> np.ndarray:
        b = np.zeros((32, len(cols)), dtype=np.float64)
        ent = clipped[:, cols]
        b[:16] = ent & 1023
        b[16:] = ent >> 10
        for j, k in enumerate(cols):
            pad = j >= pad_from
            b[8, j] = PEN_B if (pad or k not in mem[7]) else 0.0    # A = 1024 on level-7 rows
            b[24, j] = PEN_B if (pad or k not in mem[6]) else 0.0   # A = 1024 on level-6 rows
        assert np.all(b <= 2048)  # digits <= 2047, penalty 2048: all exact in fp16
        return b.astype(np.float16)

    b1 = fast_block(cand1, len(block1))
    b2 = fast_block(cand2, len(cols2))

    # ---- low table: levels 1..5 -----------------------------------------------------------
    low = sorted(set().union(*(mem[lv] for lv in range(1, 6))))
    assert len(low) <= NL
    lowcand = np.array(low + [low[0]] * (NL - len(low)), dtype=np.int32)
    e22 = np.zeros((16, NL), dtype=np.int64)
    rel = codes_upto[5]
    e22[rel, :] = _as_int(t.err2[np.ix_(np.asarray(rel), lowcand)] * 2.0 ** LOW_SHIFT, "low errors")
    digits = np.stack([e22 & 2047, (e22 >> 11) & 2047, e22 >> 22])
    assert np.all(digits < 2048)
    lowmask = np.zeros((8, NL), dtype=np.int32)
    for lv in range(1, 6):
        for j, k in enumerate(low):
            lowmask[lv, j] = int(k in mem[lv])

    # ---- per-candidate outputs ---------------------------------------------------------------
    bits = np.array(candidate_bits, dtype=np.int32)
    abserr = t.abserr.T.astype(np.float32)
    assert np.array_equal(abserr.astype(np.float64), t.abserr.T)
    l2x4 = _as_int(4 * E2M1_VALUES ** 2, "values^2").astype(np.int32)
    return _HostTables(
        b1=b1, b2=b2, cand1=cand1, cand2=cand2, bl=digits.astype(np.float16), lowcand=lowcand,
        lowmask=lowmask, bits=bits, bmap=np.ascontiguousarray(t.byte_map),
        abserr=np.ascontiguousarray(abserr), l2x4=l2x4,
    )


_DEVICE_TABLES: dict[tuple[str, int], dict[str, torch.Tensor]] = {}


def _device_tables(device: torch.device, qmin: int = QMIN) -> dict[str, torch.Tensor]:
    key = (str(device), qmin)
    if key not in _DEVICE_TABLES:
        h = _build_tables(qmin)
        _DEVICE_TABLES[key] = {
            name: torch.from_numpy(np.ascontiguousarray(getattr(h, name))).to(device)
            for name in h.__dataclass_fields__
        }
    return _DEVICE_TABLES[key]


# ---------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------
@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _popcount32(x):
    # Classic SWAR popcount (LLVM turns this pattern into a native popcount).
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def _flush(stats_ptr, stats_i_ptr, t, e, r, m, n, b):
    tl.atomic_add(stats_ptr + t * 5 + 0, tl.sum(e, axis=0))
    tl.atomic_add(stats_ptr + t * 5 + 1, tl.sum(r, axis=0))
    tl.atomic_max(stats_i_ptr + t * 5 + 2, tl.max(m, axis=0).to(tl.int64, bitcast=True))
    tl.atomic_add(stats_ptr + t * 5 + 3, tl.sum(n, axis=0).to(tl.float64))
    tl.atomic_add(stats_ptr + t * 5 + 4, tl.sum(b, axis=0).to(tl.float64))


@triton.jit
def _bv_tile(r16, jq, q: tl.constexpr):
    w = tl.where(r16 == 2 * q, 1.0, tl.where(r16 == 2 * q + 1, 1024.0, 0.0))
    return (w[:, None] + 0.0 * jq[None, :]).to(tl.float16)


@triton.jit
def _slice_min(a_v, a_lo, a_hi, bv, blo, bhi, colf):
    # min over columns of (T - vv) * 128 + column: exact for the winner (see module doc);
    # keys are >= 0 whenever the block is valid, so their bits compare as integers
    # (cheaper 3-way integer min); a negative key shows up as a negative integer
    acc = tl.dot(a_v, bv, out_dtype=tl.float32)
    acc = tl.dot(a_lo, blo, acc, out_dtype=tl.float32)
    acc = tl.dot(a_hi, bhi, acc, out_dtype=tl.float32)
    key = (acc * 128.0 + colf[None, :]).to(tl.int32, bitcast=True)
    return tl.min(key, axis=1)


@triton.jit
def _slice_exact(a_lo, a_hi, blo, bhi, candv):
    # (min total, smallest candidate index attaining it) over one column slice
    acc = tl.dot(a_lo, blo, out_dtype=tl.float32)
    acc = tl.dot(a_hi, bhi, acc, out_dtype=tl.float32)
    m = tl.min(acc, axis=1)
    return m, tl.min(tl.where(acc == m[:, None], candv[None, :], 1 << 20), axis=1)


@triton.jit
def _requant_kernel(
    words_ptr, bytes_ptr, scales_ptr, out_ptr, oscale_ptr,
    stats_ptr, stats_i_ptr, blk_tid_ptr, offsets_ptr,
    b1_ptr, b2_ptr, cand1_ptr, cand2_ptr, bl_ptr, lowcand_ptr, lowmask_ptr,
    bits_ptr, bmap_ptr, abserr_ptr, l2x4_ptr,
    G, nblk, chunk,
    BG: tl.constexpr, STATS: tl.constexpr, FORCE_EXACT: tl.constexpr, NSPLIT: tl.constexpr,
):
    N1C: tl.constexpr = 128
    N2C: tl.constexpr = 32
    QW: tl.constexpr = N1C // NSPLIT
    c4 = tl.arange(0, 4)
    c16 = tl.arange(0, 16)
    r16 = tl.arange(0, 16)
    jq = tl.arange(0, QW)
    j2 = tl.arange(0, N2C)

    # Loop-invariant tables (kept on chip across the program's blocks).
    q0lo = tl.load(b1_ptr + r16[:, None] * N1C + jq[None, :])
    q0hi = tl.load(b1_ptr + (r16[:, None] + 16) * N1C + jq[None, :])
    q1lo = tl.load(b1_ptr + r16[:, None] * N1C + QW + jq[None, :])
    q1hi = tl.load(b1_ptr + (r16[:, None] + 16) * N1C + QW + jq[None, :])
    if NSPLIT == 4:
        q2lo = tl.load(b1_ptr + r16[:, None] * N1C + 2 * QW + jq[None, :])
        q2hi = tl.load(b1_ptr + (r16[:, None] + 16) * N1C + 2 * QW + jq[None, :])
        q3lo = tl.load(b1_ptr + r16[:, None] * N1C + 3 * QW + jq[None, :])
        q3hi = tl.load(b1_ptr + (r16[:, None] + 16) * N1C + 3 * QW + jq[None, :])
    b2lo = tl.load(b2_ptr + r16[:, None] * N2C + j2[None, :])
    b2hi = tl.load(b2_ptr + (r16[:, None] + 16) * N2C + j2[None, :])
    l2x4 = tl.load(l2x4_ptr + c16)
    # B rows for the -vv slice: slice q weighs rows 2q (low digit, 1) and 2q+1 (high, 1024).
    # Distinct rows per slice keep the compiler from sharing one product and copying it.
    bv0 = _bv_tile(r16, jq, 0)
    bv1 = _bv_tile(r16, jq, 1)
    bv2 = _bv_tile(r16, jq, 2)
    bv3 = _bv_tile(r16, jq, 3)
    colq = jq.to(tl.float32)
    col2 = j2.to(tl.float32)
    # plane masks: f_b[c] = 0 where bit b of code c is set, else all ones
    f0 = ((c16 & 1) == 0).to(tl.uint32) * 0xFFFFFFFF
    f1 = (((c16 >> 1) & 1) == 0).to(tl.uint32) * 0xFFFFFFFF
    f2 = (((c16 >> 2) & 1) == 0).to(tl.uint32) * 0xFFFFFFFF
    f3 = (((c16 >> 3) & 1) == 0).to(tl.uint32) * 0xFFFFFFFF
    sh4 = c4.to(tl.uint32)

    pid = tl.program_id(0)
    blk_lo = pid * chunk
    blk_hi = tl.minimum(blk_lo + chunk, nblk)

    # per-row partial statistics of the current tensor, reduced only when it changes
    cur_t = blk_lo * 0 - 1
    v_e = tl.full([BG], 0.0, tl.float64)
    v_r = tl.full([BG], 0.0, tl.float64)
    v_m = tl.full([BG], 0.0, tl.float64)
    v_n = tl.full([BG], 0, tl.int32)
    v_b = tl.full([BG], 0, tl.int32)

    for blk in range(blk_lo, blk_hi):
        rows = blk * BG + tl.arange(0, BG)
        valid = rows < G
        rows64 = rows.to(tl.int64)

        # ---- histogram through bit-planes -------------------------------------------------
        w = tl.load(words_ptr + rows64[:, None] * 4 + c4[None, :], mask=valid[:, None], other=0)
        w = w.to(tl.uint32, bitcast=True)
        p0 = tl.reduce((w & 0x11111111) << sh4[None, :], 1, _or)
        p1 = tl.reduce(((w >> 1) & 0x11111111) << sh4[None, :], 1, _or)
        p2 = tl.reduce(((w >> 2) & 0x11111111) << sh4[None, :], 1, _or)
        p3 = tl.reduce(((w >> 3) & 0x11111111) << sh4[None, :], 1, _or)
        x = ((p0[:, None] ^ f0[None, :]) & (p1[:, None] ^ f1[None, :])
             & (p2[:, None] ^ f2[None, :]) & (p3[:, None] ^ f3[None, :]))
        hist = _popcount32(x).to(tl.int32)                      # [BG, 16]
        if STATS:
            rsum = tl.sum(hist * l2x4[None, :], axis=1)              # 4 * sum of value^2
            present = tl.sum(tl.where(hist > 0, 1 << c16[None, :], 0), axis=1)

        m01 = p0 & p1
        level = tl.where((m01 & p2) != 0, 7,
                tl.where((p1 & p2) != 0, 6,
                tl.where((p0 & p2) != 0, 5,
                tl.where(p2 != 0, 4,
                tl.where(m01 != 0, 3,
                tl.where(p1 != 0, 2,
                tl.where(p0 != 0, 1, 0)))))))
        is7 = level == 7
        is6 = level == 6
        fastrow = level >= 6

        # ---- levels 6/7: exact fp16 products ----------------------------------------------
        # exact int -> fp16 without the slow converter: bits 0x6400 | n is 1024 + n
        hf = ((hist | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0).to(tl.float16)
        is8 = c16[None, :] == 8
        a_lo = tl.where(is8, tl.where(is7, 1024.0, 0.0).to(tl.float16)[:, None], hf)
        a_hi = tl.where(is8, tl.where(is6, 1024.0, 0.0).to(tl.float16)[:, None], hf * 1024.0)
        acc2 = tl.dot(a_lo, b2lo, out_dtype=tl.float32)
        acc2 = tl.dot(a_hi, b2hi, acc2, out_dtype=tl.float32)
        # totals are >= 0, so fp32 bit patterns order like the values
        v = tl.min(acc2.to(tl.int32, bitcast=True), axis=1).to(tl.float32, bitcast=True)
        k2 = tl.min(((acc2 - v[:, None]) * 32.0 + col2[None, :]).to(tl.int32, bitcast=True), axis=1)
        k2 = k2.to(tl.float32, bitcast=True)
        # block 1 computes T - vv directly (a third K-slice carries -vv's fp16 digits);
        # relative to vv = v - (2**17 - 2) the winner's key lies in [0, 2**24): exact
        vv = tl.minimum(tl.maximum(v - 131070.0, 0.0), 2097151.0)
        vh = tl.floor(vv * 0.0009765625)
        vl = vv - vh * 1024.0
        a_v = tl.where((c16[None, :] & 1) == 0, -vl[:, None], -vh[:, None]).to(tl.float16)
        k1 = _slice_min(a_v, a_lo, a_hi, bv0, q0lo, q0hi, colq)
        k1 = tl.minimum(k1, _slice_min(a_v, a_lo, a_hi, bv1, q1lo, q1hi, colq + QW))
        if NSPLIT == 4:
            k1 = tl.minimum(k1, _slice_min(a_v, a_lo, a_hi, bv2, q2lo, q2hi, colq + 2 * QW))
            k1 = tl.minimum(k1, _slice_min(a_v, a_lo, a_hi, bv3, q3lo, q3hi, colq + 3 * QW))
        k1f = k1.to(tl.float32, bitcast=True)
        ok = (k1 >= 0) & (k1f < 16777088.0) & (v < 2097152.0)   # 2**24 - 128, 2**21
        vi = vv.to(tl.int32)
        k1i = tl.minimum(tl.maximum(k1f, 0.0), 1073741824.0).to(tl.int32)
        k2i = tl.minimum(k2, 1073741824.0).to(tl.int32)
        cand1 = tl.load(cand1_ptr + (k1i & 127))
        cand2 = tl.load(cand2_ptr + (k2i & 31))
        t1 = vi + (k1i >> 7)
        t2 = tl.minimum(v, 1073741824.0).to(tl.int32) + (k2i >> 5)
        take2 = (t2 < t1) | ((t2 == t1) & (cand2 < cand1))
        kbest = tl.where(take2, cand2, cand1)
        tbest = tl.where(take2, t2, t1)

        need_exact = tl.max((fastrow & (ok == 0)).to(tl.int32), axis=0) > 0
        if need_exact or FORCE_EXACT:
            # exact two-pass argmin over absolute totals (recomputed slice by slice; exact
            # for the winner whichever slice holds it), ties to the smaller candidate index
            m1, i1 = _slice_exact(a_lo, a_hi, q0lo, q0hi, tl.load(cand1_ptr + jq))
            mq, iq = _slice_exact(a_lo, a_hi, q1lo, q1hi, tl.load(cand1_ptr + QW + jq))
            i1 = tl.where(mq < m1, iq, i1)
            m1 = tl.minimum(m1, mq)
            if NSPLIT == 4:
                mq, iq = _slice_exact(a_lo, a_hi, q2lo, q2hi, tl.load(cand1_ptr + 2 * QW + jq))
                i1 = tl.where(mq < m1, iq, i1)
                m1 = tl.minimum(m1, mq)
                mq, iq = _slice_exact(a_lo, a_hi, q3lo, q3hi, tl.load(cand1_ptr + 3 * QW + jq))
                i1 = tl.where(mq < m1, iq, i1)
                m1 = tl.minimum(m1, mq)
            m2 = tl.min(acc2, axis=1)
            i2 = tl.min(tl.where(acc2 == m2[:, None], tl.load(cand2_ptr + j2)[None, :], 1 << 20), axis=1)
            tk2 = (m2 < m1) | ((m2 == m1) & (i2 < i1))
            kx = tl.where(tk2, i2, i1)
            tx = tl.minimum(tl.where(tk2, m2, m1), 1073741824.0).to(tl.int32)
            kbest = tl.where(fastrow, kx, kbest)
            tbest = tl.where(fastrow, tx, tbest)
        errv = tbest.to(tl.float64) * 3.814697265625e-06         # 2**-18

        # ---- levels 1..5: exact small search (rare) ---------------------------------------
        lowrow = (level >= 1) & (level <= 5)
        if tl.max(lowrow.to(tl.int32), axis=0) > 0:
            bl0 = tl.load(bl_ptr + r16[:, None] * 16 + c16[None, :])
            bl1 = tl.load(bl_ptr + 256 + r16[:, None] * 16 + c16[None, :])
            bl2 = tl.load(bl_ptr + 512 + r16[:, None] * 16 + c16[None, :])
            d0 = tl.dot(hf, bl0, out_dtype=tl.float32)
            d1 = tl.dot(hf, bl1, out_dtype=tl.float32)
            d2 = tl.dot(hf, bl2, out_dtype=tl.float32)
            tot = d0.to(tl.float64) + d1.to(tl.float64) * 2048.0 + d2.to(tl.float64) * 4194304.0
            allow = tl.load(lowmask_ptr + level[:, None] * 16 + c16[None, :])
            tot = tl.where(allow != 0, tot, float("inf"))
            ml = tl.min(tot, axis=1)
            jl = tl.min(tl.where(tot == ml[:, None], c16[None, :], 99), axis=1)
            jl = tl.minimum(jl, 15)
            kl = tl.load(lowcand_ptr + jl)
            kbest = tl.where(lowrow, kl, kbest)
            errv = tl.where(lowrow, ml * 2.384185791015625e-07, errv)  # 2**-22

        # ---- scale bits --------------------------------------------------------------------
        s = tl.load(scales_ptr + rows64, mask=valid, other=0).to(tl.int32)
        kb = tl.load(bits_ptr + kbest)
        field = ((kb >> 7) & 255) + s - 127
        nan = s == 255
        nonzero = level > 0
        bad = nonzero & (nan == 0) & ((field < 1) | (field > 254))
        obits = tl.where(nonzero & (bad == 0) & (nan == 0), (field << 7) | (kb & 127), 0)
        tl.store(oscale_ptr + rows64, obits.to(tl.int16), mask=valid)

        # ---- int4 bytes: each MXFP4 byte through the candidate's byte map --------------------
        boff = rows64[:, None] * 16 + c16[None, :]
        bts = tl.load(bytes_ptr + boff, mask=valid[:, None], other=0).to(tl.int32)
        ob = tl.load(bmap_ptr + kbest[:, None] * 256 + bts)
        tl.store(out_ptr + boff, ob, mask=valid[:, None])

        # ---- statistics --------------------------------------------------------------------
        if STATS:
            u2 = ((2 * s + 769).to(tl.int64) << 52).to(tl.float64, bitcast=True)   # 2**(2s-254)
            unit = ((s + 896).to(tl.int64) << 52).to(tl.float64, bitcast=True)     # 2**(s-127)
            keep = valid & (nan == 0)
            err2 = tl.where(keep, errv * u2, 0.0)
            ref2 = tl.where(keep, rsum.to(tl.float64) * 0.25 * u2, 0.0)
            ae = tl.load(abserr_ptr + kbest[:, None] * 16 + c16[None, :])
            mx = tl.max(tl.where(((present[:, None] >> c16[None, :]) & 1) != 0, ae, 0.0), axis=1)
            mxa = tl.where(keep, mx.to(tl.float64) * unit, 0.0)
            nan = nan & valid
            bad = bad & valid

            t0 = tl.load(blk_tid_ptr + 2 * blk)
            t1b = tl.load(blk_tid_ptr + 2 * blk + 1)
            if t0 == t1b:
                if t0 != cur_t:
                    if cur_t >= 0:
                        _flush(stats_ptr, stats_i_ptr, cur_t, v_e, v_r, v_m, v_n, v_b)
                    cur_t = t0
                    v_e = err2
                    v_r = ref2
                    v_m = mxa
                    v_n = nan.to(tl.int32)
                    v_b = bad.to(tl.int32)
                else:
                    v_e += err2
                    v_r += ref2
                    v_m = tl.maximum(v_m, mxa)
                    v_n += nan.to(tl.int32)
                    v_b += bad.to(tl.int32)
            else:
                # block straddles tensors: find each row's tensor, flush per tensor
                tid = tl.full([BG], 0, tl.int32) + t0
                for tt in range(t0 + 1, t1b + 1):
                    tid += (rows64 >= tl.load(offsets_ptr + tt)).to(tl.int32)
                for tt in range(t0, t1b + 1):
                    sel = (tid == tt) & valid
                    _flush(stats_ptr, stats_i_ptr, tt, tl.where(sel, err2, 0.0), tl.where(sel, ref2, 0.0),
                           tl.where(sel, mxa, 0.0), (nan & sel).to(tl.int32), (bad & sel).to(tl.int32))

    if STATS:
        if cur_t >= 0:
            _flush(stats_ptr, stats_i_ptr, cur_t, v_e, v_r, v_m, v_n, v_b)


# ---------------------------------------------------------------------------------------
# Launch configuration per target
# ---------------------------------------------------------------------------------------
# NVIDIA: measured on the H200 (module doc); 255 registers/thread and no spills there.
_NVIDIA_CONFIG = {"block_groups": 128, "nsplit": 4, "num_warps": 4, "num_stages": 3}
# AMD (CDNA, wave64), chosen by cross-compiling every block 64/128 x nsplit 2/4 x warps 4/8
# x stages 1/2/3 with Triton 3.9 (scripts/tools/amd_kernel_report.py --sweep). The NVIDIA config
# spills VGPRs on gfx942 and gfx90a; every 8-warp config spills (8 waves a workgroup cap a
# wave at 256 registers); num_stages=1 (no stream-pipeliner prefetch copies) halves the code
# and, on gfx942/gfx90a, is the only stage count with no VGPR spills for every block/nsplit at
# 4 warps, with or without alignment hints. Among those, occupancy first, then fewer static
# block-loop instructions per group: gfx942/gfx90a are at 1 wave per SIMD whatever the
# blocking, and block 128 / nsplit 4 needs ~40% fewer than 64 / 2; on gfx950, 64 / 2 fits in 250
# VGPRs and runs 2 waves per SIMD. 64 / 2 uses the fewest registers everywhere, so it is the
# choice for gfx archs not measured.
_AMD_SAFE_CONFIG = {"block_groups": 64, "nsplit": 2, "num_warps": 4, "num_stages": 1}
_AMD_CONFIGS: dict[str, dict[str, int]] = {
    "gfx90a": {"block_groups": 128, "nsplit": 4, "num_warps": 4, "num_stages": 1},
    "gfx942": {"block_groups": 128, "nsplit": 4, "num_warps": 4, "num_stages": 1},
    "gfx950": _AMD_SAFE_CONFIG,
}
# Interpreter: warps and stages are ignored and 64 / 2 runs as fast as 128 / 4 there; it runs
# the NVIDIA blocking (the one measured on a GPU); tests run the AMD ones explicitly.
_INTERPRETER_CONFIG = _NVIDIA_CONFIG


def launch_config(arch: str) -> dict[str, int]:
    """Default kernel knobs for a target: ``sm_XY`` (NVIDIA), ``gfxNNN`` (AMD), ``interpreter``.

    Keys ``block_groups``, ``nsplit``, ``num_warps``, ``num_stages`` (see :func:`prepare`).
    Register pressure differs by target, so a config that fits an H200 spills on gfx942.
    """
    if arch == "interpreter":
        return dict(_INTERPRETER_CONFIG)
    if arch.startswith("sm_"):
        return dict(_NVIDIA_CONFIG)
    if arch.startswith("gfx"):
        return dict(_AMD_CONFIGS.get(arch, _AMD_SAFE_CONFIG))
    raise ValueError(f"unknown kernel target {arch!r} (expected sm_XY, gfxNNN or interpreter)")


def device_arch(device: torch.device | str) -> str:
    """The :func:`launch_config` target of a torch device: ``sm_90``, ``gfx942``, ``interpreter``."""
    device = torch.device(device)
    if device.type != "cuda":
        return "interpreter"
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return str(props.gcnArchName).split(":")[0]
    return f"sm_{props.major}{props.minor}"


# ---------------------------------------------------------------------------------------
# Host wrapper
# ---------------------------------------------------------------------------------------
def _num_programs(device: torch.device, nblk: int, per_sm: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(nblk, sms * per_sm))
    return max(1, min(nblk, 7))  # interpreter: a few programs, so the block loop runs


def prepare(
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: list[int] | torch.Tensor | None = None,
    *,
    block_groups: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int = 2,
    nsplit: int | None = None,
    stats: bool = True,
    force_exact: bool = False,
    maxnreg: int | None = None,
    qmin: int = QMIN,
) -> Callable[[], Result]:
    """Validate and allocate once; return a callable that launches the kernel (benchmarks).

    Each call of the returned function re-zeroes the statistics and overwrites the outputs,
    so timing it measures one full requantization. Knobs: ``block_groups`` groups a block,
    ``nsplit`` column slices of block 1 (2 or 4), ``maxnreg`` caps registers (NVIDIA);
    ``stats=False`` skips statistics (timing only); ``force_exact`` sends every level-6/7
    group through the exact second pass (tests); ``qmin`` the lowest code, -8 (``optimal``) or -7
    (``optimal-pm7``). Knobs left at None come from ``launch_config(device_arch(packed.device))``.
    """
    defaults = launch_config(device_arch(packed.device))
    block_groups = defaults["block_groups"] if block_groups is None else block_groups
    nsplit = defaults["nsplit"] if nsplit is None else nsplit
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError("packed and scales must be uint8")
    if packed.dim() != 2 or packed.shape[1] != 16 or scales.shape != packed.shape[:1]:
        raise ValueError(
            f"expected packed [G, 16] and scales [G], got {tuple(packed.shape)} and {tuple(scales.shape)}")
    if scales.device != packed.device:
        raise ValueError("packed and scales must be on the same device")
    if nsplit not in (2, 4) or block_groups not in (64, 128, 256):
        raise ValueError("unsupported kernel knobs")
    device = packed.device
    g = packed.shape[0]
    off_list = [0, g] if offsets is None else [int(x) for x in (
        offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]
    if len(off_list) < 2 or off_list[0] != 0 or off_list[-1] != g or any(
            b < a for a, b in zip(off_list[:-1], off_list[1:])):
        raise ValueError("offsets must rise from 0 to G")
    off = torch.tensor(off_list, dtype=torch.int64, device=device)
    out = torch.empty_like(packed)
    out_scale = torch.empty(g, dtype=torch.int16, device=device)
    stats_t = torch.zeros(len(off_list) - 1, len(STAT_FIELDS), dtype=torch.float64, device=device)
    result = Result(out, out_scale.view(torch.bfloat16), stats_t)
    if g == 0:
        return lambda: result

    packed = packed.contiguous()
    if packed.data_ptr() % 16:
        packed = packed.clone()
    scales = scales.contiguous()
    words = packed.view(torch.int32)
    tabs = _device_tables(device, qmin)
    extra = {"maxnreg": maxnreg} if (maxnreg and device.type == "cuda") else {}
    bg = block_groups
    nblk = math.ceil(g / bg)
    starts = torch.arange(nblk, dtype=torch.int64, device=device) * bg
    ends = torch.clamp(starts + bg, max=g) - 1
    blk_tid = torch.stack([
        torch.searchsorted(off, starts, right=True) - 1,
        torch.searchsorted(off, ends, right=True) - 1,
    ], dim=1).to(torch.int32).contiguous()
    nprog = _num_programs(device, nblk, programs_per_sm)
    chunk = math.ceil(nblk / nprog)
    nprog = math.ceil(nblk / chunk)

    def run() -> Result:
        stats_t.zero_()
        run.compiled = _requant_kernel[(nprog,)](  # type: ignore[attr-defined]  # a function attribute
            words, packed, scales, out, out_scale,
            stats_t, stats_t.view(torch.int64), blk_tid, off,
            tabs["b1"], tabs["b2"], tabs["cand1"], tabs["cand2"], tabs["bl"], tabs["lowcand"],
            tabs["lowmask"], tabs["bits"], tabs["bmap"], tabs["abserr"], tabs["l2x4"],
            g, nblk, chunk,
            BG=bg, STATS=stats, FORCE_EXACT=force_exact, NSPLIT=nsplit,
            num_warps=num_warps, num_stages=num_stages, **extra,
        )
        return result

    run.compiled = None  # type: ignore[attr-defined]  # Triton's compiled kernel (registers, spills), for reports
    return run


def requantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: list[int] | torch.Tensor | None = None,
    **knobs: Any,
) -> Result:
    """Requantize a batch of tensors of ``G`` groups on ``packed.device`` (see module doc).

    Same contract and bytes as ``converter.quant.requant.requantize``: ``offsets`` gives the
    group index where each tensor starts, plus ``G`` at the end (default: one tensor).
    ``knobs`` are the tuning keywords of :func:`prepare`.
    """
    return prepare(packed, scales, offsets, **knobs)()
