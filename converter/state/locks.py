"""The locks that let runs, job-array parts and uploads share one DST: per-shard claims, the
identity/run/manifest locks, and upload's read lock (flock: the kernel drops them when a holder dies)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os

from ..errors import OutputError
from ..safepath import lock_file
from .files import STATE_DIR

_KEY_LIMIT = 200  # bytes of a shard name kept in its state files' names (+ suffix + .tmpPID <= 255)


def state_key(name: str) -> str:
    """The stem of a shard's files in the state folder (``KEY.done.json``, ``KEY.lock``, ...):
    the name itself, or for a long one (a legal 255-byte shard name would not fit with the
    suffixes) a hash of it."""
    if len(name.encode()) <= _KEY_LIMIT:
        return name
    return "long-" + hashlib.blake2b(name.encode(), digest_size=20).hexdigest()


def state_file(dst: str, name: str, suffix: str) -> str:
    return os.path.join(dst, STATE_DIR, state_key(name) + suffix)


def _flock(f, how: int) -> bool:
    try:
        fcntl.flock(f, how)
        return True
    except BlockingIOError:
        return False


class ShardLocks:
    """Exclusive flocks on the shards a run converts, in DST's state folder.

    A second run that wants any of them is refused at once; runs on disjoint shards (job
    array parts) share a DST. The kernel drops a flock when its holder dies, kill -9 too.
    Taken only while the DST lock is held (``DstLock``), so that a claim and the identity it
    belongs to are one step.
    """

    def __init__(self, dst: str, names: list[str]):
        self.files = []
        try:
            for n in names:
                f = lock_file(state_file(dst, n, ".lock"))
                self.files.append(f)
                if not _flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB):
                    raise OutputError("another k3convert run is converting it", file=os.path.join(dst, n))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for f in self.files:
            f.close()  # closing drops the flock
        self.files = []


IDENTITY_LOCK = "identity.lock"  # held (briefly, exclusively) to read, compare, write run.json and claim shards
RUN_LOCK = "run.lock"            # held shared by every run using DST, for as long as it does
MANIFEST_LOCK = "manifest.lock"  # held exclusively to rewrite the manifest (finalize, a redo's reopening)
READ_LOCK = "read.lock"          # shared by an upload while it reads DST, exclusive while a run changes it
LOCKS = (IDENTITY_LOCK, RUN_LOCK, MANIFEST_LOCK, READ_LOCK)  # never deleted (--overwrite): others may wait on them


def _read_lock(dst: str, how: int, busy: str):
    """``read.lock`` of DST taken ``how`` without waiting (a file object: closing releases it);
    OutputError (exit 4) with ``busy`` when the other side holds it. A complete DST is changed
    only by a redo (``_reopen``), ``--overwrite`` or finalize: each takes it exclusively, an
    upload takes it shared for as long as it reads, so neither waits hours on the other."""
    state = os.path.join(dst, STATE_DIR)
    if os.path.islink(state):
        raise OutputError(f"{STATE_DIR} is a symlink: refusing to lock through it", file=dst)
    os.makedirs(state, exist_ok=True)
    f = lock_file(os.path.join(state, READ_LOCK))
    if not _flock(f, how | fcntl.LOCK_NB):
        f.close()
        raise OutputError(busy, file=dst)
    return f


def reading(dst: str):
    """Hold DST unchanged while it is read (upload): shared with other readers. A DST we cannot
    write (a read-only mount, someone else's published snapshot) gets no lock file of ours (T17):
    its ``read.lock``, if it has one, is taken through a read-only descriptor (flock needs no
    write access), else no lock is taken. Either way upload commits only bytes it checked
    against the manifest (converter.hub.publish), lock or not."""
    busy = "a k3convert run is changing it (a redo, --overwrite or finalize): upload it when that run has finished"
    if os.access(dst, os.W_OK):
        return _read_lock(dst, fcntl.LOCK_SH, busy)
    state = os.path.join(dst, STATE_DIR)
    if os.path.islink(state):
        raise OutputError(f"{STATE_DIR} is a symlink: refusing to lock through it", file=dst)
    path = os.path.join(state, READ_LOCK)
    try:
        f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK), "rb")
    except FileNotFoundError:
        return contextlib.nullcontext()
    except OSError as e:
        raise OutputError(f"cannot open lock file ({e.strerror}; a symlink is refused)", file=path) from None
    if not _flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB):
        f.close()
        raise OutputError(busy, file=dst)
    return f


def writing(dst: str):
    """Keep readers (upload) out while DST is changed."""
    return _read_lock(dst, fcntl.LOCK_EX, f"an upload of it is in progress (it holds {STATE_DIR}/{READ_LOCK}): "
                                          "run again when the upload has finished")


class DstLock:
    """The lock over a DST's identity and its claims.

    ``__init__`` waits for ``identity.lock`` (exclusive): while it is held, run.json is read,
    compared and written and shards are claimed, so two runs started at once either agree on
    one identity (a job array: they cooperate) or the later one sees the other's and is
    refused. Every run then holds ``run.lock`` shared until it is done; ``alone`` (that lock
    exclusive, without waiting) tells whether any other run is using DST, which replacing it
    (--overwrite) or cleaning a killed run's temporaries needs.
    """

    def __init__(self, state: str):
        self._identity = lock_file(os.path.join(state, IDENTITY_LOCK))
        try:
            fcntl.flock(self._identity, fcntl.LOCK_EX)
            self._run = lock_file(os.path.join(state, RUN_LOCK))
        except BaseException:
            self._identity.close()
            raise

    def alone(self) -> bool:
        """True (now holding run.lock exclusively) when no other run uses DST."""
        return _flock(self._run, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def join(self) -> None:
        """Hold run.lock shared (from exclusive too), then let the next run check its identity."""
        fcntl.flock(self._run, fcntl.LOCK_SH)
        self._identity.close()

    def close(self) -> None:
        self._identity.close()
        self._run.close()
