"""MXFP4 (OCP Microscaling v1.0): E2M1 elements, E8M0 scales, two codes a byte, low first."""
from __future__ import annotations

import torch

from ..quant.tables import E2M1_VALUES

_LEVELS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (packed uint8 [out, in/2], E8M0 scales uint8 [out, in/32]).

    Shared exponent floor(log2(amax)) - 2 (E2M1's emax), values rounded to the nearest
    E2M1 level and saturated at 6: the OCP recipe. Used to build fixtures.
    """
    out, cols = weight.shape
    w = weight.float().reshape(out, cols // 32, 32)
    amax = w.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)).clamp(-127, 127)
    mag = (w.abs() / torch.pow(2.0, exp)).clamp(max=6.0)
    levels = _LEVELS.to(w.device)
    mid = (levels[1:] + levels[:-1]) / 2  # ties go to the lower level here; any rule will do
    code = torch.bucketize(mag, mid).to(torch.uint8) | ((w < 0).to(torch.uint8) << 3)
    code = code.reshape(out, cols)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8)


def decode(packed: torch.Tensor, scales: torch.Tensor, bias: int = 127) -> torch.Tensor:
    """(packed [out, in/2], scales [out, in/32]) -> float32 [out, in], on their device.

    ``bias``: the E8M0 bias the writer used (compressed-tensors 0.13.0 wrote 125); the bytes are
    shifted to OCP's 127 modulo 256, as the converter does.
    """
    lut = torch.as_tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    exps = (scales.int() + 127 - bias) % 256
    unit = torch.pow(2.0, exps.float() - 127).repeat_interleave(32, dim=1)
    return lut[codes] * unit
