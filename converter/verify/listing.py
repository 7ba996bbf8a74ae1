"""Check "files": every file under DST against the manifest (``outputs.listing``).

A file the manifest does not name fails (upload would publish it), a temporary is named, not
failed (upload never sends one), and each file it records beside the shards has its size and
digest; anything but a regular file fails. Sets ``result.files``: the files upload sends. Only files the walk found
are opened: the manifest's names are untrusted.
"""
from __future__ import annotations

import os

from ..checks import Check
from ..digest import file_digest
from ..run.outputs import accepted, listing, named_by
from ..safepath import regular_problem
from ..state.files import MANIFEST
from .context import Context


def run(ctx: Context) -> list[Check]:
    d, c = ctx.dst, ctx.check("files")
    found = listing(d.path)
    named = named_by(d.manifest)
    unnamed = [f for f in found.files if f not in named]
    if "files" not in d.manifest:  # then no file beside the shards can be told from a stray one
        c.fail(f"{MANIFEST} records no files beside the shards (written by an older k3convert): run "
               f"`k3convert finalize DST` to record them ({len(unnamed)} file(s) unnamed)")
    else:
        c.problems += [f"{f}: a file that {MANIFEST} does not name (upload would publish it): remove it"
                       for f in unnamed]
    for f in found.links:
        c.fail(f"{f} is a symlink (to {os.readlink(os.path.join(d.path, f))}): refusing what may lie outside DST")
    if found.temporaries:
        c.notes.append(f"left by an interrupted run, not part of the output (never uploaded; the finalize that "
                       f"completes DST removes them): {', '.join(found.temporaries)}")
    # only regular files are output (S16): a FIFO, device or socket would be listed but never sent
    irregular = {f: why for f in found.files if (why := regular_problem(os.path.join(d.path, f)))}
    c.problems += [f"{f}: {why}" for f, why in irregular.items()
                   if not any(p.startswith(f"{f}: ") for p in c.problems)]  # loading may have said why
    present = set(found.files)
    for rel, rec in sorted((d.manifest.get("files") or {}).items()):
        path = os.path.join(d.path, rel)
        if rel not in present:
            c.fail(f"{rel}: named by {MANIFEST} but missing")
        elif rel in irregular:
            continue
        elif os.path.getsize(path) != rec.get("bytes"):
            c.fail(f"{rel}: {os.path.getsize(path)} bytes, {MANIFEST} says {rec.get('bytes')}")
        elif file_digest(path) != rec.get("digest"):
            c.fail(f"{rel}: its digest does not match {MANIFEST}'s (edited after the conversion?)")
    ctx.result.files = [f for f in accepted(found, d.manifest) if f not in irregular]
    c.summary = (f"{len(ctx.result.files)} file(s), each named by the manifest; {len(d.headers)} shard(s) with "
                 "readable safetensors headers")
    return [c]
