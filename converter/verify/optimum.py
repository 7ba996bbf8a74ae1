"""The references the re-decode holds int4 groups to: the exact optimum over every bf16 scale
(``brute_force_min``) and, for the server's rule, that rule applied to the source bytes."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..checks import Check

if TYPE_CHECKING:
    import torch

_ALL_BF16 = None


def _all_bf16_scales() -> torch.Tensor:
    """Every positive normal bf16 value, in float64 (the scales an int4 group may have)."""
    import torch

    global _ALL_BF16
    if _ALL_BF16 is None:
        bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32) << 16
        _ALL_BF16 = bits.view(torch.float32).double()
    return _ALL_BF16


def brute_force_min(values: torch.Tensor, qmin: int = -8) -> torch.Tensor:
    """Least squared error of each group [G, 32] over every positive normal bf16 scale S, with
    codes in ``[qmin, 7]`` (-7: ``optimal-pm7``; the bounds below hold for both ranges).

    Only S in [a/16, 2a] (a = the group's largest |value|) can win, so only those are tried.
    S > 2a rounds everything to 0 (error sum v^2), which S = a (bf16: an MXFP4 value) never
    exceeds. S < a/16 caps |q S| at 8 S < a/2, an error above a^2/4 on the largest value,
    while some bf16 S in [a/7, a/6.9] (bf16 steps are <= 2^-7 relative) covers every value
    within S/2: a total below 32 (a/13.8)^2 < a^2/4. tests/verify/test_verify_inspect.py checks
    the pruned search against the full one.
    """
    import torch

    scales = _all_bf16_scales()
    out = torch.zeros(values.shape[0], dtype=torch.float64)
    for i, v in enumerate(values):
        a = float(v.abs().max())
        if a == 0:
            continue
        s = scales[(scales >= a / 16) & (scales <= 2 * a)]
        q = torch.clamp(torch.round(v[None, :] / s[:, None]), qmin, 7)
        out[i] = ((q * s[:, None] - v[None, :]) ** 2).sum(1).min()
    return out


def has_minus_8(words: torch.Tensor) -> bool:
    """Whether packed int4 words hold code -8 (nibble 0; a zero group is nibble 8, code 0)."""
    import torch

    b = words.contiguous().view(torch.uint8)
    return bool(((b & 15) == 0).any() or ((b >> 4) == 0).any())


def same_as_rule(m: str, packed, scales, bias: int, words, int4_scales, check: Check) -> int:
    """Compare DST's bytes of module ``m`` with the server rule on the source bytes; groups compared."""
    import torch

    from ..formats.mxfp4 import to_ocp
    from ..quant import server_rule

    g = packed.numel() // 16
    s = to_ocp(scales.reshape(-1), bias)
    want = server_rule.requantize(packed.reshape(g, 16), s)
    got_q = words.contiguous().view(torch.uint8).reshape(-1, 16)
    got_s = int4_scales.contiguous().view(torch.int16).reshape(-1)
    if got_q.shape[0] != g or got_s.numel() != g:
        check.fail(f"{m}: {got_q.shape[0]} int4 group(s), the source has {g}")
        return 0
    differ = int(((got_q != want.packed).any(dim=1) | (got_s != want.scales.view(torch.int16))).sum())
    if differ:
        check.fail(f"{m}: {differ} of {g} group(s) differ from the server rule on the source bytes")
    return g
