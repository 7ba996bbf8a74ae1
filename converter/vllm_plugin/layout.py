"""k3convert int4 experts -> the layout AITER's packed-int4 a16w4 MoE kernel reads.

On a GPU ``convert_experts_`` runs one fused Triton pass (``layout_kernel``); the torch functions here
are the CPU path, the readable statement of the layout, and what the load-time probe compares with aiter.

Integer permutations only: no value is dequantized or requantized. The target is what vLLM's
load-time path (`quantization/mxfp4.py` `_setup_kernel_k3_situ_gfx942`) hands aiter on gfx942:
  weight: signed int4 codes [E, N, K] -> aiter `shuffle_weight(x, (16, 16))` on one int8 per code
          -> `pack_int8_to_packed_int4` (8 codes v0..v7 -> bytes v_j & 0xF | v_{j+4} << 4) -> [E, N, K/2];
  scale:  bf16 [E, G, N] -> `shuffle_scale_for_int4` -> [E, G/2, N, 2], flattened.
Our checkpoint holds compressed-tensors words (int32 [E, N, K/8], nibble k%8 of word k//8 = q+8) and
bf16 scales [E, N, G], as vLLM's WNA16 MoE loader shards them (N-first).
"""
from __future__ import annotations

import torch

from .route import GROUP, SHUFFLE_N  # the size rules are route's (torch-free)

SHUFFLE_K = 32   # codes per tile row: BK = 2 * IK for one-byte elements
CHUNK_EXPERTS = 4
ZERO_WORD = -0x77777778   # 0x88888888 as int32: eight nibbles 8, i.e. eight codes 0


