"""Check "manifest": DST's manifest says complete, names this tool, its format and digest algorithm,
and one output shard for each source shard."""
from __future__ import annotations

from ..checks import Check
from ..digest import ALGORITHM as DIGEST_ALGORITHM
from ..formats import checkpoint as ckpt
from ..formats.dialect import TARGET_FORMAT
from ..state.manifest import Status
from .context import Context


def run(ctx: Context) -> list[Check]:
    c = Check("manifest")
    m = ctx.dst.manifest
    if m.get("tool") != "k3convert":
        c.fail(f"tool is {m.get('tool')!r}, not 'k3convert'")
    if m.get("complete") is not True:
        c.fail(f"not complete (status {m.get('status')!r}): finish the conversion first")
    elif m.get("status") != Status.COMPLETE:
        c.fail(f"complete, but status is {m.get('status')!r}, not 'complete'")
    # what the manifest says DST holds and how its digests were taken: exactly what this tool writes
    if m.get("target_format") != TARGET_FORMAT:
        c.fail(f"target_format is {m.get('target_format')!r}, not {TARGET_FORMAT!r}")
    if m.get("digest_algorithm") != DIGEST_ALGORITHM:
        c.fail(f"digest_algorithm is {m.get('digest_algorithm')!r}: the checksums are taken as "
               f"{DIGEST_ALGORITHM!r}")
    quant = (m.get("source") or {}).get("quantization") or {}
    want = ckpt.source_format(quant)   # what the source's own ``source_format`` states
    if want is None or m.get("source_format") != want:
        known = ", ".join(repr(ckpt.mxfp4_format(n)) for n in sorted(ckpt.DIALECTS)) + " or an NVFP4 layout's"
        c.fail(f"source_format is {m.get('source_format')!r}, source.quantization.dialect {quant.get('dialect')!r}: "
               f"expected {repr(want) if want else 'one of ' + known}, naming the dialect")
    if m.get("complete") is True:  # every source shard has its output shard of the same name, and no other
        listed = set((m.get("source") or {}).get("shards") or {})
        for name in sorted(listed - set(m.get("shards") or {})):
            c.fail(f"{name}: source.shards lists it, but shards has no output for it")
        for name in sorted(set(m.get("shards") or {}) - listed):
            c.fail(f"{name}: an output shard of no source shard in source.shards")
    c.summary = f"status {m.get('status')!r}, {m.get('tool')} {m.get('version')}, {len(m.get('shards') or {})} shards"
    return [c]
