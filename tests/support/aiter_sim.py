"""A simulated AITER packed-int4 a16w4 MoE kernel, for the plugin's self-test and end-to-end tests.

It decodes what it is handed by inverting aiter's own layout helpers (``shuffle_weight``,
``pack_int8_to_packed_int4``, ``shuffle_scale_for_int4``: the functions of tests/support/server_sources.py,
never the plugin's) on index tensors: each helper is run on tensors whose values are the digits of
each element's position, so the output says where every element came from. Then it computes the
MoE in bf16 stages, as an a16w4 kernel does. Like aiter's a16wi4 path it ignores any padding:
every channel it is given takes part. ``fault`` plants one defect:
  "silu"      computes SiLU-GLU instead of SiTU-GLU
  "no-linear" ignores SiTU's linear_beta
  "minus8"    reads nibble 0x8 as +8 (an unsigned offset), not -8
  "layout"    reads the weights without the (16, 16) preshuffle (a permuted layout)
  "remote"    computes experts another rank owns, with this rank's expert of the same index
  "rows"      writes each token's result one row down (a token-order fault of a prefill tile)
A fault written ``"minus8@32"`` is planted only in the kernel variant of that M tile: like aiter's
untuned int4 MoE (``fused_moe.py`` get_2stage_cfgs on get_padded_M's count), the simulated kernel picks
tile 16 up to 1024 tokens, 32 up to 8192 and 64 above, so e.g. only prefill batches of 1025+ tokens
misread -8.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch


def _digits(n: int, base: int) -> int:
    d = 1
    while base ** d < n:
        d += 1
    return d


def source_index(fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...], base: int,
                 dtype: torch.dtype, read: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """For an element-permuting ``fn``: the flat input position of every output element.

    ``fn`` is run once per base-``base`` digit of the positions, on a tensor holding that digit;
    ``read`` turns fn's output into the digits it carries, flat.
    """
    n = 1
    for s in shape:
        n *= s
    pos = torch.arange(n, dtype=torch.int64)
    out = None
    for d in range(_digits(n, base)):
        digit = ((pos // base ** d) % base).to(dtype).view(shape)
        got = read(fn(digit)).to(torch.int64) * base ** d
        out = got if out is None else out + got
    return out


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes -> their nibbles, low first, flat: the storage order a kernel reads."""
    b = packed.contiguous().view(-1).view(torch.uint8)
    return torch.stack((b & 15, b >> 4), dim=-1).view(-1)


@dataclass(frozen=True)
class Helpers:
    shuffle_weight: Callable
    pack_int8_to_packed_int4: Callable
    shuffle_scale_for_int4: Callable

    @functools.lru_cache(maxsize=None)
    def weight_index(self, e: int, n: int, k: int, shuffled: bool = True) -> torch.Tensor:
        """Flat [E*N*K] source position of each nibble the kernel reads, in storage order."""
        def fn(codes):
            return self.pack_int8_to_packed_int4(self.shuffle_weight(codes, (16, 16)) if shuffled else codes)
        return source_index(fn, (e, n, k), 8, torch.int8, _nibbles)

    @functools.lru_cache(maxsize=None)
    def scale_index(self, e: int, g: int, n: int) -> torch.Tensor:
        """Flat [E*G*N] source position (in the [E, G, N] input) of each flat scale."""
        return source_index(lambda s: self.shuffle_scale_for_int4(s, group_size=32), (e, g, n), 128,
                            torch.bfloat16, lambda t: t.contiguous().view(-1).float())

    def decode(self, packed: torch.Tensor, flat_scales: torch.Tensor, n: int, k: int,
               fault: str = "") -> torch.Tensor:
        """[E, N, K/2] packed bytes + flat scales -> float32 weights [E, N, K] as the kernel sees them."""
        e = packed.shape[0]
        idx = self.weight_index(e, n, k, shuffled=fault != "layout")
        nib = _nibbles(packed.cpu()).to(torch.int16)
        codes = torch.empty(e * n * k, dtype=torch.int16)
        codes[idx] = torch.where(nib >= 8, nib - 16, nib) if fault != "minus8" else \
            torch.where(nib > 8, nib - 16, nib)            # 0x8 -> +8
        g = k // 32
        sidx = self.scale_index(e, g, n)
        s_egn = torch.empty(e * g * n, dtype=torch.float32)
        s_egn[sidx] = flat_scales.cpu().float().view(-1)
        scales = s_egn.view(e, g, n).transpose(1, 2)      # [E, N, G]
        return (codes.view(e, n, k).float() * scales.repeat_interleave(32, dim=-1)).to(packed.device)


PADDED_M_TIERS = (32768, 131072)


def padded_m(tokens: int) -> int:
    """aiter/fused_moe.py get_padded_M: the token count get_2stage_cfgs is called with (the next power
    of two below the first tier, else the largest tier not above it)."""
    if tokens < PADDED_M_TIERS[0]:
        return 1 if tokens <= 1 else 1 << (tokens - 1).bit_length()
    return max(t for t in PADDED_M_TIERS if tokens >= t)


def tile(tokens: int) -> int:
    """aiter's untuned M tile for a batch of ``tokens`` tokens (aiter/fused_moe.py get_2stage_cfgs, on
    get_padded_M's count)."""
    token = padded_m(tokens)
    return 16 if token < 2048 else 32 if token < 16384 else 64


def planted(fault: str, tokens: int) -> str:
    """The fault this call computes: ``fault`` unless it is limited to another tile (``name@tile``)."""
    name, _, only = fault.partition("@")
    return name if not only or int(only) == tile(tokens) else ""


def glu_bf16(h13: torch.Tensor, beta: float, linear_beta: float | None, fault: str) -> torch.Tensor:
    g, u = h13.float().chunk(2, dim=-1)
    if fault == "silu":
        a = torch.nn.functional.silu(g)
    else:
        a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        if linear_beta is not None and fault != "no-linear":
            u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(torch.bfloat16)


def moe(helpers: Helpers, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
        x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_mask: torch.Tensor | None,
        beta: float, linear_beta: float | None, fault: str = "") -> torch.Tensor:
    """The simulated kernel: bf16 in, bf16 stages, bf16 out; w13 [E, 2I, H/2], w2 [E, H, I/2] packed.

    ``expert_mask`` is what vLLM hands AITER under expert parallelism (RoutedExperts.expert_map for a
    kernel that consumes_expert_mask: 1 for this rank's experts over the global ids, local experts in
    id order); None: every expert is local.
    """
    fault = planted(fault, x.shape[0])
    expert_map = None
    if expert_mask is not None:
        m = expert_mask.view(-1).to(torch.int64).cpu()
        expert_map = torch.where(m > 0, m.cumsum(0) - 1, torch.full_like(m, -1))
    e, n13, h2 = w13.shape
    hidden, inter = w2.shape[1], n13 // 2
    W13 = helpers.decode(w13, s13, n13, h2 * 2, fault)
    W2 = helpers.decode(w2, s2, hidden, inter, fault)
    gid = topk_ids.long().cpu()
    local = gid if expert_map is None else expert_map[gid]
    if fault == "remote":
        local = torch.where(local < 0, gid % e, local)
    local = local.to(x.device)
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    for le in range(e):
        tok, slot = (local == le).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = (x[tok].float() @ W13[le].T).to(torch.bfloat16)
        y = glu_bf16(h, beta, linear_beta, fault).float() @ W2[le].T
        out.index_add_(0, tok, topk_weights[tok, slot].float()[:, None] * y)
    if fault == "rows":
        out = out.roll(1, dims=0)
    return out.to(torch.bfloat16)
