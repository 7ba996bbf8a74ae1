"""Check "situ" (docs/spec.md §4): the expert activation is stated in config, in every shard, and in the manifest."""
from __future__ import annotations

import os

from ..checks import Check
from ..errors import BadInput
from ..formats import checkpoint as ckpt
from ..run.plan import metadata_value
from ..state.files import MANIFEST
from .context import Context


def run(ctx: Context) -> list[Check]:
    d = ctx.dst
    c = Check("situ")
    if d.config is None:
        c.fail("no config.json: the expert activation cannot be stated")
        return [c]
    mact = d.manifest.get("activation")
    mact = mact if isinstance(mact, dict) else {}
    try:   # the optional fields the manifest states (MiniMax swiglu_beta) are read and type-checked too
        act = ckpt.activation(d.config, os.path.join(d.path, "config.json"), optional=tuple(mact))
    except BadInput as e:
        c.fail(str(e))
        return [c]
    for shard, h in sorted(d.headers.items()):
        for k, v in act.items():
            if h.metadata.get(k) != metadata_value(v):
                c.fail(f"{shard}: metadata {k} is {h.metadata.get(k)!r}, config says {v!r}")
    for k, v in act.items():
        if k not in mact or str(mact[k]) != str(v):
            c.fail(f"{MANIFEST}: activation.{k} is {mact.get(k)!r}, config says {v!r}")
    for k in mact:
        if k not in act:
            c.fail(f"{MANIFEST}: activation.{k} is {mact[k]!r}, config.json does not state it")
    c.summary = ", ".join(f"{k}={v}" for k, v in act.items()) + \
        f" (config, {len(d.headers)} shard metadata, manifest)"
    return [c]
