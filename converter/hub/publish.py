"""The bytes ``upload`` publishes: each file read once, checked against the manifest, and
named by the SHA-256 the Hub will know it by (issue 32, T1 and T2; issue 40, H6).

One read of each file gives both the manifest's digest (``converter.digest``: the SHA-256 of
its 64 MiB chunks' SHA-256s) and the plain SHA-256 that a Hub commit names an LFS/Xet file
by; a file whose digest or size is not the manifest's is refused before anything is sent.
Files up to ``INLINE`` bytes are then sent from the very bytes read here (what the Hub
commits inline is read at commit time, so a path would let a later edit through). A larger
file is read again while it is sent, so what is sent must be proven to be what was checked:

- by the LFS protocol (hf_xet not installed, or ``HF_HUB_DISABLE_XET``), huggingface_hub reads
  a ``Sent``: every byte it hands out is first proven to be the checked byte (its ``BLOCK`` is
  read and its SHA-256 compared with the one the check recorded), so an edit, a truncation or a
  retry's re-read can never send other bytes under the checked SHA-256 (huggingface_hub would
  otherwise hash the path, then read the path again to send it);
- by Xet, hf_xet reads the path itself and hashes what it reads as it sends it; the SHA-256 it
  reports must equal the checked one (``confirm``) before the commit is made.
"""
from __future__ import annotations

import hashlib
import io
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
BLOCK = READ        # the unit a byte about to be sent is proven in: one SHA-256 per 8 MiB (32 B per 8 MiB)


@dataclass(frozen=True)
class Checked:
    """One file as read for publishing."""

    path: str            # in DST and in the repository
    size: int
    sha256: str          # of the bytes read: the Hub's name for them (LFS oid)
    digest: str          # the manifest's digest of the same bytes
    data: bytes | None   # the bytes themselves, for a file of at most INLINE bytes
    blocks: tuple[bytes, ...] = ()   # a larger file: the SHA-256 of each BLOCK of the bytes read


class _Pieces:
    """The SHA-256 of each ``size``-byte piece of a stream fed in order (the last may be shorter)."""

    def __init__(self, size: int) -> None:
        self.size, self.hash, self.filled = size, hashlib.sha256(), 0
        self.done: list[bytes] = []

    def update(self, view: memoryview) -> None:
        while len(view):
            take = min(len(view), self.size - self.filled)
            self.hash.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == self.size:
                self.done.append(self.hash.digest())
                self.hash, self.filled = hashlib.sha256(), 0

    def result(self) -> list[bytes]:
        """Every piece's digest: a last partial piece counts, and an empty stream is one empty piece."""
        return self.done + ([self.hash.digest()] if self.filled or not self.done else [])


class _Hashes:
    """The manifest's chunked digest, the plain SHA-256 and (``blocks``) the per-BLOCK SHA-256s of a
    byte stream, fed in order."""

    def __init__(self, blocks: bool = False) -> None:
        self.plain, self.chunks = hashlib.sha256(), _Pieces(digest.CHUNK)
        self.blocks = _Pieces(BLOCK) if blocks else None

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        self.plain.update(view)
        self.chunks.update(view)
        if self.blocks is not None:
            self.blocks.update(view)

    def result(self) -> tuple[str, str, tuple[bytes, ...]]:
        """(the manifest's digest, as ``digest.file_digest`` has it; the plain SHA-256; the block digests)."""
        return (digest.combine(self.chunks.result()), self.plain.hexdigest(),
                tuple(self.blocks.result()) if self.blocks is not None else ())


class _Stopped(Exception):
    """The check was abandoned (an error elsewhere, Ctrl-C): stop reading."""


def read_file(dst: str, rel: str, stop: threading.Event | None = None) -> Checked:
    """``rel`` of DST read once (a FIFO or device refused, never waited on); ``stop`` set: abandon it."""
    fd = open_regular(os.path.join(dst, rel))
    hashes, kept, size = _Hashes(blocks=True), [], 0
    try:
        while block := os.read(fd, READ):
            if stop is not None and stop.is_set():
                raise _Stopped(rel)
            hashes.update(block)
            size += len(block)
            if size <= INLINE:
                kept.append(block)
    finally:
        os.close(fd)
    chunked, plain, blocks = hashes.result()
    if size <= INLINE:
        return Checked(rel, size, plain, chunked, b"".join(kept))
    return Checked(rel, size, plain, chunked, None, blocks)


def of_bytes(rel: str, data: bytes) -> Checked:
    """A file upload holds in memory (the manifest it read, the card it wrote): sent as those bytes."""
    hashes = _Hashes()
    hashes.update(data)
    chunked, plain, _ = hashes.result()
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


def changed_while_sent(path: str, how: str) -> VerifyFailed:
    return VerifyFailed(f"{path}: changed while it was uploaded ({how}): nothing was committed; find what writes "
                        "to DST, then run the same command again")


