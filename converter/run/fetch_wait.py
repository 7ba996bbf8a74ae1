"""Source files that are still on their way (a Hub shard being downloaded): a worker about to open a
shard waits until every file it reads is there (``wait``), or fails with the fetch's own error.

A file on its way has a marker ``DIR/.k3convert-pending/NAME`` beside it (``mark``), removed once the
file is in place (``arrived``); a failed fetch leaves ``NAME.error`` there (``failed``). Markers are
files, so worker processes see them; a local SRC has none, and ``wait`` costs one stat per file.
"""
from __future__ import annotations

import json
import os
import time

from ..errors import ConvertError, from_event

PENDING = ".k3convert-pending"   # hidden: never taken for a side file or walked by inspect
POLL_S = 0.05


def _marker(path: str, suffix: str = "") -> str:
    return os.path.join(os.path.dirname(path), PENDING, os.path.basename(path) + suffix)


def mark(path: str) -> None:
    m = _marker(path)
    os.makedirs(os.path.dirname(m), exist_ok=True)
    for stale in (m + ".error",):
        if os.path.lexists(stale):
            os.unlink(stale)
    with open(m, "w"):
        pass


def arrived(path: str) -> None:
    try:
        os.unlink(_marker(path))
    except FileNotFoundError:
        pass


def failed(path: str, e: ConvertError) -> None:
    """Tell the workers waiting for ``path`` that it will not come, and why."""
    with open(_marker(path, ".error"), "w") as f:
        json.dump({"message": str(e), "code": e.exit_code}, f)


def _error(path: str) -> dict | None:
    """The failed fetch's error event ({"message", "code"}), or None."""
    try:
        with open(_marker(path, ".error")) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return {"message": str(rec.get("message")), "code": rec.get("code")} if isinstance(rec, dict) else None


def wait(paths: list[str]) -> None:
    """Return once no file of ``paths`` is on its way; raise the fetch's error if one failed."""
    for p in paths:
        if not os.path.lexists(os.path.dirname(_marker(p))):
            continue
        while os.path.lexists(_marker(p)):
            if (rec := _error(p)) is not None:
                raise from_event(rec)   # the error as the worker's own would be raised
            time.sleep(POLL_S)
