"""Check "checksums": every shard's size and digest against the manifest (skipped with --no-checksums)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from ..checks import Check
from ..digest import file_digest
from ..formats import checkpoint as ckpt
from .context import Context


def run(ctx: Context) -> list[Check]:
    if not ctx.checksums:
        return [Check("checksums", "not computed (structure only)", skipped=True)]
    d = ctx.dst
    c = Check("checksums")
    shards = d.manifest.get("shards") or {}
    todo = []
    for name, rec in sorted(shards.items()):
        path = os.path.join(d.path, name)
        if not os.path.exists(path):
            c.fail(f"{name}: missing")
        elif os.path.getsize(path) != rec.get("bytes"):
            c.fail(f"{name}: {os.path.getsize(path)} bytes, manifest says {rec.get('bytes')}")
        else:
            todo.append((name, path, rec.get("digest")))
    # each shard's chunks are hashed in parallel (converter.digest); a few shards at a time
    # keep several disks busy
    with ThreadPoolExecutor(max(1, min(ctx.workers, len(todo)))) as pool:
        for (name, _, want), got in zip(todo, pool.map(lambda t: file_digest(t[1]), todo)):
            if got != want:
                c.fail(f"{name}: digest {got} does not match the manifest's {want}")
    indexed = set(((d.index or {}).get("weight_map") or {}).values())
    for name in sorted(indexed - set(shards)):
        c.fail(f"{name}: named by {ckpt.INDEX} but has no manifest entry (no checksum to check)")
    total = sum(int(r.get("bytes") or 0) for r in shards.values())
    c.summary = (f"{len(shards)} shard(s), {total / 1e9:.3f} GB: digests (chunked SHA-256) and sizes "
                 "against the manifest")
    return [c]
