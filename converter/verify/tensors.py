"""Check "tensors": each converted module has an I32 packed, BF16 scale and I64 shape tensor that
agree, none is on the ignore list, and no int4 shape or E8M0 scale is left alone (header only, no torch)."""
from __future__ import annotations

import os

from ..checks import Check
from ..formats import checkpoint as ckpt
from ..run.plan import PACKED, SCALE, SHAPE
from .context import Context
from .dst import converted_modules


def _ignore_patterns(config: dict | None) -> list[str]:
    return [i for _, b in ckpt.quant_blocks(config or {}) for i in b.get("ignore") or []]


def run(ctx: Context) -> list[Check]:
    d = ctx.dst
    c = Check("tensors")
    modules = converted_modules(d)
    ignore = _ignore_patterns(d.config)
    fds: dict[str, int] = {}
    try:
        for m in modules:
            shard, p = d.where[f"{m}.{PACKED}"]
            s = d.where.get(f"{m}.{SCALE}")
            sh = d.where.get(f"{m}.{SHAPE}")
            if p.dtype != "I32" or len(p.shape) != 2:
                c.fail(f"{m}.{PACKED}: {p.dtype}{list(p.shape)}, expected 2-D I32 (MXFP4 left unconverted?)")
                continue
            rows, cols = p.shape[0], p.shape[1] * 8
            if cols % 32:
                c.fail(f"{m}.{PACKED}: in-dim {cols} is not a multiple of the group size 32")
            if s is None:
                c.fail(f"{m}: no {SCALE}")
            elif s[1].dtype != "BF16" or s[1].shape != (rows, cols // 32):
                c.fail(f"{m}.{SCALE}: {s[1].dtype}{list(s[1].shape)}, expected BF16{[rows, cols // 32]}")
            if sh is None:
                c.fail(f"{m}: no {SHAPE}")
            elif sh[1].dtype != "I64" or sh[1].shape != (2,):
                c.fail(f"{m}.{SHAPE}: {sh[1].dtype}{list(sh[1].shape)}, expected I64[2]")
            else:
                if sh[0] not in fds:
                    fds[sh[0]] = os.open(os.path.join(d.path, sh[0]), os.O_RDONLY)
                raw = os.pread(fds[sh[0]], 16, sh[1].start)
                value = [int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)]
                if value != [rows, cols]:
                    c.fail(f"{m}.{SHAPE}: holds {value}, but {PACKED} is for [{rows}, {cols}]")
            if any(ckpt.match_name(m, pat) for pat in ignore):
                c.fail(f"{m}: quantized, but the config's ignore list excludes it (a loader would read it as bf16)")
    finally:
        for fd in fds.values():
            os.close(fd)
    for t, (_, info) in sorted(d.where.items()):  # leftovers: an int4 shape or an E8M0 scale alone
        orphan = (t.endswith("." + SHAPE) or t.endswith("." + SCALE) and info.dtype == "U8") and \
            f"{t.rsplit('.', 1)[0]}.{PACKED}" not in d.where
        if orphan:
            c.fail(f"{t}: {info.dtype}{list(info.shape)} with no {PACKED} beside it")
    c.summary = f"{len(modules)} quantized module(s): I32 packed, BF16 scale, I64 shape, consistent"
    return [c]
