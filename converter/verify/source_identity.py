"""Check "source" (with --source): SRC's shards are the ones converted (the manifest's fingerprints)."""
from __future__ import annotations

import os

from ..checks import Check
from ..safepath import plain_name
from ..state.files import MANIFEST
from ..state.records import file_fingerprint
from .context import Context


def run(ctx: Context) -> list[Check]:
    if ctx.source is None:
        return []
    src, d = ctx.source, ctx.dst
    c = Check("source")
    recorded = (d.manifest.get("source") or {}).get("shards") or {}
    for name, fp in sorted(recorded.items()):
        path = os.path.join(src, plain_name(name, os.path.join(d.path, MANIFEST)))
        if not os.path.exists(path):
            c.fail(f"{name}: not in {src}")
            continue
        if "sha256" in fp:   # a Hub source: the commit's LFS SHA-256 (converter.hub.convert)
            from ..digest import sha256_of
            if os.path.getsize(path) != fp.get("size") or sha256_of(path) != fp["sha256"]:
                c.fail(f"{name}: differs from the file converted ({fp.get('hub')}@{fp.get('commit')}: SHA-256)")
            continue
        now = file_fingerprint(path)
        if (now["size"], now["edge_blake2b"]) != (fp.get("size"), fp.get("edge_blake2b")):
            c.fail(f"{name}: differs from the file converted (size or first/last MiB changed)")
    c.summary = f"{src}: {len(recorded)} shard(s) against the manifest's fingerprints"
    return [c]
