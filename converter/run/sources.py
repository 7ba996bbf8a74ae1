"""The identity of a source, the same on every node, mount and reboot (docs/decisions.md).

What must match for a run to continue a DST (``run.json``) is what the files hold, never where
they sit: per shard its size, mtime and a hash of its first and last MiB (``file_fingerprint``),
and config.json's whole content. An in-place edit that restores the mtime keeps all of that, so
the shard's converter also records a digest of every byte it read (``content_digest`` of its
own shard, ``ranges_digest`` of the scales it read from partner shards). Those are recomputed
only when a cheap hint says a file may have been written since it was recorded: its inode and
ctime (``hint``), which every write and every ``utime`` move, and which a shared file system
reports alike on every node (st_dev, which differs per node and mount, is not used). A moved
hint whose content still matches (``cp -al``, a chmod) is harmless: the hints are updated.
"""
from __future__ import annotations

import hashlib
import os
import zlib
from typing import Any, Iterable, Mapping

from .. import digest, profiles
from ..errors import OutputError
from ..safepath import open_regular
from ..state.records import file_fingerprint

PIECE = 1 << 20  # bytes per CRC-32: a change is missed only if every changed MiB keeps its CRC
ALGORITHM = "sha256 of the CRC-32s of consecutive 1 MiB pieces"
Hint = int | str | None   # a hint's values: inode and ctime numbers, or a known file's SHA-256


def _chunk_crcs(fd: int, start: int, size: int) -> bytes:
    """The CRC-32s (zlib: ~6 GB/s a core, the GIL released) of the 1 MiB pieces of a file's
    ``size`` bytes at ``start``, read into one 1 MiB buffer: a mapping would add up to a chunk of
    file pages to the worker's resident memory per digest thread."""
    buf = memoryview(bytearray(PIECE))
    out = []
    for s in range(start, start + size, PIECE):
        n = os.preadv(fd, [buf[:min(PIECE, start + size - s)]], s)
        out.append(zlib.crc32(buf[:n]).to_bytes(4, "little"))
    return b"".join(out)


def _unreadable(path: str, e: OSError) -> OutputError:
    return OutputError(f"cannot read: {e.strerror}", file=path)


class _Hashing:
    """A whole file being hashed on the digest threads: ``result`` waits and gives the digest,
    ``cancel`` drops what has not started; either one closes the file."""

    def __init__(self, path: str):
        self.path, self.fd = path, open_regular(path)
        try:
            self.size = os.fstat(self.fd).st_size
            self.futures = [digest.pool().submit(_chunk_crcs, self.fd, s, min(digest.CHUNK, self.size - s))
                            for s in range(0, self.size, digest.CHUNK)]
        except BaseException:
            os.close(self.fd)
            raise

    def result(self) -> str:
        try:
            h = hashlib.sha256(self.size.to_bytes(8, "little"))
            for f in self.futures:
                h.update(f.result())
            return h.hexdigest()
        except OSError as e:
            raise _unreadable(self.path, e) from None
        finally:
            self.cancel()

    def cancel(self) -> None:
        if self.fd < 0:
            return
        for f in self.futures:
            f.cancel() or f.exception()  # a chunk in flight still maps the fd
        os.close(self.fd)
        self.fd = -1


def start_content_digest(path: str) -> _Hashing:
    """Start hashing a whole file on the digest threads (``digest.pool``). A worker starts it with
    the shard's conversion, which reads the same bytes: they are hashed from the page cache while
    the shard converts, on threads that release the GIL."""
    return _Hashing(path)


def content_digest(path: str) -> str:
    """The digest ``start_content_digest`` gives for the file as it is now."""
    return _Hashing(path).result()


def ranges_digest(path: str, ranges: Iterable[tuple[int, int]]) -> str:
    """A digest of the bytes at ``ranges`` (start, size) of a file, in that order: what a shard's
    conversion read from a partner shard (scales of its modules)."""
    h = hashlib.sha256()
    try:
        fd = open_regular(path)
        try:
            for start, size in ranges:
                data = os.pread(fd, size, start)
                h.update(len(data).to_bytes(8, "little") + data)
        finally:
            os.close(fd)
    except OSError as e:
        raise _unreadable(path, e) from None
    return h.hexdigest()


def config_identity(path: str) -> dict[str, Any]:
    """config.json's identity: its whole content (a few kB)."""
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _unreadable(path, e) from None
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# Files whose identity is known from where they came, not read from disk: a Hub commit's shards,
# by their LFS SHA-256 (converter.hub.convert, ``know``). The same before a shard is fetched, while
# it is on disk, and after its converted source is removed: a resume compares like with like.
_KNOWN: dict[str, dict[str, Any]] = {}


