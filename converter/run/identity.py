"""What a DST is a conversion of: the run record (``run.json``: source fingerprints and options) a run
writes, and how a later run, a job-array part or ``finalize`` tells that it continues the same one."""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Mapping

from ..errors import OutputError
from ..state.files import STATE_DIR
from ..state.locks import state_file
from ..state.records import file_fingerprint, read_json
from .options import Options
from .plan import Plan
from .sources import config_identity, content_change, shard_identity


def state_path(dst: str, *parts: str) -> str:
    """A path in DST's state folder."""
    return os.path.join(dst, STATE_DIR, *parts)


def _compared(identity: Mapping[str, Any]) -> dict[str, Any]:
    """An identity as compared: without who recorded it, the hints, where the profile was found and its
    text (its SHA-256 is compared), and the source shards' mtimes. An mtime says when a copy was made,
    not what it holds (a job array's per-node copies of SRC, T9): like the inode and ctime it is a
    hint, and where it moved
    the finished shards' content is compared with the digests recorded (``source_change``)."""
    out = {k: v for k, v in identity.items() if k not in (_WHO, HINTS)}
    prof = (out.get("options") or {}).get("profile")
    if isinstance(prof, dict):
        out["options"] = {**out["options"], "profile": {k: v for k, v in prof.items() if k not in ("file", "toml")}}
    shards = out.get("shards")
    if isinstance(shards, dict):
        out["shards"] = {n: {k: v for k, v in i.items() if k != "mtime_ns"} if isinstance(i, dict) else i
                         for n, i in shards.items()}
    return out


IDENTITY = "run.json"


_WHO = "created_by"  # which run recorded the identity: named when another is refused


HINTS = "hints"      # per source shard, what tells that it may have been written since (sources.hint)
STATEMENT = "quantization_statement"   # the file that states the quantization, where not config.json


def run_identity(plan: Plan, options: Options) -> dict[str, Any]:
    return {
        "tool": "k3convert", "options": options.identity(), "source": plan.label,
        "profile": plan.profile.name, "quantization": plan.source.record(),
        "config": config_identity(os.path.join(plan.src, "config.json")),
        **({STATEMENT: config_identity(plan.stated_in)} if plan.stated_in else {}),   # ModelOpt <= 0.27
        "shards": {s.name: shard_identity(s.path) for s in plan.shards},
    }


def source_change(dst: str, plan: Plan, recorded: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """What the identity cannot see: a finished shard's source (or partner) rewritten in place with
    its mtime put back. Re-read only where a hint moved (sources.content_change)."""
    records = {s.name: shard_record(dst, s.name) for s in plan.shards}
    return content_change(plan.shards, records, recorded.get(HINTS) or {})


def identity_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """What differs between a recorded identity and this run's, in words (both values), or None."""
    old, new = _compared(old), _compared(new)
    if old == new:
        return None
    if old.get("source") != new.get("source"):
        return f"another source: {old.get('source')} (recorded) vs {new.get('source')}"
    o, n = old.get("options") or {}, new.get("options") or {}
    for key in sorted(set(o) | set(n)):
        if o.get(key) != n.get(key):
            flag = "--" + key.replace("_", "-")
            return f"other options: {flag} {o.get(key)!r} (recorded) vs {n.get(key)!r}"
    if old.get("config") != new.get("config"):
        return "source files changed: config.json"
    if old.get(STATEMENT) != new.get(STATEMENT):
        return "source files changed: the file that states the quantization (hf_quant_config.json)"
    os_, ns = old.get("shards") or {}, new.get("shards") or {}
    for name in sorted(set(os_) | set(ns)):
        if os_.get(name) != ns.get(name):
            what = "is new" if name not in os_ else "is gone" if name not in ns else "changed"
            return f"source files changed: {name} {what}"
    return "source files changed"


def stamped(ident: Mapping[str, Any], hints: Mapping[str, Any]) -> dict[str, Any]:
    """The run record a new run writes: its identity, the source hints, and who recorded it (named
    when another run is refused)."""
    who = {"pid": os.getpid(), "host": socket.gethostname(),
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return {**ident, HINTS: dict(hints), _WHO: who}


def named(old: Mapping[str, Any] | None) -> str:
    w = old.get(_WHO) if old else None
    if not isinstance(w, dict):
        return "an earlier run"
    return f"the run of pid {w.get('pid')} on {w.get('host')} started {w.get('started_at')}"


def recorded_identity(dst: str) -> tuple[dict | None, str | None]:
    """DST's run.json (None when absent), or why it cannot be continued: unreadable (T13)."""
    path = state_path(dst, IDENTITY)
    try:
        old = read_json(path)
    except OutputError:
        return None, f"its run record {STATE_DIR}/{IDENTITY} is corrupt"
    if old is not None and not isinstance(old, dict):
        return None, f"its run record {STATE_DIR}/{IDENTITY} is not an object"
    return old, None


def shard_record(dst: str, name: str) -> dict | None:
    """A finished shard's record, if its output is still the file that was written."""
    try:
        rec = read_json(state_file(dst, name, ".done.json"))
    except OutputError:  # unreadable (T13): the shard is not known to be done, so it is converted again
        return None
    path = os.path.join(dst, name)
    if not isinstance(rec, dict) or not os.path.isfile(path) or file_fingerprint(path) != rec.get("output"):
        return None
    return rec
