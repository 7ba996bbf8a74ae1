"""Check "passthrough" (with --source): sampled tensors the conversion did not produce are
byte-identical to the source's (under the name the dialect gave them there), and the MXFP4
modules written as bf16 (``plan.Dequant``) hold exactly the values their MXFP4 bytes encode."""
from __future__ import annotations

from ..checks import Check
from ..formats import checkpoint as ckpt
from ..formats.dialect import source_name
from ..plan import PACKED, SCALE, SHAPE, UNQUANTIZED
from .context import Context
from .dst import converted_modules
from .reader import Tensors
from .sample import spread


def run(ctx: Context) -> list[Check]:
    if ctx.source is None:
        return []
    import torch

    d = ctx.dst
    copy = Check("passthrough")
    s_t = Tensors(ctx.source, ckpt.weight_map(ctx.source))
    d_t = Tensors(d.path, {t: s for t, (s, _) in d.where.items()})
    quant = (d.manifest.get("source") or {}).get("quantization") or {}
    produced = {f"{m}.{x}" for m in converted_modules(d) for x in (PACKED, SCALE, SHAPE)}
    dequants = {f"{q.module}.{UNQUANTIZED}": q for s in (ctx.plan.shards if ctx.plan else ()) for q in s.dequants}
    others = spread(sorted(t for t in d.where if t not in produced and t not in dequants), ctx.sample)
    renamed = [tuple(r) for r in quant.get("renamed") or [] if isinstance(r, list) and len(r) == 2]
    for t in others:
        try:
            a, b = s_t.get(source_name(t, renamed)), d_t.get(t)
        except KeyError:
            copy.fail(f"{t}: not in the source")
            continue
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.reshape(-1).view(torch.uint8),
                                                                        b.reshape(-1).view(torch.uint8)):
            copy.fail(f"{t}: differs from the source ({b.dtype}{list(b.shape)} vs {a.dtype}{list(a.shape)})")
    exact = spread(sorted(dequants), ctx.sample)
    for t in exact:
        why = _dequant_problem(torch, s_t, d_t, t, dequants[t], ctx.plan.source.scale_bias)
        if why:
            copy.fail(why)
    copy.summary = f"{len(others)} non-expert tensor(s) byte-identical to the source" + (
        f"; {len(exact)} of {len(dequants)} MXFP4 module(s) written as bf16 equal to their MXFP4 values"
        if dequants else "")
    return [copy]


def _dequant_problem(torch, s_t: Tensors, d_t: Tensors, name: str, q, bias: int) -> str | None:
    """Why DST's bf16 ``name`` is not the exact value of the source's MXFP4 pair, or None."""
    from ..formats import mxfp4

    try:
        got = d_t.get(name)
    except KeyError:
        return f"{name}: not in DST"
    packed, scales = s_t.get(q.packed.name), s_t.get(q.scale.name)
    want = mxfp4.decode(packed, scales.view(torch.uint8), bias, dtype=torch.float64)
    if got.dtype != torch.bfloat16 or list(got.shape) != [q.rows, q.cols]:
        return f"{name}: {got.dtype}{list(got.shape)}, expected bf16[{q.rows}, {q.cols}] decoded from {q.packed.name}"
    differ = int((got.double() != want).sum())  # float64 decodes every finite byte exactly
    return f"{name}: {differ} value(s) differ from the MXFP4 values of {q.packed.name}" if differ else None