def know(path: str, identity: Mapping[str, Any]) -> None:
    """Record a file's identity as known (``shard_identity``, ``hint`` give it from now on)."""
    _KNOWN[os.path.abspath(path)] = dict(identity)


def shard_identity(path: str) -> dict[str, Any]:
    """A source shard's identity: size, mtime, first and last MiB (the same on every node); or,
    where it is known (``know``), that."""
    known = _KNOWN.get(os.path.abspath(path))
    return dict(known) if known is not None else file_fingerprint(path)


def hint(path: str) -> dict[str, Hint]:
    """What moves when a file is written or its mtime put back (inode, ctime), for deciding
    whether its content must be re-read; never part of the identity. A known file (``know``): its
    SHA-256, checked when it was fetched."""
    if (known := _KNOWN.get(os.path.abspath(path))) is not None:
        return {"sha256": known.get("sha256")}
    try:
        st = os.stat(path)
    except OSError as e:
        raise _unreadable(path, e) from None
    return {"inode": st.st_ino, "ctime_ns": st.st_ctime_ns}


def partner_ranges(shard) -> dict[str, list[tuple[int, int]]]:
    """Per partner shard (name), the byte ranges a shard's conversion reads from it: the scale
    tensors of its modules that sit there (``plan.ShardPlan``)."""
    root = shard.path[: len(shard.path) - len(shard.name)]  # SRC/ (a shard's name may hold a folder)
    out: dict[str, list[tuple[int, int]]] = {}
    for c in (*shard.pairs, *shard.fp8_dequants):   # the FP8 linears written as bf16 read their scales too
        for t in c.tensors:   # an NVFP4 module's global scale too (items.Nvfp4Convert)
            if t.path != shard.path:
                out.setdefault(t.path[len(root):], []).append((t.start, t.nbytes))
    return out


def read_digests(shard) -> dict[str, Any]:
    """What a finished shard's record holds about the source bytes it was made from: its own
    shard's ``content_digest`` is added by the worker; the partner ranges are hashed here."""
    root = shard.path[: len(shard.path) - len(shard.name)]
    return {"partner_digests": {name: ranges_digest(root + name, r) for name, r in partner_ranges(shard).items()}}


def content_change(shards: list, records: Mapping[str, dict | None], hints: Mapping[str, Any]
                   ) -> tuple[str | None, dict[str, dict[str, Hint]]]:
    """Whether a source file DST depends on has other content than when it was converted, though
    its identity matches: (what changed in words, or None; the hints now).

    Only the files whose hint moved since ``hints`` were recorded are read again: a finished
    shard's own file (its recorded ``source_digest``) and the partner ranges it read.
    """
    now = {s.name: hint(s.path) for s in shards}
    moved = {n for n, h in now.items() if hints.get(n) != h}
    if not moved:
        return None, now
    by_name = {s.name: s for s in shards}
    for s in shards:
        rec = records.get(s.name)
        if not rec:
            continue  # not converted yet: it will be read as it is now
        if s.name in moved and rec.get("source_digest") != content_digest(s.path):
            return f"source files changed: {s.name} changed", now
        ranges = partner_ranges(s)
        for name, want in sorted((rec.get("partner_digests") or {}).items()):
            if name in moved and (name not in by_name or name not in ranges
                                  or ranges_digest(by_name[name].path, ranges[name]) != want):
                return f"source files changed: {name} changed", now
        if set(ranges) - set(rec.get("partner_digests") or {}):
            return f"source files changed: {s.name} reads other partners", now
    return None, now


def profile_identity(name: "str | profiles.Profile | None") -> dict[str, str] | None:
    """``--profile`` as the run records it: what the profile is (its name and the SHA-256 of its
    file), so that a relative path given from another directory, or a name instead of the bundled
    file's path, is the same profile; where it was found (``file``), and its text (``toml``), from
    which a standalone ``finalize`` or ``verify --source`` rebuilds it wherever the file went since
    (neither compared: the SHA-256 is the profile)."""
    if not name:
        return None
    p = profiles.named(name)  # BadInput naming the file or the known names
    return {"name": p.name, "sha256": hashlib.sha256(p.text.encode()).hexdigest(), "file": os.path.abspath(p.path),
            "toml": p.text}


def profile_argument(recorded: Any) -> "str | profiles.Profile | None":
    """The ``--profile`` that rebuilds a recorded run's plan: the recorded text (``toml``) where its
    SHA-256 is the recorded one, so that a profile file moved, removed or edited since is the profile
    the run used (issue 40); else, for a run recorded before the text was, the file."""
    if not isinstance(recorded, dict):
        return recorded
    text, where = recorded.get("toml"), recorded.get("file")
    if isinstance(text, str) and hashlib.sha256(text.encode()).hexdigest() == recorded.get("sha256"):
        return profiles.parse(text, where if isinstance(where, str) else f"{recorded.get('name')}.toml")
    return where
