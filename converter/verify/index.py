"""Check "index": the index names exactly the tensors each shard holds, and their total size."""
from __future__ import annotations

import os

from ..checks import Check
from ..formats import checkpoint as ckpt
from .context import Context


def run(ctx: Context) -> list[Check]:
    d, c = ctx.dst, ctx.check("index")
    wm = (d.index or {}).get("weight_map")
    if not isinstance(wm, dict):
        return [c]  # loading said why
    for name in sorted(set(wm.values())):
        if not os.path.exists(os.path.join(d.path, name)):
            c.fail(f"{name}: named by {ckpt.INDEX} but missing")
    for shard, h in sorted(d.headers.items()):
        for t in sorted(h.tensors):
            if t not in wm:
                c.fail(f"{shard}: tensor {t} is not in {ckpt.INDEX}")
            elif wm[t] != shard:
                c.fail(f"{shard}: tensor {t} is indexed under {wm[t]}")
    for t, shard in sorted(wm.items()):
        if shard in d.headers and t not in d.headers[shard].tensors:
            c.fail(f"{ckpt.INDEX}: {t} -> {shard}, but that shard has no such tensor")
    for name in sorted(set(d.manifest.get("shards") or {}) - set(wm.values())):
        c.fail(f"{name}: in the manifest but not in {ckpt.INDEX}")
    total = sum(i.nbytes for h in d.headers.values() for i in h.tensors.values())
    stated = ((d.index or {}).get("metadata") or {}).get("total_size")
    if stated != total:
        c.fail(f"{ckpt.INDEX}: metadata.total_size is {stated}, the shards hold {total} bytes of tensors")
    c.summary = f"{len(wm)} tensors in {len(set(wm.values()))} shard(s), total_size {stated}"
    return [c]
