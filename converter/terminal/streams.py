"""The command's own output when it cannot be written: a closed pipe (``verify DST | head -1``),
a full disk (``inspect --json > /dev/full``, a batch job's log on a full file system).

Without this the first failed ``write`` raised out of the command: a traceback, exit 1, and a
conversion that had finished DST reported as failed (T10). Here standard output and error are
wrapped for the whole command: the first error on a stream is kept and that stream is written
no more, the command runs to its end, and ``status`` then decides the exit in one line. A job
(it writes DST or a fixture, or publishes) keeps its own exit status: its log is not its result.
A command whose output is its result (``verify``, ``inspect``) exits 4 where it would have
exited 0, since what it printed was not received.
"""
from __future__ import annotations

import sys
from typing import Any

# Commands whose result is what they write or publish, not what they print.
JOBS = frozenset({"mxfp4-to-int4", "finalize", "make-fixture", "demo", "upload"})
NAMES = {"stdout": "standard output", "stderr": "standard error"}


class _Guarded:
    """A text stream whose write errors are recorded, not raised; everything else is the stream's."""

    def __init__(self, stream: Any, name: str, lost: dict[str, OSError]):
        self._k3_stream, self._k3_name, self._k3_lost = stream, name, lost

    def _guard(self, call, *args, result=None):
        if self._k3_name in self._k3_lost:
            return result
        try:
            return call(*args)
        except OSError as e:
            self._k3_lost[self._k3_name] = e
            return result

    def write(self, s):
        return self._guard(self._k3_stream.write, s, result=len(s))

    def writelines(self, lines):
        return self._guard(self._k3_stream.writelines, lines)

    def flush(self):
        return self._guard(self._k3_stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._k3_stream, name)


class Guard:
    """``with Guard() as g:`` standard output and error are guarded; ``g.status(code, command)``
    is the exit status afterwards (and says what was lost, on standard error if it still works)."""

    def __init__(self):
        self.lost: dict[str, OSError] = {}
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> Guard:
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout = _Guarded(sys.stdout, "stdout", self.lost)
        sys.stderr = _Guarded(sys.stderr, "stderr", self.lost)
        return self

    def __exit__(self, *exc) -> None:
        for s in (sys.stdout, sys.stderr):
            s.flush()  # guarded: what was buffered is written now, or its error kept
        if self._saved is not None:   # set by __enter__
            sys.stdout, sys.stderr = self._saved

    def status(self, code: int, command: str | None) -> int:
        if not self.lost:
            return code
        what = "; ".join(f"{NAMES[n]}: {e.strerror or e}" for n, e in sorted(self.lost.items()))
        job = command in JOBS
        if job:
            line = f"k3convert: note: the log could not be written ({what}); exit {code} is the command's own"
        else:
            code = code or 4
            line = f"k3convert: error: the output could not be written ({what})"
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        return code
