"""The fast CPU requantizer: the same function as requant.requantize, compiled with numba.

Per group, nothing materialized: the magnitude counts by bit-plane popcounts, every
candidate of the group's class scored at once in explicit int32 vector code, the first best
kept, then the bytes (two 16-entry table shuffles), the scale and the statistics. Groups go in
runs of ``SUB``: the scores of a run first, then its bytes, so the stores never wait on the
long score chain.

Exact, so threads and vector widths cannot change a byte (docs/maths.md):

* A class's scores are integers ``F[c, k]`` (tables.class_int_scores) with
  ``32 * max|F| < 2**27``. Below the class's top magnitude +L and -L score alike (the int4
  clamp is asymmetric only at the top; asserted below), so a group's score is
  ``sum_mag h_mag F[mag] + h_top- (F[top-] - F[top])`` with h_mag counting both signs.
* The vector lanes carry keys ``8 * score + b``, b < 8 the candidate's block: below ``2**30``
  in magnitude, padding slots hold ``2**30`` and never win. int32 sums wrap modulo 2**32 and
  every key's true value fits, so any summation order gives it exactly.
* Products come from PMADDWD (signed 16-bit pairs multiply-added into int32): ``8 F = 1023 hi
  + lo`` with ``0 <= lo < 1023`` and ``|hi| < 2**15`` (asserted), multiplied by ``(h, 1023 h)``;
  ``h <= 32`` so ``1023 h`` fits int16, and ``h lo + 1023 h hi = 8 h F`` exactly.
* Lane l of block b holds candidate ``l * nb + b`` (priority order). A lane's minimum key over
  the blocks keeps its first best score, the smallest score over the lanes then its first
  lane: the first exact minimum, i.e. the tie rule.
* A group's squared error is its ranking score plus ``sum h L^2`` (both exact in float64), as
  the reference computes it term by term.
"""
from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .requant import STAT_FIELDS, Result
from .server_rule import server_tables
from .tables import E2M1_VALUES, QMIN, class_int_scores, tables

CHUNK = 4096  # groups per parallel work item
SUB = 64      # groups scored before their bytes are written
LANES = 16    # candidates per vector block
TERMS = 8     # magnitudes 1..7 (both signs) and the top magnitude's negative codes
PAD = 1 << 30  # key of a padding slot: above every real key (|8 * score + b| < 2**30)
SPLIT = 1023  # 8 F = SPLIT * hi + lo, see the module docstring

_I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
_KEYS = ir.VectorType(_I32, LANES)
_PAIRS = ir.VectorType(_I16, 2 * LANES)
_BYTES = ir.VectorType(ir.IntType(8), 16)


