"""The server's load-time int4 rule (vLLM 0.33 and 0.34 on gfx942, the same aiter per_1x32_i4_quant), as tables:
``--scale-rule vllm-gfx942``.

vLLM's ``_setup_kernel_k3_situ_gfx942`` dequantizes MXFP4 to bf16 and calls aiter's
``per_1x32_i4_quant`` (docs/maths.md, "The server's load-time rule"). Every step is
elementwise given the group's E8M0 byte ``s`` and its largest |code| ``top``, so a group's
int4 codes and bf16 scale are functions of ``(s, top, code)``: the tables below are built
once by running the server's own sequence of torch ops (``server_ops``) on one synthetic
group per ``(s, top)``. Every implementation (this torch one, the numba CPU kernel, the
Triton kernel) then only looks them up, so they agree to the bit, and the error figures of
the rule come from the same tables.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .requant import Result, by_chunks
from .tables import E2M1_VALUES, E8M0_NAN

QLIM = 7                       # per_1x32_i4_quant clamps to [-7, 7]
AMAX_FLOOR = 1e-6              # .clamp(min=1e-6), on a bf16 tensor
ROWS = 255 * 8                 # (s, top) for s = 0..254; s = 255 is NaN and never written
# x / 7.0 with a CPU scalar on a CUDA/HIP tensor is x * (1 / 7.0) in fp32 (PyTorch
# BinaryDivTrueKernel.cu); test_scale_rule checks CPU torch's division gives the same bits.
RECIP7 = torch.tensor(1.0 / 7.0, dtype=torch.float32)


def server_ops(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """aiter ``per_1x32_i4_quant`` on bf16 ``[..., 32]`` groups -> (int8 q, bf16 scale [...]).

    Line for line the server's ops (ROCm/aiter aiter/ops/quant.py at e4048607, lines 207-227),
    with the division by 7.0 spelled as the GPU computes it.
    """
    amax = w.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR)   # bf16, exact
    scale = (amax.float() * RECIP7).to(torch.bfloat16)                 # w_group_max / 7.0
    q = (w / scale).round().clamp(-QLIM, QLIM).to(torch.int8)          # bf16 / bf16 -> bf16, half-even
    return q, scale.squeeze(-1)


def server_dequant(codes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What vLLM feeds the rule: ``(mxfp4_to_f32(codes) * e8m0_to_f32(s)).to(bf16)`` per group.

    ``codes`` [..., 32] E2M1 codes, ``s`` [...] E8M0 bytes (aiter utility/fp4_utils.py: byte 0
    is 2**-127, 255 NaN); the fp32 product is exact (or inf: s >= 253 with large codes).
    """
    lut = torch.as_tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    sf = (s.to(torch.int32) << 23).view(torch.float32)
    sf = torch.where(s == 0, torch.tensor(2.0 ** -127, device=s.device), sf)
    sf = torch.where(s == E8M0_NAN, torch.tensor(float("nan"), device=s.device), sf)
    return (lut[codes.long()] * sf.unsqueeze(-1)).to(torch.bfloat16)


@dataclass(frozen=True)
class ServerTables:
    """Indexed by ``row = 8 * s + top`` and code: what the rule gives for that code."""

    nib: np.ndarray      # [ROWS, 16] uint8: q + 8
    q: np.ndarray        # [ROWS, 16] int8
    bits: np.ndarray     # [ROWS] int16: bf16 bits of the scale
    ok: np.ndarray       # [ROWS] bool: the group dequantizes to finite bf16 (else: not writable)
    err2: np.ndarray     # [ROWS, 16] float64: (q S - v)^2, exact
    abserr: np.ndarray   # [ROWS, 16] float64
    ref2: np.ndarray     # [ROWS, 16] float64: v^2


@functools.cache
def server_tables() -> ServerTables:
    s = torch.arange(255, dtype=torch.int32).repeat_interleave(8)
    top = torch.arange(8, dtype=torch.int32).repeat(255)
    c = torch.arange(16, dtype=torch.int32)
    allowed = (c[None, :] & 7) <= top[:, None]                          # codes a group of class top may hold
    codes = torch.cat([torch.where(allowed, c[None, :], top[:, None]), top[:, None].expand(-1, 16)], dim=1)
    w = server_dequant(codes, s.to(torch.uint8))
    q, scale = server_ops(w)
    ok = torch.isfinite(w.float()).all(dim=1) & torch.isfinite(scale.float())
    q = torch.where(allowed & ok[:, None], q[:, :16], torch.zeros_like(q[:, :16]))
    v = (torch.as_tensor(E2M1_VALUES)[None, :]
         * torch.ldexp(torch.ones(ROWS, dtype=torch.float64), s.double() - 127)[:, None])
    d = q.double() * scale.double()[:, None] - v
    d = torch.where(allowed & ok[:, None], d, torch.zeros_like(d))
    return ServerTables(
        nib=(q.numpy().astype(np.int16) + 8).astype(np.uint8), q=q.numpy(),
        bits=scale.view(torch.int16).numpy().copy(), ok=ok.numpy(),
        err2=(d * d).numpy(), abserr=d.abs().numpy(), ref2=(v * v).numpy())


@functools.cache
def torch_server_tables(device: str = "cpu") -> dict[str, torch.Tensor]:
    t = server_tables()
    out = {k: torch.from_numpy(np.ascontiguousarray(getattr(t, k))).to(device) for k in t.__dataclass_fields__}
    out["ok8"] = out["ok"].to(torch.int8)  # for kernels that load bytes
    return out


def table_rows(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group: ``(row, codes [G, 32] in element order, nan)``; NaN groups get row 0."""
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], 32).long()
    top = (codes & 7).amax(dim=1)
    s = scales.long()
    nan = s == E8M0_NAN
    return torch.where(nan, 0, 8 * s + top), codes, nan


def _chunk(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    t = torch_server_tables(str(packed.device))
    row, codes, nan = table_rows(packed, scales)
    bad = ~nan & ~t["ok"][row]
    nib = t["nib"][row[:, None], codes]
    out = nib[:, 0::2] | (nib[:, 1::2] << 4)
    bits = torch.where(nan | bad, 0, t["bits"][row].to(torch.int32)).to(torch.int16)
    keep = (~nan & ~bad)[:, None]
    err2 = torch.where(keep, t["err2"][row[:, None], codes], 0.0)
    ref2 = torch.where(keep, t["ref2"][row[:, None], codes], 0.0)
    mx = torch.where(keep, t["abserr"][row[:, None], codes], 0.0)
    figures = [float(err2.sum()), float(ref2.sum()), float(mx.max()) if mx.numel() else 0.0,
               float(nan.sum()), float(bad.sum())]
    return out, bits, figures


def requantize(packed: torch.Tensor, scales: torch.Tensor, offsets: list[int] | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> Result:
    """The server's rule on ``G`` groups, on the tensors' device (reference; same contract as
    ``requant.requantize``). Zero groups get the rule's scale bf16(bf16(1e-6) / 7), not 0."""
    return by_chunks(_chunk, packed, scales, offsets, out)
