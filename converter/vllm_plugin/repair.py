"""Repair a layer for a kernel that misreads int4 code -8: re-optimize the groups using -8 over [-7, 7].

Why: a checkpoint converted with the default ``optimal`` rule uses -8; if the self-test finds that the
installed aiter decodes -8 as something else, the layer is repaired at load (converter.quant.int4_pm7,
the ``optimal-pm7`` optimum of the values the checkpoint stores) instead of refusing it, so nobody has
to convert 1.45 TB again. Works on compressed-tensors words and scales (before the layout), or on a
layer already laid out: the layout (layout.convert_experts_) is a permutation of each expert's nibbles
(code q stored as q & 0xF, i.e. the CT nibble q + 8 with its top bit flipped) and of its scales, so its
inverse is found by running convert_experts_ itself on tensors of position digits (whatever
implementation layout.py has), per call: the plugin unlays one layer per process (the first; later
layers are repaired before their layout), so a cache would only keep the index (int64 per nibble of an
expert, 0.26 GiB per rank at EP 8) on the GPU, taken from the KV cache, for the process's life.

Steps by device (``experts_per_step``): on the CPU CHUNK experts at a time; on a GPU (CUDA or ROCm) as
many experts as fit GPU_CHUNK_BYTES of transient memory (about 256 bytes per group for the codes and
their index arrays, 4 bytes per nibble for the unlayout), plus int4_pm7's step (GPU_STEP_BYTES). Peak
transient memory on a GPU: about GPU_CHUNK_BYTES + int4_pm7.GPU_STEP_BYTES (2 GiB), plus the inverse
layout index (int64 per nibble and scale of one expert) while a laid-out weight is unlaid; nothing is
left on the device after the call.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import torch

from ..quant.int4_pm7 import Repair, repair_groups_, stored_ref2
from . import layout

ENV = "K3CONVERT_MINUS8"       # "refuse": a -8 misread refuses the model instead of repairing it
CHUNK = 4                      # experts per step on the CPU: transient memory a few experts' codes
GPU_CHUNK_BYTES = 1 << 30      # transient memory of one step on a GPU (int4_pm7's matmul step apart)
BYTES_PER_GROUP = 256          # codes (32), their int16/bool/uint8 copies and the repaired rows' indices
BYTES_PER_NIBBLE = 4           # unlayout: both nibbles, the CT order, the repacked bytes


def refuse() -> bool:
    return os.environ.get(ENV, "").strip().lower() == "refuse"


def codes_to_words(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., K] in [-8, 7] -> compressed-tensors int32 words [..., K/8] (nibble k%8 = q + 8)."""
    nib = (codes.to(torch.int16) + 8).to(torch.uint8).view(*codes.shape[:-1], -1, 2)
    return (nib[..., 0] | (nib[..., 1] << 4)).contiguous().view(torch.int32)


