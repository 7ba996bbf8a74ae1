"""The bytes ``upload`` publishes: each file read once, checked against the manifest, and
named by the SHA-256 the Hub will know it by (issue 32, T1 and T2).

One read of each file gives both the manifest's digest (``converter.digest``: the SHA-256 of
its 64 MiB chunks' SHA-256s) and the plain SHA-256 that a Hub commit names an LFS/Xet file
by; a file whose digest or size is not the manifest's is refused before anything is sent.
Files up to ``INLINE`` bytes are then sent from the very bytes read here (what the Hub
commits inline is read at commit time, so a path would let a later edit through); larger
ones are sent from their path, and the SHA-256 that huggingface_hub reports for what it
uploaded must equal the one checked here before the commit is made (``confirm``).
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import digest
from ..devices import cpus
from ..errors import ConvertError, VerifyFailed
from ..safepath import open_regular

INLINE = 16 << 20   # above the Hub's inline limit (10 MB): a larger file is always sent as LFS/Xet
READ = 8 << 20      # read size; divides digest.CHUNK


@dataclass(frozen=True)
class Checked:
    """One file as read for publishing."""

    path: str            # in DST and in the repository
    size: int
    sha256: str          # of the bytes read: the Hub's name for them (LFS oid)
    digest: str          # the manifest's digest of the same bytes
    data: bytes | None   # the bytes themselves, for a file of at most INLINE bytes


class _Hashes:
    """The manifest's chunked digest and the plain SHA-256 of a byte stream, fed in order."""

    def __init__(self) -> None:
        self.plain, self.chunk, self.in_chunk = hashlib.sha256(), hashlib.sha256(), 0
        self.chunks: list[bytes] = []

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        self.plain.update(view)
        while len(view):
            take = min(len(view), digest.CHUNK - self.in_chunk)
            self.chunk.update(view[:take])
            self.in_chunk += take
            view = view[take:]
            if self.in_chunk == digest.CHUNK:
                self.chunks.append(self.chunk.digest())
                self.chunk, self.in_chunk = hashlib.sha256(), 0

    def result(self) -> tuple[str, str]:
        """(the manifest's digest, the plain SHA-256). A last partial chunk counts, and an empty
        stream is one empty chunk, as ``digest.file_digest`` has it."""
        tail = [self.chunk.digest()] if self.in_chunk or not self.chunks else []
        return digest.combine(self.chunks + tail), self.plain.hexdigest()


class _Stopped(Exception):
    """The check was abandoned (an error elsewhere, Ctrl-C): stop reading."""


def read_file(dst: str, rel: str, stop: threading.Event | None = None) -> Checked:
    """``rel`` of DST read once (a FIFO or device refused, never waited on); ``stop`` set: abandon it."""
    fd = open_regular(os.path.join(dst, rel))
    hashes, kept, size = _Hashes(), [], 0
    try:
        inline = os.fstat(fd).st_size <= INLINE
        while block := os.read(fd, READ):
            if stop is not None and stop.is_set():
                raise _Stopped(rel)
            hashes.update(block)
            size += len(block)
            if inline:
                kept.append(block)
    finally:
        os.close(fd)
    chunked, plain = hashes.result()
    return Checked(rel, size, plain, chunked, b"".join(kept) if inline and size <= INLINE else None)


def of_bytes(rel: str, data: bytes) -> Checked:
    """A file upload holds in memory (the manifest it read, the card it wrote): sent as those bytes."""
    hashes = _Hashes()
    hashes.update(data)
    chunked, plain = hashes.result()
    return Checked(rel, len(data), plain, chunked, data)


def records(manifest: dict) -> dict[str, dict]:
    """Every file the manifest gives a size and digest: its shards and the files beside them."""
    out: dict[str, dict] = {}
    for key in ("files", "shards"):
        for name, rec in (manifest.get(key) or {}).items():
            if isinstance(name, str) and isinstance(rec, dict):
                out[name] = rec
    return out


def check(dst: str, names: Iterable[str], manifest: dict, in_memory: dict[str, bytes]) -> list[Checked]:
    """Read every file of ``names`` (each has a manifest record; ``in_memory`` ones are taken as
    given) and refuse (VerifyFailed, exit 5) unless every size and digest is the manifest's."""
    recs, names = records(manifest), sorted(names)
    unrecorded = [n for n in names if n not in recs and n not in in_memory]
    if unrecorded:
        raise VerifyFailed(f"no size and digest in the manifest for {', '.join(unrecorded)}: refusing to publish "
                           "bytes nothing can check", file=dst)
    on_disk = [n for n in names if n not in in_memory]
    pool, stop = ThreadPoolExecutor(max(1, min(digest.threads_for(cpus()), len(on_disk)))), threading.Event()
    try:
        read = dict(zip(on_disk, pool.map(lambda n: read_file(dst, n, stop), on_disk)))
    finally:  # on Ctrl-C or an error, the files not yet read are not waited for
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
    wrong = [f"{n}: {c.size} bytes, the manifest says {recs[n].get('bytes')}" if c.size != recs[n].get("bytes")
             else f"{n}: digest {c.digest} is not the manifest's {recs[n].get('digest')}"
             for n, c in read.items() if c.size != recs[n].get("bytes") or c.digest != recs[n].get("digest")]
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise VerifyFailed(f"{wrong[0]}{more}: changed since the conversion (bit rot, a faulty copy, an edit); "
                           "refusing to publish it", file=dst)
    return [read[n] if n in read else of_bytes(n, in_memory[n]) for n in names]


def operations(dst: str, checked: list[Checked]) -> list[Any]:
    """huggingface_hub's CommitOperationAdd for each file: the bytes read, or (a large file) its path."""
    from huggingface_hub import CommitOperationAdd

    return [CommitOperationAdd(path_in_repo=c.path,
                               path_or_fileobj=c.data if c.data is not None else os.path.join(dst, c.path))
            for c in checked]


def confirm(checked: list[Checked], ops: list[Any]) -> None:
    """After huggingface_hub uploaded the large files and before the commit names them: each is
    the bytes checked, by the SHA-256 huggingface_hub computed of what it sent (hf_xet hashes
    while it uploads; without hf_xet huggingface_hub hashes the file just before sending it).
    A file sent from its path that the Hub would commit inline is refused too: that commit
    would read the file again."""
    for c, op in zip(checked, ops):
        if c.data is not None or getattr(op, "_should_ignore", False):
            continue
        if getattr(op, "_upload_mode", "lfs") != "lfs":
            raise ConvertError(f"{c.path}: the Hub would commit it inline ({c.size} bytes), reading it again at "
                               "commit time: refusing to publish bytes that were not checked")
        info = op.upload_info
        sent = info.sha256.hex() if getattr(info, "is_hashed", True) else None
        if sent != c.sha256:
            raise VerifyFailed(f"{c.path}: changed while it was uploaded (SHA-256 {sent} sent, {c.sha256} checked "
                               "against the manifest): nothing was committed; find what writes to DST, then run "
                               "the same command again")
