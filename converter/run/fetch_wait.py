"""Source files that are still on their way (a Hub shard being downloaded): a worker about to open a
shard waits until every file it reads is there (``wait``), or fails with the fetch's own error.

A file on its way has a marker ``DIR/.k3convert-pending/NAME`` beside it (``Pending.mark``), removed
once the file is in place (``arrived``); a failed fetch leaves ``NAME.error`` there (``failed``,
written whole or not at all). Markers are files, so worker processes see them; a local SRC has
none, and ``wait`` costs one stat per file.

Writing the error can itself fail (the disk holding the markers is the full one), so the error
file is not the only word: the fetcher holds an flock on ``.k3convert-pending/fetcher.lock`` for
as long as files may still come, and a worker that finds it let go while its file is still
pending stops too, never waiting for a file that will not come.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time

from ..errors import ConvertError, OutputError, from_event
from ..safepath import lock_file
from ..state.atomic import atomic_write, discard
from .dst import held

PENDING = ".k3convert-pending"   # hidden: never taken for a side file or walked by inspect
HOLDER = "fetcher.lock"
POLL_S = 0.05


def _marker(path: str, suffix: str = "") -> str:
    return os.path.join(os.path.dirname(path), PENDING, os.path.basename(path) + suffix)


class Pending:
    """The files of a folder (a Hub view) still on their way, and the fetcher's word that more may come."""

    def __init__(self, folder: str):
        d = os.path.join(folder, PENDING)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create: {e.strerror}", file=d) from None
        self.holder = lock_file(os.path.join(d, HOLDER))
        fcntl.flock(self.holder, fcntl.LOCK_EX)

    def mark(self, path: str) -> None:
        m = _marker(path)
        discard(m + ".error")
        try:
            with open(m, "w"):
                pass
        except OSError as e:
            raise OutputError(f"cannot create: {e.strerror}", file=m) from None

    def done(self) -> None:
        """No file comes any more (every one arrived, or the fetch failed): waiting workers stop waiting."""
        self.holder.close()


def arrived(path: str) -> None:
    discard(_marker(path))


def failed(path: str, e: ConvertError) -> None:
    """Tell the workers waiting for ``path`` that it will not come, and why: the error file appears
    whole (renamed into place) or not at all; never raises (the holder's lock says the rest)."""
    with contextlib.suppress(OutputError):
        atomic_write(_marker(path, ".error"), json.dumps({"message": str(e), "code": e.exit_code}).encode())


def _error(path: str) -> dict | None:
    """The failed fetch's error event ({"message", "code"}), or None."""
    try:
        with open(_marker(path, ".error")) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return {"message": str(rec.get("message")), "code": rec.get("code")} if isinstance(rec, dict) else None


def wait(paths: list[str]) -> None:
    """Return once no file of ``paths`` is on its way; raise the fetch's error if one failed, or
    if the fetcher stopped without its file."""
    for p in paths:
        if not os.path.lexists(os.path.dirname(_marker(p))):
            continue
        holder = os.path.join(os.path.dirname(_marker(p)), HOLDER)
        while os.path.lexists(_marker(p)):
            if (rec := _error(p)) is not None:
                raise from_event(rec)   # the error as the worker's own would be raised
            if not held(holder) and os.path.lexists(_marker(p)):
                raise OutputError("its download stopped and the reason could not be written (is the disk "
                                  "holding the Hub cache full?)", file=p)
            time.sleep(POLL_S)
