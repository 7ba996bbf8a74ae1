"""Read safetensors headers without trusting them, and write shards as a stream.

We parse the header ourselves (rather than through ``safe_open``) to check it against the
file before any work starts, and we write with the header computed up front, so a shard of
any size is produced with memory bounded by one batch of tensors.
"""
from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import BadInput

DTYPE_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors limit


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_header(path: str | os.PathLike) -> Header:
    """Parse and check a shard's header: JSON, dtypes, offsets, and the file's length."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadInput("file is shorter than a safetensors header", file=path)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise BadInput(f"header length {n} does not fit a file of {size} bytes (truncated?)", file=path)
            raw = f.read(n)
    except OSError as e:
        raise BadInput(f"cannot read: {e.strerror}", file=path) from None
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"corrupt header JSON ({e})", file=path) from None
    if not isinstance(obj, dict):
        raise BadInput("header is not a JSON object", file=path)
    metadata = obj.pop("__metadata__", None) or {}
    data_start = 8 + n
    tensors = {}
    for name, t in obj.items():
        try:
            dtype, shape, (b, e) = t["dtype"], tuple(int(d) for d in t["shape"]), t["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise BadInput("malformed header entry", file=path, tensor=name) from None
        if dtype not in DTYPE_SIZE:
            raise BadInput(f"unknown dtype {dtype!r}", file=path, tensor=name)
        if e - b != numel(shape) * DTYPE_SIZE[dtype] or b < 0:
            raise BadInput(f"data_offsets {b}..{e} do not match {dtype}{list(shape)}", file=path, tensor=name)
        if data_start + e > size:
            raise BadInput(
                f"data ends at byte {data_start + e} but the file has {size} bytes (truncated)",
                file=path, tensor=name)
        tensors[name] = TensorInfo(name, dtype, shape, data_start + b, data_start + e)
    return Header(path, tensors, {str(k): str(v) for k, v in metadata.items()}, data_start, size)


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_SIZE[self.dtype]


@dataclass
class Layout:
    """A shard's header, fixed before any data is written; tensors in data order."""

    tensors: list[OutTensor]
    metadata: dict[str, str]
    header: bytes = field(init=False)
    offsets: dict[str, tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        entries, pos, offsets = {}, 0, {}
        for t in self.tensors:
            offsets[t.name] = (pos, pos + t.nbytes)
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        obj = {"__metadata__": dict(sorted(self.metadata.items())), **dict(sorted(entries.items()))}
        raw = json.dumps(obj, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the safetensors writer aligns data to 8 bytes
        self.header = struct.pack("<Q", len(raw)) + raw
        self.offsets = offsets

    @property
    def data_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_size(self) -> int:
        return len(self.header) + self.data_size


_HASHER = ThreadPoolExecutor(1, "k3-sha256")
_SYNCER = ThreadPoolExecutor(1, "k3-fdatasync")
SYNC_EVERY = 256 << 20  # start flushing to disk while writing, so close() has little left


class ShardWriter:
    """Writes a Layout's tensors in order to ``<path>.partial``, then fsyncs and renames.

    Each tensor may arrive in several pieces; every piece is checked against the layout, so
    the file is complete exactly when ``close`` renames it. The SHA-256 of the whole file
    (the Hub's LFS object id) is computed on the way.
    """

    def __init__(self, path: str | os.PathLike, layout: Layout):
        import hashlib

        self.path = os.fspath(path)
        self.tmp = self.path + ".partial"
        self.layout = layout
        self._next = 0       # index of the tensor being written
        self._done = 0       # its bytes written so far
        self._hash = hashlib.sha256()
        self._unsynced = 0
        self._sync = None
        self._f = None
        try:
            self._f = open(self.tmp, "wb", buffering=0)
            self._write(layout.header)
        except BaseException:  # ENOSPC on the first bytes, Ctrl-C: leave no .partial behind
            self.abort()
            raise

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        # hash on a second thread while this one writes: both release the GIL, so a piece
        # costs max(hash, write) rather than their sum
        hashed = _HASHER.submit(self._hash.update, view) if view.nbytes >= 1 << 20 else None
        if hashed is None:
            self._hash.update(view)
        self._unsynced += view.nbytes
        while view:
            n = self._f.write(view)
            view = view[n:]
        if hashed is not None:
            hashed.result()
        if self._unsynced >= SYNC_EVERY and (self._sync is None or self._sync.done()):
            self._sync, self._unsynced = _SYNCER.submit(os.fdatasync, self._f.fileno()), 0

    def write(self, name: str, data) -> None:
        """Write (the next piece of) tensor ``name``, which must be the one the layout expects."""
        size = memoryview(data).nbytes
        if self._next >= len(self.layout.tensors):
            raise RuntimeError(f"{self.path}: {name} written after the last tensor")
        t = self.layout.tensors[self._next]
        if t.name != name or self._done + size > t.nbytes:
            raise RuntimeError(f"{self.path}: expected {t.name} ({t.nbytes - self._done} B left), "
                               f"got {name} ({size} B)")
        self._write(data)
        self._done += size
        if self._done == t.nbytes:
            self._next, self._done = self._next + 1, 0

    def close(self) -> str:
        """Finish: all tensors written, fsync, atomic rename. Returns the file's SHA-256."""
        # zero-size tensors are complete without a write
        while self._next < len(self.layout.tensors) and self.layout.tensors[self._next].nbytes == 0:
            self._next += 1
        if self._next != len(self.layout.tensors):
            raise RuntimeError(f"{self.path}: {len(self.layout.tensors) - self._next} tensors not written")
        if self._sync is not None:
            self._sync.result()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        return self._hash.hexdigest()

    def abort(self) -> None:
        """Drop the partial file (on error or interrupt)."""
        if self._sync is not None:
            self._sync.exception()  # wait: never close the fd under a running fdatasync
        if self._f is not None and not self._f.closed:
            self._f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)