@functools.cache
def _packed_tables(qmin: int = QMIN) -> tuple[np.ndarray, ...]:
    """Per level, its candidates in blocks of 16, lane-major (slot 16 b + l holds candidate
    l * nb + b): an int32 init key per slot and, per term, 16 (lo, hi) int16 pairs of 8 F; for
    the optimum over codes ``[qmin, 7]`` (the kernel is the same, only its tables differ)."""
    t = tables(qmin)
    srv = server_tables()
    base = np.zeros(8, dtype=np.int64)       # first block of the level
    nblk = np.zeros(8, dtype=np.int64)       # blocks of the level
    width = -(-max(len(ix) for ix in t.members.values()) // LANES) * LANES
    members = np.zeros((8, width), dtype=np.int64)
    score_unit = np.zeros(8)                 # a score integer's value in the class
    pairs, inits = [], []
    for lv in range(1, 8):
        ix = t.members[lv]
        score = class_int_scores(t.score[:, ix], lv).astype(np.int64)
        big = np.unravel_index(np.argmax(np.abs(score)), score.shape)
        score_unit[lv] = t.score[:, ix][big] / score[big]
        assert np.array_equal(score * score_unit[lv], np.where(((np.arange(16) & 7) <= lv)[:, None], t.score[:, ix], 0))
        assert 32 * np.abs(score).max() < 1 << 27
        below = np.arange(1, lv)
        assert np.array_equal(t.q[below][:, ix], -t.q[below + 8][:, ix]), "only the top magnitude is asymmetric"
        nb = -(-len(ix) // LANES)
        assert nb <= 8, "the block number must fit a key's low 3 bits"
        rows = np.zeros((TERMS, LANES * nb), dtype=np.int64)
        rows[:7, :len(ix)] = 8 * score[1:8]
        rows[7, :len(ix)] = 8 * (score[lv + 8] - score[lv])
        init = np.full(LANES * nb, PAD, dtype=np.int64)
        init[:len(ix)] = np.arange(len(ix)) % nb  # candidate k = lane * nb + b sits in block b
        slot = np.array([lane * nb + b for b in range(nb) for lane in range(LANES)])
        r = rows[:, slot].reshape(TERMS, nb, LANES).transpose(1, 0, 2)
        pair = np.stack([r % SPLIT, r // SPLIT], axis=-1)  # [block, term, lane, (lo, hi)]
        assert np.abs(pair).max() < 1 << 15
        pairs.append(pair.astype(np.int16).reshape(-1))
        inits.append(init[slot].astype(np.int32))
        base[lv] = sum(nblk)
        nblk[lv] = nb
        members[lv, :len(ix)] = ix
    nib = (t.q.T.astype(np.int16) + 8).astype(np.uint8)  # [K, 16]: q + 8 for each code
    nibs = np.ascontiguousarray(np.concatenate([nib, nib << 4], axis=1))
    return (np.concatenate(pairs), np.concatenate(inits), base, nblk, members, score_unit, nibs, t.exp, t.mant,
            np.ascontiguousarray(t.abserr.T), t.abserr.max(axis=0), np.ldexp(1.0, np.arange(256) - 127),
            np.ascontiguousarray(srv.err2[:, :8]), srv.ok, *_server_int())


SRV_UNIT = 2.0 ** -20  # the server rule's errors at unit scale are integers in these units


def _server_int() -> tuple[np.ndarray, np.ndarray]:
    """The server rule's squared errors where they are scale-invariant: ``[8, 8]`` int64 per
    (top, magnitude) in SRV_UNIT at E8M0 byte 127, and per top the first byte ``s0`` from which
    every writable row's errors are those times ``4**(s-127)`` (below, the 1e-6 floor of the
    group maximum acts). Both checked here against the absolute tables. Returned packed with
    ``(2L)^2`` in the low 32 bits of each entry, for the kernel's one dot product."""
    srv = server_tables()
    rel = srv.err2[8 * 127: 8 * 128, :8]
    ints = np.round(rel / SRV_UNIT)
    assert np.array_equal(ints * SRV_UNIT, rel) and 32 * ints.max() < 2 ** 31
    s0 = np.zeros(8, dtype=np.int64)
    for top in range(8):
        for s in range(254, -1, -1):
            row = 8 * s + top
            if srv.ok[row] and not np.array_equal(srv.err2[row, :8], rel[top] * 4.0 ** (s - 127)):
                s0[top] = s + 1
                break
    l2 = ((2 * E2M1_VALUES[:8]) ** 2).astype(np.int64)  # < 2**8: a group's sum stays below 2**32
    return (ints.astype(np.int64) << 32) | l2[None, :], s0


def _function(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _const(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _vector_at(context, builder, aryty, ary, offset, vty):
    """Pointer to a ``vty`` at element ``offset`` (an i64 value) of a C-contiguous array."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [offset]), vty.as_pointer())


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, None), value, ir.Constant(_I32, 0))
    return _pick(builder, v, [0] * vty.count)


def _pick(builder, v, indices):
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, len(indices)), list(indices)))


def _pmaddwd(builder, features, a, b):
    """``<32 x i16>`` a, b -> ``<16 x i32>`` a[2i] b[2i] + a[2i+1] b[2i+1]: x86's PMADDWD, on AVX2
    halves (LLVM joins them into AVX-512 where it can) or SSE2 quarters; portable IR elsewhere."""
    for isa, width in (("avx2", 16), ("sse2", 8)):
        if f"+{isa}" in features:
            part = ir.VectorType(_I16, width)
            fn = _function(builder, f"llvm.x86.{isa}.pmadd.wd", ir.VectorType(_I32, width // 2), [part, part])
            res = [builder.call(fn, [_pick(builder, a, range(s, s + width)), _pick(builder, b, range(s, s + width))])
                   for s in range(0, 2 * LANES, width)]
            while len(res) > 1:  # concatenate pairwise
                n = res[0].type.count
                res = [builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))
                       for x, y in zip(res[0::2], res[1::2])]
            return res[0]
    prods = []
    for start in (0, 1):
        pick = range(start, 2 * LANES, 2)
        prods.append(builder.mul(builder.sext(_pick(builder, a, pick), _KEYS),
                                 builder.sext(_pick(builder, b, pick), _KEYS)))
    return builder.add(*prods)


@intrinsic
def _best(typingctx, pairs, init, first, nb, counts):  # pragma: no cover - compiled
    """The class's first best candidate for one group: ``(score << 8) | priority index``.

    ``counts``: the TERMS counts h (module docstring); blocks ``first .. first + nb - 1``.
    """
    sig = types.int64(pairs, init, types.int64, types.int64, counts)

    def codegen(context, builder, signature, args):
        features = getattr(context.codegen(), "_tm_features", "")
        pairs_v, init_v, first_v, nb_v, counts_v = args
        mult = []  # per term, (h, SPLIT * h) in every lane's two int16
        for t in range(TERMS):
            h = builder.extract_value(counts_v, t)
            h = builder.trunc(h, _I32) if h.type.width > 32 else h
            m = builder.or_(h, builder.shl(builder.mul(h, ir.Constant(_I32, SPLIT)), ir.Constant(_I32, 16)))
            mult.append(builder.bitcast(_splat(builder, m, _KEYS), _PAIRS))
        best = cgutils.alloca_once_value(builder, ir.Constant(_KEYS, [0x7FFFFFFF] * LANES))
        smin = _function(builder, "llvm.smin.v16i32", _KEYS, [_KEYS, _KEYS])
        with cgutils.for_range(builder, nb_v) as loop:
            blk = builder.add(first_v, loop.index)
            key = builder.load(_vector_at(context, builder, signature.args[1], init_v,
                                          builder.mul(blk, _const(LANES)), _KEYS), align=4)
            row = builder.mul(blk, _const(TERMS * 2 * LANES))
            for t in range(TERMS):
                w = builder.load(_vector_at(context, builder, signature.args[0], pairs_v,
                                            builder.add(row, _const(t * 2 * LANES)), _PAIRS), align=2)
                key = builder.add(key, _pmaddwd(builder, features, w, mult[t]))
            builder.store(builder.call(smin, [builder.load(best), key]), best)
        keys = builder.load(best)
        score = builder.ashr(keys, ir.Constant(_KEYS, [3] * LANES))
        low = builder.call(_function(builder, "llvm.vector.reduce.smin.v16i32", _I32, [_KEYS]), [score])
        mask = builder.bitcast(builder.icmp_signed("==", score, _splat(builder, low, _KEYS)), _I16)
        lane = builder.call(_function(builder, "llvm.cttz.i16", _I16, [_I16, ir.IntType(1)]),
                            [mask, ir.Constant(ir.IntType(1), 1)])
        lane = builder.zext(lane, _I64)
        blkno = builder.zext(builder.and_(builder.extract_element(keys, lane), ir.Constant(_I32, 7)), _I64)
        index = builder.add(builder.mul(lane, nb_v), blkno)
        return builder.or_(builder.shl(builder.sext(low, _I64), ir.Constant(_I64, 8)), index)

    return sig, codegen


@intrinsic
def _write_bytes(typingctx, packed, out, g, nibs, k):  # pragma: no cover - compiled
    """``out[g] = nibs[k, low nibbles] | nibs[k, 16 + high nibbles]`` for the group's 16 bytes."""
    sig = types.void(packed, out, types.int64, nibs, types.int64)

    def codegen(context, builder, signature, args):
        features = getattr(context.codegen(), "_tm_features", "")
        packed_v, out_v, g_v, nibs_v, k_v = args
        row = builder.mul(g_v, _const(16))
        src = builder.load(_vector_at(context, builder, signature.args[0], packed_v, row, _BYTES), align=1)
        tabs = [builder.load(_vector_at(context, builder, signature.args[3], nibs_v,
                                        builder.add(builder.mul(k_v, _const(32)), _const(half)), _BYTES), align=1)
                for half in (0, 16)]
        fifteen = ir.Constant(_BYTES, [15] * 16)
        codes = [builder.and_(src, fifteen), builder.and_(builder.lshr(src, ir.Constant(_BYTES, [4] * 16)), fifteen)]
        if "+ssse3" in features:
            fn = _function(builder, "llvm.x86.ssse3.pshuf.b.128", _BYTES, [_BYTES, _BYTES])
            res = builder.or_(builder.call(fn, [tabs[0], codes[0]]), builder.call(fn, [tabs[1], codes[1]]))
        else:
            res = ir.Constant(_BYTES, None)
            for i in range(16):
                at = ir.Constant(_I32, i)
                lo, hi = (builder.extract_element(tab, builder.extract_element(c, at)) for tab, c in zip(tabs, codes))
                res = builder.insert_element(res, builder.or_(lo, hi), at)
        builder.store(res, _vector_at(context, builder, signature.args[1], out_v, row, _BYTES), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _popcount(typingctx, x):  # pragma: no cover - compiled
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.call(_function(builder, "llvm.ctpop.i64", _I64, [_I64]), [args[0]])

    return sig, codegen


@numba.njit(inline="always")
def _counts(x, y):  # pragma: no cover - compiled
    """A group's (two words') counts of |code| 1..7, of its top magnitude's negative codes, and
    that top magnitude (0: all zero), by bit planes: code bit i of every nibble at bit 0 of the
    nibble for word x, at bit 1 for word y."""
    m = np.uint64(0x1111111111111111)
    both = np.uint64(0x3333333333333333)
    one = np.uint64(1)
    p0 = (x & m) | ((y & m) << one)
    p1 = ((x >> one) & m) | (((y >> one) & m) << one)
    p2 = ((x >> np.uint64(2)) & m) | (((y >> np.uint64(2)) & m) << one)
    p3 = ((x >> np.uint64(3)) & m) | (((y >> np.uint64(3)) & m) << one)
    n0, n1, n2 = p0 ^ both, p1 ^ both, p2 ^ both
    q0, q1, q2, q3 = n1 & n2, p1 & n2, n1 & p2, p1 & p2
    m1, m2, m3, m4, m5, m6, m7 = p0 & q0, n0 & q1, p0 & q1, n0 & q2, p0 & q2, n0 & q3, p0 & q3
    h1, h2, h3, h4 = _popcount(m1), _popcount(m2), _popcount(m3), _popcount(m4)
    h5, h6, h7 = _popcount(m5), _popcount(m6), _popcount(m7)
    level, top = 0, np.uint64(0)
    if h1 > 0:
        level, top = 1, m1
    if h2 > 0:
        level, top = 2, m2
    if h3 > 0:
        level, top = 3, m3
    if h4 > 0:
        level, top = 4, m4
    if h5 > 0:
        level, top = 5, m5
    if h6 > 0:
        level, top = 6, m6
    if h7 > 0:
        level, top = 7, m7
    return h1, h2, h3, h4, h5, h6, h7, _popcount(top & p3), level


@numba.njit(cache=True, nogil=True)
def _chunk(words, packed, scales, out, out_scale, lo, hi, pairs, init, base, nblk, members, score_unit, nibs, exp, mant,
           abserr_t, maxabs, units, srv_err2, srv_ok, srv_pack, srv_s0, res):  # pragma: no cover - compiled
    """Groups lo..hi-1: bytes, scales, and the statistics into res (res[5]: the server rule's
    squared error on the same groups, from its tables: server_rule.py)."""
    e2 = 0.0
    se2 = 0.0
    r2 = 0.0
    mx = 0.0
    nan = 0
    bad = 0
    best = np.empty(SUB, dtype=np.int64)
    low = np.empty(SUB, dtype=np.int64)
    hs = np.empty((SUB, 9), dtype=np.int64)  # level, h1..h7, h_top-
    for run in range(lo, hi, SUB):
        end = min(hi, run + SUB)
        for g in range(run, end):
            h1, h2, h3, h4, h5, h6, h7, hn, level = _counts(words[g, 0], words[g, 1])
            i = g - run
            best[i] = 0
            low[i] = 0
            if level > 0:
                key = _best(pairs, init, base[level], nblk[level], (h1, h2, h3, h4, h5, h6, h7, hn))
                low[i] = key >> 8
                best[i] = members[level, key & 255]
            hs[i, 0] = level
            hs[i, 1] = h1
            hs[i, 2] = h2
            hs[i, 3] = h3
            hs[i, 4] = h4
            hs[i, 5] = h5
            hs[i, 6] = h6
            hs[i, 7] = h7
            hs[i, 8] = hn
        for g in range(run, end):
            i = g - run
            kg = best[i]
            _write_bytes(packed, out, g, nibs, kg)
            s = np.int64(scales[g])
            level = hs[i, 0]
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
            u = units[s]
            # one integer dot gives both sum h (2L)^2 (low 32 bits) and the server rule's error in
            # SRV_UNIT (high bits; exact where s >= srv_s0, see _server_int): the comparison is free
            pk = srv_pack[level]
            acc = 0
            for c in range(1, 8):
                acc += hs[i, c] * pk[c]
            ref = acc & 0xFFFFFFFF
            srow = 8 * s + level
            if not srv_ok[srow]:
                se2 = math.inf
            elif s >= srv_s0[level]:
                se2 += (acc >> 32) * (u * u * SRV_UNIT)
            else:  # the group's maximum is below the rule's 1e-6 floor: absolute errors
                e = srv_err2[srow]
                for c in range(1, level + 1):
                    se2 += hs[i, c] * e[c]
            gr = ref * 0.25
            ge = low[i] * score_unit[level] + gr  # error = ranking score + sum h L^2, both exact
            e2 += ge * u * u
            r2 += gr * u * u
            if maxabs[kg] * u > mx:  # only then can the group raise the maximum
                hn = hs[i, 8]
                ga = abserr_t[kg, level + 8] if hn > 0 else 0.0
                for c in range(1, level + 1):
                    if hs[i, c] - (hn if c == level else 0) > 0:
                        ga = max(ga, abserr_t[kg, c])
                mx = max(mx, ga * u)
    res[0] = e2
    res[1] = r2
    res[2] = mx
    res[3] = nan
    res[4] = bad
    res[5] = se2


@numba.njit(parallel=True, cache=True, nogil=True)
def _run(words, packed, scales, out, out_scale, partial, pairs, init, base, nblk, members, score_unit, nibs, exp, mant,
         abserr_t, maxabs, units, srv_err2, srv_ok, srv_pack, srv_s0):  # pragma: no cover - compiled
    n = packed.shape[0]
    for ci in numba.prange((n + CHUNK - 1) // CHUNK):
        _chunk(words, packed, scales, out, out_scale, ci * CHUNK, min(n, (ci + 1) * CHUNK), pairs, init, base, nblk,
               members, score_unit, nibs, exp, mant, abserr_t, maxabs, units, srv_err2, srv_ok, srv_pack, srv_s0,
               partial[ci])


def requantize(packed: torch.Tensor, scales: torch.Tensor, offsets: list[int] | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None, qmin: int = QMIN) -> Result:
    """Same contract and bytes as ``requant.requantize``, for CPU tensors, much faster.

    ``out``: (uint8 [G, 16], bf16 [G]) buffers to write into, e.g. reused ones. ``qmin``: the
    lowest code, -8 (``optimal``) or -7 (``optimal-pm7``).
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or packed.dim() != 2 \
            or packed.shape[1] != 16 or scales.shape != packed.shape[:1]:
        raise ValueError("expected uint8 packed [G, 16] and scales [G], "
                         f"got {tuple(packed.shape)}, {tuple(scales.shape)}")
    offsets = list(offsets) if offsets is not None else [0, packed.shape[0]]
    p, s = np.ascontiguousarray(packed.numpy()), scales.numpy()
    if out is None:
        out = (torch.empty_like(packed, memory_format=torch.contiguous_format),
               torch.empty(scales.shape, dtype=torch.bfloat16))
    result_packed, result_scales = out
    o = result_packed.numpy()
    direct = o.flags.c_contiguous  # the byte writes address rows of 16 contiguous bytes
    if not direct:
        o = np.empty(o.shape, dtype=np.uint8)
    out_scale = result_scales.view(torch.int16).numpy()
    words = p.view(np.uint64)
    stats = np.zeros((len(offsets) - 1, len(STAT_FIELDS) + 1))  # + the server rule's err2
    tabs = _packed_tables(qmin)
    for ti, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        if hi == lo:
            continue
        partial = np.zeros(((hi - lo + CHUNK - 1) // CHUNK, stats.shape[1]))
        _run(words[lo:hi], p[lo:hi], s[lo:hi], o[lo:hi], out_scale[lo:hi], partial, *tabs)
        stats[ti] = partial.sum(0)
        stats[ti, 2] = partial[:, 2].max()
    if not direct:
        result_packed.copy_(torch.from_numpy(o))
    return Result(result_packed, result_scales, torch.from_numpy(stats[:, :-1].copy()),
                  server_err2=torch.from_numpy(stats[:, -1].copy()))


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
            unit = math.ldexp(1.0, np.int64(scales[g]) - 127)  # type: ignore[arg-type]  # numba: an int64 is its int
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
    return num, den  # summed by the caller: an array sum here would be split over the threads


@numba.njit(parallel=True, cache=True, nogil=True)
def _matvec_errors2(packed, scales, out, out_scale, out2, out_scale2, cols, x, lut):  # pragma: no cover - compiled
    """``_matvec_error`` for two int4 encodings of one matrix in one pass: W x (the MXFP4
    reference) is computed once, not once per encoding; every sum in the same order as there,
    so each figure is bit-identical to ``_matvec_error``'s."""
    gpr = cols // 32
    rows = packed.shape[0] // gpr
    num = np.zeros(rows)
    num2 = np.zeros(rows)
    den = np.zeros(rows)
    for r in numba.prange(rows):
        y = 0.0
        yq = 0.0
        yq2 = 0.0
        for gi in range(gpr):
            g = r * gpr + gi
            unit = math.ldexp(1.0, np.int64(scales[g]) - 127)  # type: ignore[arg-type]  # numba: an int64 is its int
            acc = 0.0
            accq = 0.0
            accq2 = 0.0
            for j in range(16):
                b = packed[g, j]
                o = out[g, j]
                o2 = out2[g, j]
                x0 = x[gi * 32 + 2 * j]
                x1 = x[gi * 32 + 2 * j + 1]
                acc += lut[b & 15] * x0 + lut[b >> 4] * x1
                accq += ((o & 15) - 8.0) * x0 + ((o >> 4) - 8.0) * x1
                accq2 += ((o2 & 15) - 8.0) * x0 + ((o2 >> 4) - 8.0) * x1
            y += acc * unit
            yq += accq * out_scale[g]
            yq2 += accq2 * out_scale2[g]
        num[r] = (yq - y) ** 2
        num2[r] = (yq2 - y) ** 2
        den[r] = y * y
    return num, num2, den


def _ratio(rows_num: np.ndarray, rows_den: np.ndarray) -> float:
    # summed exactly, so the figure does not depend on how many threads computed the rows
    num, den = math.sqrt(math.fsum(rows_num.tolist())), math.sqrt(math.fsum(rows_den.tolist()))
    return num / den if den > 0 else 0.0


def output_errors(packed: torch.Tensor, scales: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor],
                  other: tuple[torch.Tensor, torch.Tensor] | None, cols: int, x: torch.Tensor
                  ) -> tuple[float, float | None]:
    """``output_error`` of our int4 ``out`` (words, scales) and, if given, of the other rule's
    ``other``, sharing one pass over the MXFP4 weights (the sample stage's cost on the CPU)."""
    if other is None:
        return output_error(packed, scales, out[0], out[1], cols, x), None
    num, num2, den = _matvec_errors2(packed.numpy(), scales.numpy(), out[0].numpy(), out[1].double().numpy(),
                                     other[0].numpy(), other[1].double().numpy(), cols, x.double().numpy(),
                                     E2M1_VALUES)
    return _ratio(num, den), _ratio(num2, den)


def output_error(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, out_scales: torch.Tensor,
                 cols: int, x: torch.Tensor) -> float:
    """||(W_int4 - W) x|| / ||W x|| for one matrix given as groups, without decoding it whole."""
    rows_num, rows_den = _matvec_error(packed.numpy(), scales.numpy(), out.numpy(), out_scales.double().numpy(),
                                       cols, x.double().numpy(), E2M1_VALUES)
    return _ratio(rows_num, rows_den)


@functools.cache
def _server_tables() -> tuple[np.ndarray, ...]:
    """The server rule's tables (server_rule.py) shaped for the kernel: per row ``8 s + top``
    the two nibble shuffles, the scale bits, and per magnitude 0..7 (both signs alike) the
    squared and absolute error, plus each row's largest absolute error."""
    t = server_tables()
    assert np.array_equal(t.q[:, 1:8], -t.q[:, 9:16]), "the server rule is symmetric"
    nibs = np.ascontiguousarray(np.concatenate([t.nib, t.nib << 4], axis=1))
    return (nibs, t.bits, t.ok, np.ascontiguousarray(t.err2[:, :8]), np.ascontiguousarray(t.abserr[:, :8]),
            t.abserr.max(axis=1), ((2 * E2M1_VALUES[:8]) ** 2).astype(np.int32), np.ldexp(1.0, np.arange(256) - 127))


@numba.njit(parallel=True, cache=True, nogil=True)
def _server_run(words, packed, scales, out, out_scale, partial, nibs, bits, ok, err2m, abserrm, amax_row, l2sq,
                units):  # pragma: no cover - compiled
    n = packed.shape[0]
    for ci in numba.prange((n + CHUNK - 1) // CHUNK):
        e2 = 0.0
        r2 = 0.0
        mx = 0.0
        nan = 0
        bad = 0
        for g in range(ci * CHUNK, min(n, (ci + 1) * CHUNK)):
            h1, h2, h3, h4, h5, h6, h7, hn, level = _counts(words[g, 0], words[g, 1])
            s = np.int64(scales[g])
            row = 8 * s + level
            if s == 255:
                nan += 1
                row = 0
            _write_bytes(packed, out, g, nibs, row)
            if s == 255 or not ok[row]:
                bad += s != 255
                out_scale[g] = 0
                continue
            out_scale[g] = bits[row]
            e = err2m[row]
            # a tree, not a chain: the groups' sums overlap in the pipeline
            e2 += ((h1 * e[1] + h2 * e[2]) + (h3 * e[3] + h4 * e[4])) + ((h5 * e[5] + h6 * e[6]) + h7 * e[7])
            ref = h1 * l2sq[1] + h2 * l2sq[2] + h3 * l2sq[3] + h4 * l2sq[4] + h5 * l2sq[5] + h6 * l2sq[6] + \
                h7 * l2sq[7]
            u = units[s]
            r2 += ref * 0.25 * u * u
            if amax_row[row] > mx:  # only then can the group raise the maximum
                a = abserrm[row]
                hs = (0, h1, h2, h3, h4, h5, h6, h7)
                for c in range(1, level + 1):
                    if hs[c] > 0:
                        mx = max(mx, a[c])
        partial[ci, 0] = e2
        partial[ci, 1] = r2
        partial[ci, 2] = mx
        partial[ci, 3] = nan
        partial[ci, 4] = bad


def server_requantize(packed: torch.Tensor, scales: torch.Tensor, offsets: list[int] | None = None,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None) -> Result:
    """The server's load-time rule (``--scale-rule vllm-gfx942``): same contract and bytes as
    ``server_rule.requantize``, table lookups only (a NaN or out-of-range group's bytes are
    meaningless: its tensor is refused, and its figures left out)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or packed.dim() != 2 \
            or packed.shape[1] != 16 or scales.shape != packed.shape[:1]:
        raise ValueError("expected uint8 packed [G, 16] and scales [G], "
                         f"got {tuple(packed.shape)}, {tuple(scales.shape)}")
    offsets = list(offsets) if offsets is not None else [0, packed.shape[0]]
    if out is None:
        out = (torch.empty_like(packed, memory_format=torch.contiguous_format),
               torch.empty(scales.shape, dtype=torch.bfloat16))
    p, s = np.ascontiguousarray(packed.numpy()), scales.numpy()
    o, out_scale = out[0].numpy(), out[1].view(torch.int16).numpy()
    direct = o.flags.c_contiguous  # the byte writes address rows of 16 contiguous bytes
    if not direct:
        o = np.empty(o.shape, dtype=np.uint8)
    words = p.view(np.uint64)
    tabs = _server_tables()
    stats = np.zeros((len(offsets) - 1, len(STAT_FIELDS)))
    for ti, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        if hi == lo:
            continue
        partial = np.zeros(((hi - lo + CHUNK - 1) // CHUNK, len(STAT_FIELDS)))
        _server_run(words[lo:hi], p[lo:hi], s[lo:hi], o[lo:hi], out_scale[lo:hi], partial, *tabs)
        stats[ti] = partial.sum(0)
        stats[ti, 2] = partial[:, 2].max()
    if not direct:
        out[0].copy_(torch.from_numpy(o))
    return Result(out[0], out[1], torch.from_numpy(stats))