class Changed(Exception):
    """A byte about to be sent is not the byte checked (not an OSError: nothing retries it as the network's)."""


class Sent(io.BufferedIOBase):
    """A large checked file as huggingface_hub reads it to send it by LFS (whole, in parts, again on a
    retry): each read is served from whole BLOCKs read from the file and proven, by their SHA-256,
    to be the checked ones; any other byte stops the send (``Changed``, recorded in ``changed``).
    One block is kept between reads; a seek drops it."""

    def __init__(self, dst: str, checked: Checked) -> None:
        super().__init__()
        self.checked, self.pos = checked, 0
        self.changed: str | None = None
        self._fd = open_regular(os.path.join(dst, checked.path))
        self._block: tuple[int, bytes] = (-1, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.checked.size}[whence]
        self.pos = max(0, base + offset)
        self._block = (-1, b"")  # a new pass (a part, a retry) reads the file again, proving it again
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self.checked.size - self.pos)
        n = left if n is None or n < 0 else min(n, left)
        out = []
        while n > 0:
            index, at = divmod(self.pos, BLOCK)
            piece = self._proven(index)[at: at + n]
            out.append(piece)
            self.pos += len(piece)
            n -= len(piece)
        return b"".join(out)

    read1 = read

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _proven(self, index: int) -> bytes:
        """Block ``index`` as the file holds it now, if it is the block checked; else ``Changed``."""
        if self._block[0] == index:
            return self._block[1]
        start = index * BLOCK
        want = min(BLOCK, self.checked.size - start)
        data = b""
        while len(data) < want and (more := os.pread(self._fd, want - len(data), start + len(data))):
            data += more
        if len(data) != want or hashlib.sha256(data).digest() != self.checked.blocks[index]:
            self.changed = (f"bytes {start}-{start + want - 1} are not the ones checked" if len(data) == want
                            else f"{start + len(data)} bytes long now, {self.checked.size} checked")
            raise Changed(f"{self.checked.path}: {self.changed}")
        self._block = (index, data)
        return data

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


@dataclass
class Sending:
    """The operations of one commit, and the ``Sent`` files they read (closed by ``close``)."""

    ops: list[Any]
    sent: list[Sent]

    def raise_if_changed(self) -> None:
        """VerifyFailed naming the first file whose bytes were found changed while being sent."""
        for s in self.sent:
            if s.changed:
                raise changed_while_sent(s.checked.path, s.changed)

    def close(self) -> None:
        for s in self.sent:
            s.close()


def operations(dst: str, checked: list[Checked], xet: bool) -> Sending:
    """huggingface_hub's CommitOperationAdd for each file: the bytes read; a large file from its path
    (``xet``: hf_xet hashes what it reads as it sends) or as a ``Sent`` named by the checked SHA-256."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.lfs import UploadInfo

    ops, sent = [], []
    try:
        for c in checked:
            if c.data is not None or xet:
                ops.append(CommitOperationAdd(path_in_repo=c.path, path_or_fileobj=c.data if c.data is not None
                                              else os.path.join(dst, c.path)))
                continue
            # made from empty bytes, then given the file: made from a file object, huggingface_hub would read it
            # all to hash it; the checked SHA-256 is what every byte sent is proven against
            op = CommitOperationAdd(path_in_repo=c.path, path_or_fileobj=b"")
            s = Sent(dst, c)
            sent.append(s)
            sample = s.read(512)
            s.seek(0)
            op.path_or_fileobj = s  # type: ignore[assignment]  # an io.BufferedIOBase, as huggingface_hub takes
            op.upload_info = UploadInfo(size=c.size, sample=sample, sha256=bytes.fromhex(c.sha256))
            ops.append(op)
    except BaseException:
        Sending(ops, sent).close()
        raise
    return Sending(ops, sent)


def confirm(checked: list[Checked], sending: Sending) -> None:
    """After huggingface_hub uploaded the large files and before the commit names them: no file sent
    as a ``Sent`` was found changed, and each sent from its path (Xet) is the bytes checked, by the
    SHA-256 hf_xet computed of what it read as it sent it. A file sent from its path that the Hub
    would commit inline is refused too: that commit would read the file again."""
    sending.raise_if_changed()
    for c, op in zip(checked, sending.ops):
        if c.data is not None or isinstance(op.path_or_fileobj, Sent) or getattr(op, "_should_ignore", False):
            continue
        if getattr(op, "_upload_mode", "lfs") != "lfs":
            raise ConvertError(f"{c.path}: the Hub would commit it inline ({c.size} bytes), reading it again at "
                               "commit time: refusing to publish bytes that were not checked")
        info = op.upload_info
        sent = info.sha256.hex() if getattr(info, "is_hashed", True) else None
        if sent != c.sha256:
            raise changed_while_sent(c.path, f"SHA-256 {sent} sent, {c.sha256} checked against the manifest")
