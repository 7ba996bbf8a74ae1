"""Read safetensors headers without trusting them, and write shards as a stream.

We parse the header ourselves (rather than through ``safe_open``) to check it against the
file before any work starts, and we write with the header computed up front, so a shard of
any size is produced with memory bounded by one batch of tensors.
"""
from __future__ import annotations

import errno
import json
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadInput
from ..safepath import open_regular

DTYPE_BITS = {  # safetensors 0.8's Dtype::bitsize: every dtype its files may hold
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE (decimal: 100 MiB would be looser)
_USIZE = (1 << 64) - 1    # safetensors counts in usize: a larger element or bit count is refused
_MAX_DIM = (1 << 63) - 1  # torch's int64 sizes: safe_open(framework="pt") cannot load a larger dim
_JSON_DEPTH = 127         # nesting serde_json (safetensors' parser) allows
_FIELDS = frozenset(("dtype", "shape", "data_offsets"))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int
    path: str   # the file that holds it: a module's tensors may sit in different shards

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


class _Repeated:
    """Stands in for a JSON object that names a key twice (``json`` would keep the last silently)."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key


def _json_object(pairs: list[tuple[str, object]]) -> dict | _Repeated:
    d = dict(pairs)
    if len(d) == len(pairs):
        return d
    seen: set[str] = set()
    for k, _ in pairs:   # the first name seen twice
        if k in seen:
            break
        seen.add(k)
    return _Repeated(k)


def _json_int(s: str) -> int | float:
    """An integer as serde_json types it: ``-0`` and integers beyond 64 bits become floats."""
    n = int(s)
    return n if s != "-0" and -(1 << 63) <= n <= _USIZE else float(n)


def _json_float(s: str) -> float:
    x = float(s)
    if abs(x) == float("inf"):
        raise ValueError(f"number out of range: {s}")
    return x


def _json_constant(s: str) -> None:
    raise ValueError(f"{s} is not JSON")


def _check_strings(x: object) -> None:
    """Raise UnicodeEncodeError on a lone UTF-16 surrogate (``"\\ud800"``): serde_json refuses it."""
    if isinstance(x, str):
        x.encode("utf-8")
    elif isinstance(x, dict):
        for k, v in x.items():
            k.encode("utf-8")
            _check_strings(v)
    elif isinstance(x, list):
        for v in x:
            _check_strings(v)


def _depth(x: object) -> int:
    if isinstance(x, (dict, list)):
        return 1 + max(map(_depth, x.values() if isinstance(x, dict) else x), default=0)
    return 1 if isinstance(x, _Repeated) else 0


def _show(x: object, limit: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _bad(msg: str, path: str, name: str | None = None) -> BadInput:
    """BadInput on one line: a tensor name that is empty or has control characters is quoted."""
    if name is not None and (not name or not name.isprintable()):
        name = repr(name)
    return BadInput(msg, file=path, tensor=name)


_JSON_TYPE = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _parse_json(raw: bytes, path: str) -> dict:
    """The header as a dict, read as strictly as safetensors' serde_json reads it."""
    # json.loads reads these two spellings where serde_json does not (-0 as an int, lone
    # surrogates); both are rare, so only then pay for the slower, exact path
    rare = b"-0" in raw or b"\\u" in raw
    try:
        text = raw.decode("utf-8")  # json.loads(bytes) would also take UTF-16/32 and a BOM
        obj = json.loads(text, object_pairs_hook=_json_object, parse_float=_json_float,
                         parse_constant=_json_constant, parse_int=_json_int if rare else None)
        if rare:
            _check_strings(obj if not isinstance(obj, _Repeated) else None)
    except (ValueError, RecursionError) as e:
        raise _bad(f"corrupt header JSON ({e})", path) from None
    if isinstance(obj, _Repeated):
        if obj.key == "__metadata__":
            raise _bad("the header has two __metadata__", path)
        raise _bad("the header names this tensor twice", path, obj.key)
    if not isinstance(obj, dict):
        raise _bad(f"header is a JSON {_JSON_TYPE.get(type(obj), 'value')}, not an object", path)
    return obj


def _metadata(md: object, path: str) -> dict[str, str]:
    if md is None:  # absent, or null: safetensors accepts both
        return {}
    if type(md) is dict and all(type(v) is str for v in md.values()):
        return md
    what = f"names {md.key!r} twice" if isinstance(md, _Repeated) else "is not a map of strings to strings"
    raise _bad(f"__metadata__ {what}", path)


def _numel(shape: object) -> int:
    """Elements of a shape, counted as safetensors counts them: in usize, checked at each step
    (so [2^32, 2^32, 0] overflows). ValueError says what is wrong."""
    if type(shape) is not list:
        raise ValueError(f"shape {_show(shape)} is not a list")
    n = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= _MAX_DIM:  # bool is not int here, nor is 4.0
            raise ValueError(f"shape {_show(shape)} is not a list of integers 0..2^63-1")
        n *= d
        if n > _USIZE:
            raise ValueError(f"shape {shape} overflows 64 bits")
    return n


def _entry(path: str, name: str, t: object) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor's (dtype, shape, begin, end) after safetensors' checks of a single entry."""
    if type(t) is not dict:
        raise _bad(f"header entry names {t.key!r} twice" if isinstance(t, _Repeated)
                   else f"header entry is {_show(t)}, not an object", path, name)
    if len(t) != 3 or t.keys() != _FIELDS:
        if missing := _FIELDS - t.keys():
            raise _bad(f"header entry lacks {', '.join(sorted(missing))}", path, name)
        if 2 + max(map(_depth, t.values())) > _JSON_DEPTH:  # other keys are ignored, up to a depth
            raise _bad(f"header entry is nested deeper than {_JSON_DEPTH} levels", path, name)
    dtype, shape, offsets = t["dtype"], t["shape"], t["data_offsets"]
    bits = DTYPE_BITS.get(dtype) if type(dtype) is str else None
    if bits is None:
        raise _bad(f"unknown dtype {_show(dtype)}", path, name)
    try:
        nbits = _numel(shape) * bits
    except ValueError as x:
        raise _bad(str(x), path, name) from None
    if nbits > _USIZE:
        raise _bad(f"shape {shape} of {dtype} overflows 64 bits", path, name)
    if nbits % 8:
        raise _bad(f"{dtype}{shape} is not a whole number of bytes", path, name)
    if not (type(offsets) is list and len(offsets) == 2 and type(b := offsets[0]) is int
            and type(e := offsets[1]) is int and 0 <= b and e <= _USIZE):
        raise _bad(f"data_offsets {_show(offsets)} are not two integers 0..2^64-1", path, name)
    if e < b:
        raise _bad(f"data_offsets {b}..{e} end before they begin", path, name)
    if e - b != nbits // 8:
        raise _bad(f"data_offsets {b}..{e} hold {e - b} bytes, {dtype}{shape} needs {nbits // 8}", path, name)
    return dtype, tuple(shape), b, e


def _check_tiling(path: str, spans: list[tuple[int, int, str]], data_start: int, size: int) -> None:
    """As safetensors requires: in offset order each tensor begins where the previous one ends
    (zero-size ones may share an offset), the first at 0, and the last ends the file."""
    spans.sort()
    pos, prev = 0, None
    for b, e, name in spans:
        if b != pos:
            if b < pos:
                raise _bad(f"data_offsets {b}..{e} overlap those of tensor {prev} (which end at {pos})", path, name)
            after = f"tensor {prev} ends at {pos}" if prev is not None else "data starts at offset 0"
            raise _bad(f"data_offsets {b}..{e} leave a hole of {b - pos} bytes ({after})", path, name)
        pos, prev = e, name
    if data_start + pos > size:
        b, e, name = next(s for s in spans if data_start + s[1] > size)
        raise _bad(f"data ends at byte {data_start + e} but the file has {size} bytes (truncated)", path, name)
    if data_start + pos < size:
        raise _bad(f"{size - data_start - pos} byte(s) follow the last tensor's data", path, prev)


def read_header(path: str | os.PathLike) -> Header:
    """Parse and check a shard's header at least as strictly as safetensors 0.8 (and refuse a
    name given twice, which it takes silently), so that each problem is named before any work."""
    path = os.fspath(path)
    try:
        with os.fdopen(open_regular(path), "rb") as f:  # a FIFO or device is refused, never waited on
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise _bad("file is shorter than a safetensors header", path)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise _bad(f"header length {n} is over the safetensors limit of {MAX_HEADER} bytes", path)
            if 8 + n > size:
                raise _bad(f"header length {n} does not fit a file of {size} bytes (truncated?)", path)
            raw = f.read(n)
    except OSError as e:
        raise _bad(f"cannot read: {e.strerror}", path) from None
    obj = _parse_json(raw, path)
    metadata = _metadata(obj.pop("__metadata__", None), path)
    data_start = 8 + n
    tensors, spans = {}, []
    for name, t in obj.items():
        dtype, shape, b, end = _entry(path, name, t)
        tensors[name] = TensorInfo(name, dtype, shape, data_start + b, data_start + end, path)
        spans.append((b, end, name))
    _check_tiling(path, spans, data_start, size)
    return Header(path, tensors, metadata, data_start, size)


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_BITS[self.dtype] // 8  # sub-byte dtypes (F4, F6) pass through too


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


_SYNCER = ThreadPoolExecutor(1, "k3-fdatasync")
SYNC_EVERY = 256 << 20  # start flushing to disk while writing, so close() has little left
_IOV_MAX = 1024         # buffers per pwritev call (Linux's IOV_MAX)


class ShardWriter:
    """Writes a Layout's tensors to ``<path>.partial`` at their fixed offsets, then fsyncs and renames.

    The header fixes every tensor's place, so pieces may arrive in any order and from any
    thread (one file still takes one write at a time: a batch goes in one call). The writer counts each
    tensor's bytes, so the file is complete exactly when ``close`` renames it; chunks are
    hashed as they complete (converter.digest). The ``.partial`` is never opened through a
    symlink.
    """

    def __init__(self, path: str | os.PathLike, layout: Layout):
        from ..digest import ChunkHasher

        self.path = os.fspath(path)
        self.tmp = self.path + ".partial"
        self.layout = layout
        head = len(layout.header)
        self._at = {name: head + lo for name, (lo, _) in layout.offsets.items()}
        self._size = {t.name: t.nbytes for t in layout.tensors}
        self._left = dict(self._size)
        self._lock = threading.Lock()
        self._unsynced = 0
        self._sync: Future[None] | None = None
        self._hasher: ChunkHasher | None = None   # set once the file is open
        self._fd = -1
        try:
            self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            self._hasher = ChunkHasher(self._fd, layout.file_size)
            self._pwrite(layout.header, 0)
        except BaseException:  # ENOSPC on the first bytes, Ctrl-C: leave no .partial behind
            self.abort()
            raise

    def _pwrite(self, data, offset: int) -> None:
        self._pwritev([memoryview(data).cast("B")], offset)

    def _pwritev(self, views: list[memoryview], offset: int) -> None:
        """Write the buffers back to back from ``offset``, as few calls as the kernel allows."""
        pos, i = offset, 0
        while i < len(views):
            n = written = os.pwritev(self._fd, views[i:i + _IOV_MAX], pos)
            pos += n
            while i < len(views) and n >= views[i].nbytes:  # fully written buffers
                n -= views[i].nbytes
                i += 1
            if n:  # a short write stopped inside this one
                views[i] = views[i][n:]
            elif not written and i < len(views):
                raise OSError(errno.EIO, "the write made no progress", self.tmp)
        self._account(offset, pos - offset)

    def _account(self, offset: int, size: int) -> None:
        """Bytes on their way to the disk: hash the chunks they complete, flush every so often."""
        assert self._hasher is not None   # __init__ sets it or raises
        self._hasher.written(offset, size)
        with self._lock:
            self._unsynced += size
            if self._unsynced >= SYNC_EVERY and (self._sync is None or self._sync.done()):
                self._sync, self._unsynced = _SYNCER.submit(os.fdatasync, self._fd), 0

    def write(self, name: str, data, offset: int = 0) -> None:
        """Write ``data`` at byte ``offset`` of tensor ``name`` (thread-safe, any order)."""
        size = memoryview(data).nbytes
        with self._lock:
            left = self._left.get(name)
            if left is None or offset < 0 or offset + size > self._size[name] or size > left:
                raise RuntimeError(f"{self.path}: {size} B at {offset} of {name} do not fit the layout")
            self._left[name] = left - size
        self._pwrite(data, self._at[name] + offset)

    def write_run(self, pieces: list[tuple[str, Any]]) -> None:
        """Write whole tensors that follow each other in the layout with one ``pwritev``: one
        file takes one write at a time (the kernel's inode lock), so fewer, larger calls win."""
        if not pieces:
            return
        views = [memoryview(d).cast("B") for _, d in pieces]
        with self._lock:
            at = self._at[pieces[0][0]]
            for (name, _), v in zip(pieces, views):
                if self._at.get(name) != at or v.nbytes != self._size[name] or self._left[name] != self._size[name]:
                    raise RuntimeError(f"{self.path}: {name} is not the next whole tensor of the run")
                self._left[name] = 0
                at += v.nbytes
        self._pwritev(views, self._at[pieces[0][0]])

    def close(self) -> str:
        """Finish: all tensors written, fsync, atomic rename. Returns the file's digest."""
        short = [n for n, left in self._left.items() if left]
        if short:
            raise RuntimeError(f"{self.path}: {len(short)} tensors not completely written, e.g. {short[0]}")
        if self._sync is not None:
            self._sync.result()
        os.fsync(self._fd)
        assert self._hasher is not None   # __init__ sets it or raises
        digest = self._hasher.digest()
        os.close(self._fd)
        self._fd = -1
        os.replace(self.tmp, self.path)
        return digest

    def abort(self) -> None:
        """Drop the partial file (on error or interrupt)."""
        if self._sync is not None:
            self._sync.exception()  # wait: never close the fd under a running fdatasync
        if self._hasher is not None:
            self._hasher.cancel()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if os.path.lexists(self.tmp):
            os.unlink(self.tmp)
