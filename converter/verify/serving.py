"""Check "serving" (with --serving SERVER): the rules of that server's int4 MoE path (converter.servers)."""
from __future__ import annotations

from ..checks import Check
from .context import Context


def run(ctx: Context) -> list[Check]:
    if ctx.serving is None:
        return []
    from ..servers.check import serving_check

    d = ctx.dst
    return [serving_check(d.config, {t: info for t, (_, info) in d.where.items()}, ctx.serving)]
