"""The server's load-time int4 rule on the GPU (Triton): ``--scale-rule vllm-gfx942``.

Same contract and bytes as ``converter.quant.server_rule.requantize``: per group the row
``8 * s + top`` of the rule's tables (built once on the host by running the server's own
ops), then table lookups for the bytes, the scale bits and the statistics. Memory-bound
(17 bytes in, 18 out a group), so it doubles as the cheap extra pass that gives the
``optimal`` run the server rule's error figures. Plain Triton (no inline asm, no libdevice):
it builds for NVIDIA and for AMD gfx942 alike.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from converter.quant.requant import STAT_FIELDS, Result
from converter.quant.server_rule import torch_server_tables

from .triton_requant import _flush

BLOCK = 128  # groups a block


@triton.jit
def _server_kernel(bytes_ptr, scales_ptr, out_ptr, oscale_ptr, stats_ptr, stats_i_ptr, blk_tid_ptr, offsets_ptr,
                   nib_ptr, bits_ptr, ok_ptr, err2_ptr, abserr_ptr, ref2_ptr, G, BG: tl.constexpr):
    blk = tl.program_id(0)
    rows = blk * BG + tl.arange(0, BG)
    valid = rows < G
    rows64 = rows.to(tl.int64)
    c16 = tl.arange(0, 16)
    boff = rows64[:, None] * 16 + c16[None, :]
    b = tl.load(bytes_ptr + boff, mask=valid[:, None], other=0).to(tl.int32)
    lo = b & 15
    hi = b >> 4
    top = tl.max(tl.maximum(lo & 7, hi & 7), axis=1)
    s = tl.load(scales_ptr + rows64, mask=valid, other=0).to(tl.int32)
    nan = s == 255
    row = tl.where(nan, 0, 8 * s + top)
    ok = tl.load(ok_ptr + row) != 0
    bad = (nan == 0) & (ok == 0)
    keep = valid & ok & (nan == 0)
    t0 = row[:, None] * 16
    ob = tl.load(nib_ptr + t0 + lo) | (tl.load(nib_ptr + t0 + hi) << 4)
    tl.store(out_ptr + boff, ob, mask=valid[:, None])
    sb = tl.where(keep, tl.load(bits_ptr + row).to(tl.int32), 0)
    tl.store(oscale_ptr + rows64, sb.to(tl.int16), mask=valid)

    e = tl.sum(tl.load(err2_ptr + t0 + lo) + tl.load(err2_ptr + t0 + hi), axis=1)
    r = tl.sum(tl.load(ref2_ptr + t0 + lo) + tl.load(ref2_ptr + t0 + hi), axis=1)
    m = tl.max(tl.maximum(tl.load(abserr_ptr + t0 + lo), tl.load(abserr_ptr + t0 + hi)), axis=1)
    e = tl.where(keep, e, 0.0)
    r = tl.where(keep, r, 0.0)
    m = tl.where(keep, m, 0.0)
    n = (nan & valid).to(tl.int32)
    bd = (bad & valid).to(tl.int32)
    ta = tl.load(blk_tid_ptr + 2 * blk)
    tb = tl.load(blk_tid_ptr + 2 * blk + 1)
    if ta == tb:
        _flush(stats_ptr, stats_i_ptr, ta, e, r, m, n, bd)
    else:  # the block straddles tensors: each row's tensor, flushed per tensor
        tid = tl.full([BG], 0, tl.int32) + ta
        for tt in range(ta + 1, tb + 1):
            tid += (rows64 >= tl.load(offsets_ptr + tt)).to(tl.int32)
        for tt in range(ta, tb + 1):
            sel = (tid == tt) & valid
            _flush(stats_ptr, stats_i_ptr, tt, tl.where(sel, e, 0.0), tl.where(sel, r, 0.0), tl.where(sel, m, 0.0),
                   (sel & (n != 0)).to(tl.int32), (sel & (bd != 0)).to(tl.int32))


def requantize(packed: torch.Tensor, scales: torch.Tensor, offsets: list[int] | torch.Tensor | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> Result:
    """The server's rule on ``G`` groups on ``packed.device`` (CUDA, ROCm, or the interpreter)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or packed.dim() != 2 \
            or packed.shape[1] != 16 or scales.shape != packed.shape[:1]:
        raise ValueError("expected uint8 packed [G, 16] and scales [G], "
                         f"got {tuple(packed.shape)}, {tuple(scales.shape)}")
    device, g = packed.device, packed.shape[0]
    offs = [0, g] if offsets is None else [int(x) for x in (
        offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]
    res_p = torch.empty_like(packed) if out is None else out[0]
    res_s = torch.empty(g, dtype=torch.int16, device=device) if out is None else out[1].view(torch.int16)
    stats = torch.zeros(len(offs) - 1, len(STAT_FIELDS), dtype=torch.float64, device=device)
    result = Result(res_p, res_s.view(torch.bfloat16), stats)
    if g == 0:
        return result
    off = torch.tensor(offs, dtype=torch.int64, device=device)
    nblk = math.ceil(g / BLOCK)
    starts = torch.arange(nblk, dtype=torch.int64, device=device) * BLOCK
    ends = torch.clamp(starts + BLOCK, max=g) - 1
    blk_tid = torch.stack([torch.searchsorted(off, starts, right=True) - 1,
                           torch.searchsorted(off, ends, right=True) - 1], dim=1).to(torch.int32).contiguous()
    t = torch_server_tables(str(device))
    _server_kernel[(nblk,)](packed.contiguous(), scales.contiguous(), res_p, res_s, stats, stats.view(torch.int64),
                            blk_tid, off, t["nib"], t["bits"], t["ok8"], t["err2"], t["abserr"], t["ref2"], g, BG=BLOCK)
    return result
