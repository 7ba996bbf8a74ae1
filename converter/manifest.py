"""The conversion manifest and the files beside it: what makes a DST complete and resumable.

Every file here is replaced atomically (write, fsync, rename), so a kill at any moment
leaves either the old or the new version. DST is complete exactly when the manifest says
``complete: true``, and that is written last.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
from typing import Any, BinaryIO, Callable, Collection, Iterable

import zstandard

from .errors import OutputError
from .formats import json_input
from .safepath import fresh_file, lock_file, open_regular

MANIFEST = "k3convert_manifest.json"
REPORT = "k3convert_report.json"            # per-layer error summary, written by finalize
TENSOR_TABLE = "k3convert_tensors.jsonl.zst"  # every converted tensor's figures
STATE_DIR = ".k3convert"  # per-shard figure tables and the lock, inside DST


def discard(path: str) -> None:
    """Remove a file if it is there (a temporary being cleaned up): never raises."""
    try:
        os.unlink(path)
    except OSError:
        pass


def temp_name(path: str) -> str:
    """This process's temporary for ``path``: unique among concurrent runs, recognisable
    (``*.tmpPID``) for the upload filter and for the clean-up of a run that was killed."""
    return f"{path}.tmp{os.getpid()}"


def stage(path: str, data: bytes) -> str:
    """Write ``data`` to a fresh temporary beside ``path`` and fsync it; returns the temporary.

    Every coordinator write goes through here (or ``stage_copy``): an OSError (ENOSPC, EIO, no
    inodes) becomes an OutputError naming ``path`` (exit 4) and leaves no temporary behind."""
    return _staged(path, lambda f: f.write(data))


def stage_copy(src_path: str, path: str) -> str:
    """Copy a (regular) source file to a fresh temporary beside ``path``, fsynced; as ``stage``.
    A read error names the source file, a write error ``path``. The copy gets the source's
    mtime, so that a rerun can tell it is already there (``copy_current``)."""
    def fill(w) -> None:
        with os.fdopen(open_regular(src_path), "rb") as r:  # BadInput for a FIFO or device
            while True:
                try:
                    buf = r.read(1 << 24)
                except OSError as e:
                    raise OutputError(f"cannot read: {e.strerror}", file=src_path) from None
                if not buf:
                    break
                w.write(buf)
            w.flush()  # before the mtime is set: a later write would change it
            st = os.fstat(r.fileno())
            os.utime(w.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))
    return _staged(path, fill)


def copy_current(src_path: str, path: str) -> bool:
    """Whether ``path`` already is ``stage_copy``'s copy of ``src_path``: a regular file of the
    same size and mtime. A source that cannot be looked at is an OutputError naming it."""
    try:
        st = os.stat(src_path)
    except OSError as e:
        raise OutputError(f"cannot read: {e.strerror}", file=src_path) from None
    try:
        out = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(out.st_mode) and (out.st_size, out.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def _staged(path: str, fill: Callable[[BinaryIO], None]) -> str:
    tmp = temp_name(path)
    fd = fresh_file(tmp)  # OutputError itself
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        discard(tmp)
        raise OutputError(f"cannot write: {e.strerror}", file=path) from None
    except BaseException:
        discard(tmp)
        raise
    return tmp


def commit(staged: list[tuple[str, str]], undo: Collection[str] = ()) -> int:
    """Rename staged temporaries to their names, in order; returns how many were renamed (all).

    A failure removes every temporary not yet renamed, and of the files already renamed
    exactly those named in ``undo`` (what must not outlive a failed manifest), then raises
    (OutputError naming the file)."""
    done = 0
    try:
        for tmp, path in staged:
            try:
                os.replace(tmp, path)
            except OSError as e:
                raise OutputError(f"cannot write: {e.strerror}", file=path) from None
            done += 1
    except BaseException:
        for tmp, _ in staged[done:]:
            discard(tmp)
        for _, path in staged[:done]:
            if path in undo:
                discard(path)
        raise
    sync_folders(os.path.dirname(path) for _, path in staged)
    return done


def sync_folders(folders: Iterable[str]) -> None:
    """Make renames into ``folders`` durable: a rename is a change of its folder, which the
    files' own fsync does not write; without this a power loss right after "complete" (the
    process then leaves through ``os._exit``) can leave DST without its manifest (T16). Each
    folder once, in the order given (the manifest's, DST, last)."""
    seen: list[str] = []
    for d in folders:
        d = d or "."
        if d in seen:
            seen.remove(d)
        seen.append(d)
    for d in seen:
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise OutputError(f"cannot open the folder to sync it: {e.strerror}", file=d) from None
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # a file system without directory fsync
                raise OutputError(f"cannot sync the folder: {e.strerror}", file=d) from None
        finally:
            os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` by ``data``: a kill leaves the old or the new file, an error neither a
    temporary nor a half-written file (OutputError, exit 4)."""
    commit([(stage(path, data), path)])


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()


def write_json(path: str, obj: Any) -> None:
    atomic_write(path, json_bytes(obj))


def read_json(path: str) -> dict | None:
    """A DST JSON file (numbers bounded: formats.json_input; Infinity as our writer spells it), None
    when absent."""
    try:
        return json_input.load_file(path, constants=True)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise OutputError("is corrupt: remove it, or run with --overwrite", file=path) from None


def file_fingerprint(path: str, edge: int = 1 << 20) -> dict[str, Any]:
    """Cheap identity of a source file: size, mtime, and a hash of its first and last MiB."""
    h = hashlib.blake2b(digest_size=16)
    fd = open_regular(path)  # a FIFO is refused, not waited on
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            h.update(f.read(edge))
            if st.st_size > edge:
                f.seek(max(edge, st.st_size - edge))
                h.update(f.read(edge))
    except OSError as e:  # EIO: one line naming the file (exit 4), not a traceback
        raise OutputError(f"cannot read: {e.strerror}", file=path) from None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "edge_blake2b": h.hexdigest()}


def rows_bytes(rows: list[dict]) -> bytes:
    """A figure table as zstd-compressed JSON lines: ~10x smaller for 250k tensors."""
    raw = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
    return zstandard.ZstdCompressor(level=9).compress(raw)


def write_rows(path: str, rows: list[dict]) -> None:
    atomic_write(path, rows_bytes(rows))


def read_rows(path: str) -> list[dict]:
    with open(path, "rb") as f:
        raw = zstandard.ZstdDecompressor().decompress(f.read())
    return [json.loads(line) for line in raw.splitlines() if line]


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
    against the manifest (converter.publish), lock or not."""
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
