"""Names read from files are untrusted: nothing outside SRC is read, nothing outside DST written.

A shard name in ``model.safetensors.index.json`` (or a tensor name, or a config value) is
data an attacker may control: ``../evil.safetensors`` or ``/etc/passwd`` must never become a
path. Shard names must be plain file names; every file read from SRC must resolve inside SRC
(a symlink out of it is refused, except a Hugging Face cache snapshot's links into its own
``blobs/`` folder); every file written to DST must resolve inside DST.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import IO

from .errors import BadInput, OutputError


def plain_name(name: object, where: str) -> str:
    """``name`` if it is a plain file name (no folder, no ``..``, nothing hidden), else BadInput.

    Control characters (NUL, newline), lone surrogates and other unprintables are refused too:
    no real shard has them, and they would break the one-line error or the file system call."""
    if not isinstance(name, str) or not name or name in (".", "..") or name.startswith(".") \
            or "/" in name or "\\" in name or not name.isprintable() or os.path.isabs(name):
        raise BadInput(f"names shard {name!r}: a shard must be a plain file name inside the checkpoint "
                       "directory (no folders, '..' or absolute paths)", file=where)
    return name


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def source_roots(src: str) -> tuple[str, ...]:
    """Where files of SRC may really live: SRC, and for a Hugging Face cache snapshot
    (``models--org--name/snapshots/REV``) the repository's ``blobs`` folder its links point to."""
    real = os.path.realpath(src)
    roots = [real]
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        roots.append(os.path.join(repo, "blobs"))
    return tuple(roots)


def source_file(src: str, rel: str, roots: tuple[str, ...] | None = None) -> str:
    """The path of ``rel`` inside SRC, refused (BadInput) if it resolves outside SRC."""
    path = os.path.join(src, rel)
    real = os.path.realpath(path)
    if not any(_within(real, r) for r in roots or source_roots(src)):
        raise BadInput(f"resolves to {real}, outside the checkpoint directory: refusing to read it", file=path)
    return path


def dest_file(dst: str, rel: str) -> str:
    """The path of ``rel`` inside DST, refused (OutputError) if it or its folder leads outside DST
    (a planted symlink, a ``..``)."""
    root = os.path.realpath(dst)
    path = os.path.join(dst, rel)
    parent = os.path.realpath(os.path.dirname(path))
    if os.path.isabs(rel) or not _within(parent, root) or os.path.islink(path):
        raise OutputError(f"{rel!r} would be written outside DST or through a link: refusing", file=dst)
    return path


def new_folder(path: str, why: str) -> None:
    """Create the folder ``path``, or accept it empty; anything in it is refused (OutputError
    naming it and ``why``): what is written there must not land on top of someone's files."""
    try:
        os.makedirs(path, exist_ok=True)
        there = sorted(os.listdir(path))
    except OSError as e:
        raise OutputError(f"cannot create the folder: {e.strerror}", file=path) from None
    if there:
        raise OutputError(f"exists and is not empty ({len(there)} entries, e.g. {there[0]!r}): {why}", file=path)


def fresh_file(path: str) -> int:
    """Create ``path`` (a temporary in DST) as a new file; returns its descriptor for writing.

    Whatever a previous run or someone else left under that name (a symlink, a hard link to a
    file outside DST) is unlinked first and O_EXCL makes a new inode, so nothing is written
    through it."""
    try:
        if os.path.lexists(path):
            os.unlink(path)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise OutputError(f"cannot create: {e.strerror}", file=path) from None


def lock_file(path: str) -> IO[str]:
    """Open (creating) a lock file in DST's state folder, never through a symlink."""
    try:
        return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "a+")
    except OSError as e:
        raise OutputError(f"cannot open lock file ({e.strerror}; a symlink is refused)", file=path) from None


def try_lock(path: str) -> IO[str] | None:
    """The existing lock file ``path`` locked exclusively without waiting (the open file: closing it
    lets go), or None where another process holds it. Never created, never through a symlink; opened
    read-only where it cannot be written (another user's). OSError where it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    f = os.fdopen(fd, "r")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    except BaseException:
        f.close()
        raise
    return f


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words, for one-line errors."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def regular_problem(path: str) -> str | None:
    """Why ``path`` (links followed) cannot be read as a shard, index or side file, or None.
    Only the mode is looked at: a FIFO is never opened (that would wait for a writer)."""
    try:
        st = os.stat(path)
    except OSError as e:
        return e.strerror
    if not stat.S_ISREG(st.st_mode):
        return f"is {file_kind(st.st_mode)}, not a regular file: refusing to read it"
    return None


def open_regular(path: str, missing_ok: bool = False) -> int:
    """Open ``path`` for reading only if it is a regular file; returns the descriptor.

    A FIFO would block the open (and every read) for ever and a character device would
    stream without end, so the open does not wait (O_NONBLOCK), the kind is checked on the
    descriptor itself (no window between check and open), and anything else is refused
    with BadInput naming what it is. ``missing_ok``: a missing file raises FileNotFoundError
    (for callers to whom absent is an answer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if missing_ok and isinstance(e, FileNotFoundError):
            raise
        raise BadInput(f"cannot read: {e.strerror}", file=path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise BadInput(f"is {file_kind(mode)}, not a regular file: refusing to read it", file=path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str) -> bytes:
    """A regular file's bytes (``open_regular``: a FIFO or device is refused, never waited on)."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read()


def _ids(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _chain(path: str) -> list[tuple[int, int]]:
    """(device, inode) of ``path`` and every existing folder above it, physically (links
    resolved first, so ``..`` means the real parent)."""
    out, p = [], os.path.realpath(path)
    while True:
        ids = _ids(p)
        if ids is not None:
            out.append(ids)
        up = os.path.dirname(p)
        if up == p:
            return out
        p = up


def contains(outer: str, inner: str) -> bool:
    """True when ``inner`` is ``outer`` or lies inside it, compared by device and inode, so
    that no alias (a symlink, a bind mount, a second mount of the file system) hides it."""
    ids = _ids(outer)
    return ids is not None and ids in _chain(inner)
