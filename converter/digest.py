"""Shard digests that hash at the speed of many cores.

One SHA-256 stream runs at about 1.4 GB/s, slower than the conversion writes, so a shard's
digest is the SHA-256 of the SHA-256s of its consecutive 64 MiB chunks: each chunk is hashed
on its own thread as soon as its last byte is written (read back from the page cache), and
``k3convert verify`` recomputes it just as fast. The decision is in docs/decisions.md.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from .devices import cpus
from .safepath import open_regular

CHUNK = 64 << 20
ALGORITHM = "sha256 of the SHA-256s of consecutive 64 MiB chunks"
_pool: ThreadPoolExecutor | None = None
_threads = 0


def set_threads(cores: int) -> None:
    """Size the hashing threads to this process's share of the cores (a worker among many)."""
    global _threads
    _threads = cores


def threads_for(cores: int) -> int:
    """Hashing threads for a process with ``cores`` cores: half of them, 2 to 8."""
    return max(2, min(8, cores // 2))


def pool() -> ThreadPoolExecutor:
    """The process's hashing threads (hashlib releases the GIL on large buffers)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(threads_for(_threads or cpus()), "k3-hash")
    return _pool


def hash_range(fd: int, start: int, size: int) -> bytes:
    """SHA-256 of ``size`` bytes of the file at ``start`` (64 MiB aligned), hashed straight from
    the page cache through a mapping: no copy."""
    if size == 0:
        return hashlib.sha256(b"").digest()
    with mmap.mmap(fd, size, offset=start, access=mmap.ACCESS_READ) as view:
        return hashlib.sha256(view).digest()


def combine(chunks: list[bytes]) -> str:
    return hashlib.sha256(b"".join(chunks)).hexdigest()


def bytes_digest(data: bytes) -> str:
    """The digest ``file_digest`` gives a file holding ``data`` (a small file about to be written)."""
    view = memoryview(data)
    return combine([hashlib.sha256(view[s:s + CHUNK]).digest() for s in range(0, max(len(data), 1), CHUNK)])


def file_digest(path: str) -> str:
    """The digest of a whole file, its chunks hashed in parallel."""
    fd = open_regular(path)  # a FIFO planted as a shard is refused, not waited on for ever
    size = os.fstat(fd).st_size
    try:
        starts = range(0, max(size, 1), CHUNK)
        return combine(list(pool().map(lambda s: hash_range(fd, s, min(CHUNK, size - s)), starts)))
    finally:
        os.close(fd)


class ChunkHasher:
    """Hashes a file that is being written in any order: ``written`` reports each range, and
    a chunk is hashed (on the pool) once all its bytes are there. Thread-safe."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self._left = [min(CHUNK, size - s) for s in range(0, max(size, 1), CHUNK)]
        self._futures: list[Future | None] = [None] * len(self._left)
        self._lock = threading.Lock()
        if size == 0:
            self._submit(0)

    def _submit(self, i: int) -> None:
        self._futures[i] = pool().submit(hash_range, self.fd, i * CHUNK, min(CHUNK, self.size - i * CHUNK))

    def written(self, offset: int, size: int) -> None:
        with self._lock:
            while size > 0:
                i = offset // CHUNK
                n = min(size, (i + 1) * CHUNK - offset)
                self._left[i] -= n
                if self._left[i] == 0:
                    self._submit(i)
                offset, size = offset + n, size - n

    def digest(self) -> str:
        """Wait for every chunk (all bytes must have been written) and combine."""
        missing = [i for i, f in enumerate(self._futures) if f is None]
        if missing:
            raise RuntimeError(f"chunks {missing[:4]} were never completely written")
        return combine([f.result() for f in self._futures if f is not None])   # none is None: checked above

    def cancel(self) -> None:
        """Wait out chunk hashes in flight (their fd is about to close)."""
        for f in self._futures:
            if f is not None:
                f.cancel() or f.exception()


def sha256_of(path: str, chunk: int = 8 << 20, progress: Callable[[int], None] | None = None) -> str:
    """A file's SHA-256, as the Hub lists an LFS file's: a Hub source's identity (``hub.convert``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            h.update(data)
            if progress:
                progress(len(data))
    return h.hexdigest()
