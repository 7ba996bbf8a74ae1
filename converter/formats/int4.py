"""compressed-tensors pack-quantized int4: int32 words of eight q+8 nibbles, bf16 scales."""
from __future__ import annotations

import torch


def decode(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(int32 [out, in/8], bf16 [out, in/32]) -> float32 [out, in] = q * scale."""
    nib = words.contiguous().view(torch.uint8)  # little-endian: nibble k of a word = byte k//2
    q = torch.stack((nib & 15, nib >> 4), dim=-1).reshape(words.shape[0], -1).float() - 8
    return q * scales.float().repeat_interleave(32, dim=1)
