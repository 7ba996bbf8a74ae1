"""Check "from source" (with --source): recompute from SRC what DST must hold (``outputs.expected``,
the list finalize writes) and compare every file: each shard's header and size, config.json and
the index byte for byte (naming the fields that differ), each side file byte for byte, and no
file besides."""
from __future__ import annotations

import os
from typing import Any

from ..checks import Check
from ..digest import file_digest
from ..errors import ConvertError
from ..formats import checkpoint as ckpt
from ..formats.safetensors_io import Header
from ..run.outputs import BOOKKEEPING, CONFIG, Expected, expected
from ..run.plan import README, build_plan
from ..run.sources import profile_argument
from ..safepath import open_regular, read_regular
from ..state.records import json_bytes
from .context import Context
from .dst import existing_dir, scale_rule

SHOWN_DIFFERENCES = 5  # field differences named per file


def differences(got: Any, want: Any, path: str = "", says: str = "SRC gives") -> list[str]:
    """Where a JSON value read from DST differs from the one SRC gives (``says`` who), as dotted field paths."""
    if got == want:
        return []
    if isinstance(got, dict) and isinstance(want, dict):
        out = []
        for k in sorted(set(got) | set(want), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in got:
                out.append(f"{p} is missing, {says} {_short(want[k])}")
            elif k not in want:
                out.append(f"{p} is {_short(got[k])}, {says} no such field")
            else:
                out += differences(got[k], want[k], p, says)
        return out
    return [f"{path or 'the document'} is {_short(got)}, {says} {_short(want)}"]


def _short(value: Any, limit: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _shard_problem(path: str, want: Expected, name: str, header: Header) -> str | None:
    """Why DST's shard ``name`` is not laid out as SRC gives it (header bytes and size), or None."""
    layout = want.shards[name].layout
    with os.fdopen(open_regular(path), "rb") as f:
        head = f.read(len(layout.header))
        size = os.fstat(f.fileno()).st_size
    if head == layout.header and size == layout.file_size:
        return None
    have, expect = set(header.tensors), {t.name for t in layout.tensors}
    for what, names in (("lacks", expect - have), ("holds the extra", have - expect)):
        if names:
            return f"{name}: {what} tensor(s) {', '.join(sorted(names)[:SHOWN_DIFFERENCES])}"
    if diff := differences(header.metadata, layout.metadata, "metadata"):
        return f"{name}: {diff[0]}"
    return f"{name}: {size} bytes, header of {len(head)}: SRC gives {layout.file_size} bytes and another " \
        "header (a tensor's dtype, shape, offset or order)"


def _document_problem(name: str, raw: bytes, parsed: Any, want: Any) -> str | None:
    """Why DST's JSON file ``name`` (its bytes, and as read) is not what SRC gives, naming fields."""
    if raw == json_bytes(want):
        return None
    diff = (differences(parsed, want) if parsed is not None else []) or ["other bytes than SRC gives"]
    more = f" (and {len(diff) - SHOWN_DIFFERENCES} more)" if len(diff) > SHOWN_DIFFERENCES else ""
    return f"{name}: " + "; ".join(diff[:SHOWN_DIFFERENCES]) + more


def run(ctx: Context) -> list[Check]:
    if ctx.source is None:
        return []
    src, d, files = existing_dir(ctx.source), ctx.dst, ctx.result.files
    c = Check("from source")
    opts = d.manifest.get("options") or {}
    plan = build_plan(src, profile_argument(opts.get("profile")),  # the profile the run recorded (BadInput: exit 2)
                      bool(opts.get("drop_activation_quant")), opts.get("fp8_bf16_tp"))
    ctx.plan, want = plan, expected(plan, scale_rule(d))
    have = set(files)
    for name in sorted(want.names - have):
        c.fail(f"{name}: SRC gives it, DST lacks it")
    for name in sorted(have - want.names - set(BOOKKEEPING) - {README}):
        c.fail(f"{name}: in DST, but SRC gives no such file")
    parsed = {ckpt.INDEX: d.index, CONFIG: d.config}  # as loading read them (None: it said why)
    for name in sorted(have & want.names):
        path = os.path.join(d.path, name)
        try:
            if name in want.shards:  # an unreadable header: the files check says why
                why = _shard_problem(path, want, name, d.headers[name]) if name in d.headers else None
            elif name in want.documents:
                why = _document_problem(name, read_regular(path), parsed.get(name), want.documents[name])
            elif file_digest(path) != file_digest(os.path.join(src, want.side_files[name])):
                why = f"{name}: differs from SRC's {want.side_files[name]} (side files are copied byte-identical)"
            else:
                why = None
        except ConvertError as e:  # a FIFO or device in place of the file
            why = str(e)
        if why:
            c.fail(why)
    c.summary = (f"{len(want.shards)} shard layout(s), {len(want.documents)} derived file(s) and "
                 f"{len(want.side_files)} side file(s) recomputed from SRC, compared with DST's, no other file")
    return [c]
