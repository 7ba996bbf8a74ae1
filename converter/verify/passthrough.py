"""Check "passthrough" (with --source): sampled tensors the conversion did not produce are
byte-identical to the source's (under the name the dialect gave them there)."""
from __future__ import annotations

from ..checks import Check
from ..formats import checkpoint as ckpt
from ..formats.dialect import source_name
from ..plan import PACKED, SCALE, SHAPE
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
    others = spread(sorted(t for t in d.where if t not in produced), ctx.sample)
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
    copy.summary = f"{len(others)} non-expert tensor(s) byte-identical to the source"
    return [copy]
