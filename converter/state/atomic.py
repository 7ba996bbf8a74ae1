"""Atomic replacement of DST's files: stage beside the target, fsync, rename, fsync the folder.

A kill leaves the old or the new file; an error leaves neither a temporary nor a half-written file
(OutputError, exit 4).
"""
from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO, Callable, Collection, Iterable

from ..errors import OutputError
from ..safepath import fresh_file, open_regular


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


def _staged(path: str, fill: Callable[[BinaryIO], object]) -> str:
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