def ct_words_to_codes(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., N, K/8] compressed-tensors words -> int8 [..., N, K] codes in [-8, 7]."""
    nib = words.contiguous().view(torch.uint8)          # little-endian: byte b = nibbles 2b, 2b+1
    codes = torch.stack((nib & 15, nib >> 4), dim=-1)   # [..., N, K/2, 2]
    return (codes.view(*words.shape[:-1], words.shape[-1] * 8).to(torch.int8) - 8)


def shuffle_16x16(codes: torch.Tensor) -> torch.Tensor:
    """aiter's (16, 16) preshuffle of one-byte values [..., N, K] (the same view/permute)."""
    *lead, n, k = codes.shape
    x = codes.reshape(-1, n // SHUFFLE_N, SHUFFLE_N, k // SHUFFLE_K, 2, 16)
    return x.permute(0, 1, 3, 4, 2, 5).contiguous().view(*lead, n, k)


def pack_i4x2(shuffled: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., N, K] -> uint8 [..., N, K/2]: per 8 codes, byte j = v_j & 0xF | (v_{j+4} & 0xF) << 4."""
    *lead, n, k = shuffled.shape
    u = (shuffled.view(torch.uint8) & 15).reshape(-1, 2, 4)   # [blocks, (v0..3 | v4..7), 4]
    return (u[:, 0] | (u[:, 1] << 4)).reshape(*lead, n, k // 2)


def weights_to_aiter(words: torch.Tensor) -> torch.Tensor:
    """int32 CT words [E, N, K/8] -> packed shuffled int4 bytes (uint8) [E, N, K/2]."""
    return pack_i4x2(shuffle_16x16(ct_words_to_codes(words)))


def scales_to_aiter(scales: torch.Tensor) -> torch.Tensor:
    """bf16 [E, N, G] (checkpoint order) -> bf16 [E, G/2, N, 2]: two adjacent groups of a row per dword."""
    e, n, g = scales.shape
    return scales.view(e, n, g // 2, 2).permute(0, 2, 1, 3).contiguous()


def convert_experts_(words: torch.Tensor, scales: torch.Tensor,
                     chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay out all of a layer's experts IN PLACE, `chunk` experts at a time.

    Each expert's packed bytes take exactly its words' storage (N * K/2 bytes) and the layout never
    crosses experts, so the result overwrites the source: transient memory is one chunk. Returns views
    of the same storage: (uint8 [E, N, K/2], bf16 flat [E * G/2 * N * 2]), the shapes the load-time
    path leaves. `words` [E, N, K/8] int32 and `scales` [E, N, G] must be contiguous. On a GPU this is
    layout_kernel's one Triton pass (chunk default: 128 MiB of experts); on the CPU the torch passes below
    (chunk default: CHUNK_EXPERTS).
    """
    if words.is_cuda:          # CUDA and ROCm alike
        from . import layout_kernel
        return layout_kernel.convert_experts_(words, scales, chunk)
    return convert_experts_torch_(words, scales, chunk or CHUNK_EXPERTS)


def convert_experts_torch_(words: torch.Tensor, scales: torch.Tensor,
                           chunk: int = CHUNK_EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """convert_experts_ in torch passes on any device (the CPU path; on a GPU, the bench's "before")."""
    e, n, k8 = words.shape
    g = scales.shape[-1]
    out_w = words.view(torch.uint8).view(e, n, k8 * 4)
    out_s = scales.view(e, n * g)
    for lo in range(0, e, chunk):
        hi = min(lo + chunk, e)
        w = weights_to_aiter(words[lo:hi])            # fresh tensors: read before the chunk is overwritten
        s = scales_to_aiter(scales[lo:hi]).view(hi - lo, n * g)
        out_w[lo:hi].copy_(w)
        out_s[lo:hi].copy_(s)
    return out_w, out_s.view(-1)


def neutralize_padding_(w13_words: torch.Tensor, w13_scales: torch.Tensor, w2_words: torch.Tensor,
                        w2_scales: torch.Tensor, real: int) -> str | None:
    """Make the channels vLLM padded (per-rank intermediate ``real`` -> I) contribute exactly zero.

    vLLM leaves padded words 0, and a 0 nibble is code -8, with scales of 1: the kernel would add
    -8 * x per padded channel. Here they become code 0 with scale 0 (CT order, before the layout):
    w13 rows [real, I) and [I + real, 2I), w2 columns [real, I). Returns why not, or None: a padded
    region that holds anything but zero words was loaded into, so the padding model is wrong.
    """
    inter = w13_words.shape[1] // 2
    if real == inter:
        return None
    if not 0 < real < inter or real % GROUP:
        return f"{real} real channels of {inter} per rank (expected a positive multiple of {GROUP} below it)"
    pads = ((w13_words, 1, real, inter), (w13_words, 1, inter + real, 2 * inter),
            (w2_words, 2, real // 8, inter // 8))
    for words, dim, lo, hi in pads:
        if words.narrow(dim, lo, hi - lo).any():
            return f"padded channels {lo}..{hi - 1} hold loaded data"
    for words, dim, lo, hi in pads:
        words.narrow(dim, lo, hi - lo).fill_(ZERO_WORD)
    w13_scales[:, real:inter].zero_()
    w13_scales[:, inter + real:].zero_()
    w2_scales[:, :, real // GROUP:].zero_()
    return None


def probe(shuffle_weight, pack_int8_to_packed_int4, shuffle_scale_for_int4) -> str | None:
    """Why aiter's own layout functions (the load-time path's) disagree with these, or None.

    Run where the plugin serves, against the installed aiter: a build whose kernel reads another layout
    is refused instead of fed wrong bytes. Small random codes (including -8) and scales, on the CPU.
    """
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (2, 32, 128), dtype=torch.int8, generator=gen)
    bytes_of = lambda t: t.contiguous().view(-1).view(torch.uint8)  # noqa: E731
    shuffled = shuffle_16x16(codes)
    theirs_shuffled = shuffle_weight(codes.clone(), (16, 16))
    if not torch.equal(bytes_of(theirs_shuffled), bytes_of(shuffled)):
        return "aiter's shuffle_weight (16, 16) lays out int8 codes differently"
    if not torch.equal(bytes_of(pack_int8_to_packed_int4(theirs_shuffled)), bytes_of(pack_i4x2(shuffled))):
        return "aiter's pack_int8_to_packed_int4 packs int4 codes differently"
    scale_ng = torch.randn(2, 32, 4, generator=gen).to(torch.bfloat16)   # [E, N, G]
    theirs_s = shuffle_scale_for_int4(scale_ng.transpose(1, 2).contiguous(), group_size=GROUP)
    if not torch.equal(theirs_s.contiguous().view(-1).view(torch.int16),
                       scales_to_aiter(scale_ng).view(-1).view(torch.int16)):
        return "aiter's shuffle_scale_for_int4 lays out bf16 group scales differently"
    return None
