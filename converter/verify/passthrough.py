"""Check "passthrough" (with --source): sampled tensors the conversion did not produce are
byte-identical to the source's (under the name the dialect gave them there), and the MXFP4
modules written as bf16 (``items.Dequant``) hold exactly the values their MXFP4 bytes encode, and
the FP8 linears written as bf16 (``items.Fp8Dequant``) their e4m3 values times the block scales."""
from __future__ import annotations

from ..checks import Check
from ..formats import checkpoint as ckpt
from ..formats.dialect import source_name
from ..run.items import UNQUANTIZED
from ..run.plan import PACKED, SCALE, SHAPE
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
    fp8 = {f"{q.module}.{UNQUANTIZED}": q for s in (ctx.plan.shards if ctx.plan else ()) for q in s.fp8_dequants}
    others = spread(sorted(t for t in d.where if t not in produced and t not in dequants and t not in fp8),
                    ctx.sample)
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
    scaled, added = spread(sorted(fp8), ctx.sample), []
    for t in scaled:
        why, err = _fp8_problem(torch, s_t, d_t, t, fp8[t])
        if why:
            copy.fail(why)
        added += [err] if err else []
    copy.summary = f"{len(others)} non-expert tensor(s) byte-identical to the source" + (
        f"; {len(exact)} of {len(dequants)} MXFP4 module(s) written as bf16 equal to their MXFP4 values"
        if dequants else "") + (f"; {len(scaled)} of {len(fp8)} FP8 linear(s) written as bf16 equal to their e4m3 "
                                "values times the block scales, rounded to bf16" + _added(added) if fp8 else "")
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


def _fp8_problem(torch, s_t: Tensors, d_t: Tensors, name: str, q) -> tuple[str | None, tuple[float, float] | None]:
    """(why DST's bf16 ``name`` is not the source FP8 linear's e4m3 values times its fp32 block scales,
    computed in fp32 and rounded to bf16 (formats/fp8_block.py), or None; the bf16 rounding's error
    against those values, ``fp8_block.rel_error``)."""
    from ..formats import fp8_block

    try:
        got = d_t.get(name)
    except KeyError:
        return f"{name}: not in DST", None
    w, s = s_t.get(q.weight.name), s_t.get(q.scale.name).float()
    if got.dtype != torch.bfloat16 or list(got.shape) != [q.rows, q.cols]:
        return (f"{name}: {got.dtype}{list(got.shape)}, expected bf16[{q.rows}, {q.cols}] decoded from "
                f"{q.weight.name}"), None
    bn, bk = q.block
    per_block = s.repeat_interleave(bn, 0)[: q.rows].repeat_interleave(bk, 1)[:, : q.cols]
    want = (w.view(torch.float8_e4m3fn).float() * per_block).to(torch.bfloat16)
    differ = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    err = fp8_block.rel_error(w.view(torch.float8_e4m3fn), s, q.block)
    return (f"{name}: {differ} value(s) differ from the FP8 values of {q.weight.name} times {q.scale.name}"
            if differ else None), err


def _added(errs: list[tuple[float, float]]) -> str:
    """The bf16 rounding's error against the FP8 values, over the modules checked (0 when exact)."""
    if not errs:
        return ""
    worst, rel = max(e[0] for e in errs), max(e[1] for e in errs)
    if worst == 0:
        return " (exact: power-of-two scales)"
    return f" (added error against the FP8 values: at most {worst:.2e} per value, {rel:.2e} relative RMS per tensor)"
