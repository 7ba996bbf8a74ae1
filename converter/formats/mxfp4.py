"""MXFP4 (OCP Microscaling v1.0): E2M1 elements, E8M0 scales, two codes a byte, low first."""
from __future__ import annotations

import numpy as np
import torch

from ..quant.tables import E2M1_VALUES, E8M0_NAN

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


def decode(packed: torch.Tensor, scales: torch.Tensor, bias: int = 127,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed [out, in/2], scales [out, in/32]) -> ``dtype`` [out, in], on their device.

    ``bias``: the E8M0 bias the writer used (compressed-tensors 0.13.0 wrote 125); the bytes are
    shifted to OCP's 127 modulo 256, as the converter does. float32 overflows for the top two
    exponents (6 * 2^127 > float32's max): pass float64 where every finite byte must decode
    exactly (verify's optimum).
    """
    lut = torch.as_tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    unit = torch.pow(2.0, to_ocp(scales, bias).to(dtype) - 127).repeat_interleave(32, dim=1)
    return lut[codes] * unit


# the lowest E8M0 byte whose group can exceed bf16's range: 4 * 2^126 = 2^128 (6 * 2^125 still fits)
_FIRST_OVERFLOW = 253
# each byte's two E2M1 values, low nibble first: one look-up decodes a byte
_BYTE_VALUES = np.array([[E2M1_VALUES[b & 15], E2M1_VALUES[b >> 4]] for b in range(256)], dtype=np.float32)


def to_bf16(packed: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None,
            scratch: np.ndarray | None = None) -> tuple[np.ndarray, int | None]:
    """(packed uint8 [rows, in/2], OCP E8M0 bytes [rows, in/32]) -> (bf16 bits uint16 [rows, in], the
    first group that overflows bf16, or None).

    Exact: an E2M1 value (at most two significant bits) times 2^(e-127) is a float32 number, normal
    or subnormal (the smallest, 2^-128, is float32's 2^21-th subnormal step), whose low 16 bits are
    zero, so its top 16 bits are the bf16 number itself. Only magnitudes past bf16's range (4 or 6
    times 2^126, ...) do not fit: the caller refuses those groups. Byte 255 (NaN) must have been
    refused before (``refused_scale``). ``out`` (uint16, rows * in) and ``scratch`` (float32, at least
    rows * in) are reused buffers: fresh pages cost more than the decode (bench_dequant.py).
    """
    rows, groups = scales.shape
    n = rows * groups * 32
    values = (np.empty(n, np.float32) if scratch is None else scratch[:n]).reshape(rows, groups, 32)
    # take: ~10x fancy indexing; mode "clip" (bytes index 256 rows: never clipped) or numpy buffers `out`
    np.take(_BYTE_VALUES, packed, axis=0, out=values.reshape(rows, groups * 16, 2), mode="clip")
    with np.errstate(over="ignore"):
        values *= np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float32)[:, :, None]
    bad = None
    high = np.flatnonzero(scales.reshape(-1) >= _FIRST_OVERFLOW)  # only these groups can reach inf
    if high.size:
        inf = high[np.isinf(values.reshape(-1, 32)[high]).any(axis=1)]
        bad = int(inf[0]) if inf.size else None
    bits = values.reshape(rows, -1).view(np.uint32)
    np.right_shift(bits, 16, out=bits)
    out = np.empty((rows, groups * 32), np.uint16) if out is None else out.reshape(rows, groups * 32)
    np.copyto(out, bits, casting="unsafe")   # each value < 2^16
    return out, bad


def to_ocp(scales: torch.Tensor, bias: int = 127) -> torch.Tensor:
    """E8M0 bytes written with exponent bias ``bias``, as OCP's bias-127 bytes (uint8, modulo 256:
    the shift the converter applies as it reads)."""
    return ((scales.to(torch.int32) + 127 - bias) % 256).to(torch.uint8)


def refused_scale(packed: np.ndarray, scales: np.ndarray, bias: int = 127) -> tuple[int, str] | None:
    """The first group whose STORED E8M0 byte is refused, and why; None when all are fine.

    Runs on the raw bytes, before the bias correction wraps them (docs/mxfp4_dialects.md §7):
    255 is E8M0's NaN, refused in every dialect; with bias 125 (compressed-tensors 0.13.0,
    stored = exponent - 2 mod 256) 253 is exponent 255, NaN too, and 254 is how that writer
    stored an all-zero group: accepted only when the group's codes are all zero.
    ``packed``: uint8 [G, 16]; ``scales``: uint8 [G].
    """
    shift = (127 - bias) % 256
    nan = scales == E8M0_NAN
    if shift:
        nan |= scales == (E8M0_NAN - shift) % 256
    hits = np.flatnonzero(nan)
    first = (int(hits[0]), _why(int(scales[hits[0]]), shift)) if hits.size else None
    if shift > 1:  # bytes that wrap to tiny exponents: only an all-zero group may carry them
        wrap = np.flatnonzero((scales >= 256 - shift) & (scales != E8M0_NAN))
        if wrap.size:
            live = wrap[(packed[wrap] & 0x77).any(axis=1)]  # 0x77: each code's magnitude bits
            if live.size and (first is None or live[0] < first[0]):
                b = int(scales[live[0]])
                first = (int(live[0]), f"stored E8M0 byte {b} with nonzero values: exponent byte {(b + shift) % 256} "
                                       f"after the +{shift} correction, a group below 1e-37 that the bias-{bias} "
                                       "writer stores only for practically zero weights (254 is its mark of an "
                                       "all-zero group): refused as ambiguous")
    return first


def _why(byte: int, shift: int) -> str:
    if byte == E8M0_NAN and not shift:
        return "stored E8M0 byte 255 is NaN"
    if byte == E8M0_NAN:
        return (f"stored E8M0 byte 255 is NaN in E8M0; in this bias-{127 - shift} dialect it would be exponent "
                f"byte {(255 + shift) % 256}, a group below 1e-37 that its writer never stores for real weights: "
                "refused as ambiguous")
    return f"stored E8M0 byte {byte} is exponent byte 255 (NaN) after the +{shift} bias correction"
