"""Names read from files are untrusted: nothing outside SRC is read, nothing outside DST written.

A shard name in ``model.safetensors.index.json`` (or a tensor name, or a config value) is
data an attacker may control: ``../evil.safetensors`` or ``/etc/passwd`` must never become a
path. Shard names must be plain file names; every file read from SRC must resolve inside SRC
(a symlink out of it is refused, except a Hugging Face cache snapshot's links into its own
``blobs/`` folder); every file written to DST must resolve inside DST.
"""
from __future__ import annotations

import os
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