def experts_per_step(device: torch.device, bytes_per_expert: int) -> int:
    """Experts per step: CHUNK on the CPU; on a GPU as many as fit GPU_CHUNK_BYTES (at least one)."""
    if device.type == "cpu":
        return CHUNK
    return max(1, GPU_CHUNK_BYTES // max(1, bytes_per_expert))


def repair_ct_(words: torch.Tensor, scales: torch.Tensor) -> Repair:
    """In place on CT words [E, N, K/8] and scales [E, N, G]: every group holding -8 re-optimized.
    ``ref2`` covers every group given (the layer's stored values), so ``rel_rmse`` is the layer's."""
    total = Repair(0, 0, 0.0, 0.0)
    ref2 = torch.zeros((), dtype=torch.float64, device=words.device)
    step = experts_per_step(words.device, scales[0].numel() * BYTES_PER_GROUP) if words.shape[0] else 1
    for lo in range(0, words.shape[0], step):
        w, s = words[lo:lo + step], scales[lo:lo + step]
        codes = layout.ct_words_to_codes(w)
        groups = codes.view(-1, layout.GROUP)
        flat = s.reshape(-1)
        ref2 += stored_ref2(groups, flat)
        got = repair_groups_(groups, flat)
        if got.repaired:
            w.copy_(codes_to_words(codes))
            if not s.is_contiguous():          # else flat is s's own storage, already written
                s.copy_(flat.view_as(s))
        total = total + Repair(got.groups, got.repaired, got.err2, 0.0)
        del codes, groups
    total.ref2 = float(ref2)
    return total


def _nibble_digits(pos: torch.Tensor, d: int) -> torch.Tensor:
    return ((pos // 16 ** d) % 16).to(torch.uint8)


def _inverse(n: int, k: int, g: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For one expert of [N, K] codes and [N, G] scales: the CT position of each laid-out nibble and
    scale (int64 [N*K], [N*G]), from convert_experts_ run on position digits. Not cached (module doc)."""
    npos, spos = n * k, n * g
    pos = torch.arange(npos, dtype=torch.int64, device=device)
    src = torch.zeros(npos, dtype=torch.int64, device=device)
    d = 0
    while 16 ** d < npos:
        nib = _nibble_digits(pos, d).view(1, n, k // 2, 2)
        words = (nib[..., 0] | (nib[..., 1] << 4)).contiguous().view(torch.int32)
        out, _ = layout.convert_experts_(words, torch.zeros(1, n, g, dtype=torch.bfloat16, device=device))
        b = out.reshape(-1)
        got = torch.stack((b & 15, b >> 4), dim=-1).view(-1) ^ 8          # stored q & 0xF = nibble ^ 8
        src += got.to(torch.int64) * 16 ** d
        d += 1
    sp = torch.arange(spos, dtype=torch.int64, device=device)
    ssrc = torch.zeros(spos, dtype=torch.int64, device=device)
    d = 0
    while 128 ** d < spos:
        digits = ((sp // 128 ** d) % 128).to(torch.bfloat16).view(1, n, g)    # integers < 256: exact
        zero_words = torch.full((1, n, k // 8), layout.ZERO_WORD, dtype=torch.int32, device=device)
        _, flat = layout.convert_experts_(zero_words, digits)
        ssrc += flat.to(torch.int64) * 128 ** d
        d += 1
    return src, ssrc


def unlayout_(packed: torch.Tensor, flat_scales: torch.Tensor, n: int, k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: a laid-out layer (uint8 [E, N, K/2], bf16 flat) back to CT words [E, N, K/8] and
    scales [E, N, G], views of the same storage."""
    e, g = packed.shape[0], k // layout.GROUP
    src, ssrc = _inverse(n, k, g, packed.device)
    words = packed.view(torch.uint8).reshape(e, n, k // 2)
    scales = flat_scales.view(e, n * g)
    step = experts_per_step(packed.device, n * k * BYTES_PER_NIBBLE)
    for lo in range(0, e, step):
        b = words[lo:lo + step].reshape(-1, n * k // 2)
        laid = torch.stack((b & 15, b >> 4), dim=-1).view(b.shape[0], -1) ^ 8        # CT nibbles, laid order
        ct = torch.empty_like(laid)
        ct[:, src] = laid
        b.copy_(ct.view(b.shape[0], -1, 2)[..., 0] | (ct.view(b.shape[0], -1, 2)[..., 1] << 4))
        s = scales[lo:lo + step]
        ct_s = torch.empty_like(s)
        ct_s[:, ssrc] = s
        s.copy_(ct_s)
    return words.view(torch.int32).view(e, n, k // 8), scales.view(e, n, g)


def repair_laid_out_(packed: torch.Tensor, flat_scales: torch.Tensor, n: int, k: int) -> Repair:
    """A layer already laid out for the kernel: back to CT order, repaired, laid out again, in place."""
    words, scales = unlayout_(packed, flat_scales, n, k)
    got = repair_ct_(words, scales)
    layout.convert_experts_(words, scales)
    return got


def repair_layer_(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  copies: Iterable[Any] = ()) -> Repair:
    """A laid-out layer (w13 [E, 2I, H/2], w2 [E, H, I/2] packed, flat scales) repaired in place, and
    the self-test's CT copies of some of its experts (selftest.Expert) with it. Returns the layer's figure."""
    hidden, inter2 = w2.shape[1], w13.shape[1]
    got = repair_laid_out_(w13, s13, inter2, hidden) + repair_laid_out_(w2, s2, hidden, inter2 // 2)
    for ex in copies:
        for w, s in ((ex.w13_words, ex.w13_scales), (ex.w2_words, ex.w2_scales)):
            repair_ct_(w.unsqueeze(0), s.unsqueeze(0))
    return got
