"""The plugin's load-time layout in one Triton pass: compressed-tensors int4 words -> aiter's packed int4.

Same bytes as ``layout.weights_to_aiter`` / ``layout.scales_to_aiter`` (aiter's ``shuffle_weight(x, (16, 16))``
+ ``pack_int8_to_packed_int4`` + ``shuffle_scale_for_int4``), but one kernel reading and writing each word
once (then a copy back, below) instead of several torch passes over one-byte codes. Why it is a
word-to-word map:

* the (16, 16) shuffle moves row r (of a 16-row block) and codes [16h, 16h + 16) of a 32-code tile to
  output slot ``(h, r)`` of that tile; the 8 codes of one CT word ``j = 2h + m`` stay together, so word
  ``(row, k0 * 4 + j)`` lands whole at word ``(n0 * K/32 + k0) * 64 + h * 32 + r * 2 + m``;
* inside the word, ``pack_int8_to_packed_int4`` stores byte ``b = v_b | v_{b+4} << 4`` (two's-complement
  nibbles) where CT stores nibble ``i = v_i + 8``: an outer perfect shuffle of nibbles, then ``^ 0x8``
  on each nibble (so code -8, CT nibble 0, becomes 0x8, and code 0 becomes 0x0).

Scales: bf16 ``[E, N, G]`` viewed as int32 pairs ``[E, N, G/2]`` -> ``[E, G/2, N]`` (a transpose per expert),
in the same launch. The output overwrites the input (vLLM keeps one copy of a layer), so each chunk of
experts is laid out into a bounded scratch and copied back: transient memory is one chunk.
Plain Triton (integer ops, no inline asm, no libdevice): it builds for NVIDIA and AMD gfx942 alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .route import GROUP, SHUFFLE_N

CHUNK_BYTES = 128 << 20   # scratch per chunk of experts: the transient memory of a layout (measured: BENCHMARKS.md)
TILE = tl.constexpr(64)   # words in one 16 x 32 tile of codes (256 bytes)
ROWS = tl.constexpr(SHUFFLE_N)
FLIP = tl.constexpr(-0x77777778)  # 0x88888888 as int32: CT's q + 8 -> two's complement, every nibble


@triton.jit
def _words_tile(w_ptr, ow_ptr, pid, KW, KT, NKB, BT: tl.constexpr):
    """One 16-row block x BT tiles along K: CT words -> packed, shuffled words."""
    n0 = pid // NKB
    kt = (pid % NKB) * BT + tl.arange(0, BT)                  # tiles along K
    w = tl.arange(0, TILE)                                     # output word in a tile: (h, r, m)
    h = w // 32
    r = (w // 2) % ROWS
    m = w % 2
    row0 = n0.to(tl.int64) * ROWS * KW                         # first word of the 16-row block
    src = row0 + (r * KW + 2 * h + m)[None, :] + (kt * 4)[:, None]
    ok = (kt < KT)[:, None] & (w < TILE)[None, :]
    x = tl.load(w_ptr + src, mask=ok, other=0)
    # nibbles a0 a1 a2 a3 b0 b1 b2 b3 -> a0 b0 a1 b1 a2 b2 a3 b3 (low nibble first): swap the middle
    # bytes, then the middle nibbles of each half word
    t = (x ^ (x >> 8)) & 0x0000FF00
    x = x ^ t ^ (t << 8)
    t = (x ^ (x >> 4)) & 0x00F000F0
    x = x ^ t ^ (t << 4)
    x = x ^ FLIP
    dst = n0.to(tl.int64) * KT * TILE + (kt * TILE)[:, None] + w[None, :]
    tl.store(ow_ptr + dst, x, mask=ok)


@triton.jit
def _scales_tile(s_ptr, os_ptr, sp, N, G2, NNB, NGB, BN: tl.constexpr, BG: tl.constexpr):
    """One BN x BG tile of one expert's scale pairs: [N, G/2] -> [G/2, N]."""
    e = sp // (NNB * NGB)
    nb = (sp // NGB) % NNB
    gb = sp % NGB
    n = nb * BN + tl.arange(0, BN)
    g = gb * BG + tl.arange(0, BG)
    ok = (n < N)[:, None] & (g < G2)[None, :]
    base = e.to(tl.int64) * N * G2
    v = tl.load(s_ptr + base + n[:, None] * G2 + g[None, :], mask=ok, other=0)
    tl.store(os_ptr + base + g[None, :] * N + n[:, None], v, mask=ok)


@triton.jit
def _layout_kernel(w_ptr, s_ptr, ow_ptr, os_ptr, KW, KT, NKB, W_PROGRAMS, N, G2, NNB, NGB,
                   BT: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr):
    """Programs [0, W_PROGRAMS) lay out words, the rest scales: one launch per chunk."""
    pid = tl.program_id(0)
    if pid < W_PROGRAMS:
        _words_tile(w_ptr, ow_ptr, pid, KW, KT, NKB, BT)
    else:
        _scales_tile(s_ptr, os_ptr, pid - W_PROGRAMS, N, G2, NNB, NGB, BN, BG)


def _pow2_at_most(n: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(max(n, 1)))


def launch_shape(n_rows: int, kw: int, experts: int, n: int, g2: int) -> dict:
    """Grid and block sizes for ``n_rows`` rows of ``kw`` words and ``experts`` x [n, g2] scale words."""
    kt = kw // 4
    bt = _pow2_at_most(kt, 32)                     # 8 KB of words a program at most
    bg = _pow2_at_most(g2, 64)
    bn = max(16, 2048 // bg)
    nkb, nnb, ngb = triton.cdiv(kt, bt), triton.cdiv(n, bn), triton.cdiv(g2, bg)
    w_programs = (n_rows // SHUFFLE_N) * nkb
    return {"KT": kt, "NKB": nkb, "W_PROGRAMS": w_programs, "NNB": nnb, "NGB": ngb,
            "BT": bt, "BN": bn, "BG": bg, "grid": w_programs + experts * nnb * ngb}


def layout_chunk(words: torch.Tensor, scale_words: torch.Tensor, out_w: torch.Tensor, out_s: torch.Tensor,
                 shape: dict | None = None) -> None:
    """One launch: int32 words [c, N, K/8] and scale pairs (bf16 scales viewed int32) [c, N, G/2] -> aiter's
    layout in out_w and out_s (int32, the inputs' sizes). Out of place: the outputs must not overlap them."""
    c, n, kw = words.shape
    shape = shape or launch_shape(c * n, kw, c, n, scale_words.shape[-1])
    _layout_kernel[(shape["grid"],)](words, scale_words, out_w, out_s, kw, shape["KT"], shape["NKB"],
                                     shape["W_PROGRAMS"], n, scale_words.shape[-1], shape["NNB"], shape["NGB"],
                                     BT=shape["BT"], BN=shape["BN"], BG=shape["BG"], num_warps=4, num_stages=1)


def check_shapes(words: torch.Tensor, scales: torch.Tensor) -> None:
    """The layout's preconditions, as a ValueError naming the shapes (the torch path's view() would fail)."""
    if words.dim() != 3 or words.dtype != torch.int32 or scales.dim() != 3 or scales.dtype != torch.bfloat16:
        raise ValueError(f"expected int32 words [E, N, K/8] and bf16 scales [E, N, G], got "
                         f"{words.dtype} {tuple(words.shape)} and {scales.dtype} {tuple(scales.shape)}")
    e, n, kw = words.shape
    if (scales.shape[:2] != (e, n) or scales.shape[2] * GROUP != kw * 8 or n % SHUFFLE_N or kw % 4
            or scales.shape[2] % 2 or not words.is_contiguous() or not scales.is_contiguous()):
        raise ValueError(f"words {tuple(words.shape)} and scales {tuple(scales.shape)}: need contiguous tensors, "
                         f"N a multiple of {SHUFFLE_N}, K a multiple of 64, one scale per {GROUP} codes")


def convert_experts_(words: torch.Tensor, scales: torch.Tensor,
                     chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``layout.convert_experts_`` on the GPU (or the Triton interpreter): same contract, same bytes.

    ``chunk`` experts are laid out into a scratch and copied back over their words; by default as many
    as fit CHUNK_BYTES (at least one), so transient memory stays one scratch whatever the split.
    """
    check_shapes(words, scales)
    e, n, kw = words.shape
    g2 = scales.shape[-1] // 2
    per_expert = n * kw * 4 + n * g2 * 4
    chunk = max(1, min(e, chunk if chunk else CHUNK_BYTES // per_expert))
    scratch_w = torch.empty((chunk, n, kw), dtype=torch.int32, device=words.device)
    scratch_s = torch.empty((chunk, g2, n), dtype=torch.int32, device=words.device)
    scale_words = scales.view(torch.int32)                  # two adjacent groups of a row = one int32
    full = launch_shape(chunk * n, kw, chunk, n, g2)        # every chunk but perhaps the last
    for lo in range(0, e, chunk):
        hi = min(lo + chunk, e)
        c = hi - lo
        layout_chunk(words[lo:hi], scale_words[lo:hi], scratch_w, scratch_s,
                     full if c == chunk else launch_shape(c * n, kw, c, n, g2))
        words[lo:hi].copy_(scratch_w[:c])
        scale_words[lo:hi].copy_(scratch_s[:c].view(c, n, g2))   # same words in [G/2, N] order
    return words.view(torch.uint8).view(e, n, kw * 4), scales.view(-1)
