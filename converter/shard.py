"""Convert one shard: read, requantize, write — overlapped, with memory bounded by a few batches.

A reader thread fills buffers ahead (pinned when a GPU computes), the calling thread
requantizes, a writer thread appends to the output in layout order; each stage holds at
most ``DEPTH`` batches, so memory does not grow with the shard. Buffers come from small
fixed pools and are reused: on a VM, touching fresh pages costs more than the copy itself.
"""
from __future__ import annotations

import os
import queue
import time
from collections import deque
from itertools import islice
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .errors import BadInput
from .formats.safetensors_io import ShardWriter
from .plan import PACKED, SCALE, SHAPE, Convert, ShardPlan
from .quant.requant import STAT_FIELDS, Result
from .quant.cpu_kernel import output_error as cpu_output_error
from .validate import TensorFigures, figures, output_error, probe

DEPTH = 2
COPY_PIECE = 16 << 20
Requantizer = Callable[[torch.Tensor, torch.Tensor, list], Result]


@dataclass
class ShardResult:
    name: str
    sha256: str
    bytes_out: int
    seconds: float
    figures: list[TensorFigures] = field(default_factory=list)


@dataclass
class _CopyPiece:
    name: str
    offset: int
    size: int
    data: np.ndarray | None = None
    buf: object = None  # pool buffer to give back once written


@dataclass
class _Batch:
    items: list[Convert]
    packed: torch.Tensor | None = None  # [G, 16] uint8, all items back to back
    scales: torch.Tensor | None = None  # [G] uint8
    buf: object = None

    @property
    def groups(self) -> int:
        return sum(c.groups for c in self.items)


class _Pool:
    """A fixed set of reusable buffers; ``get`` waits while all are in flight."""

    def __init__(self, count: int, make: Callable[[], object]):
        self._make, self._count, self._q = make, count, queue.SimpleQueue()

    def get(self):
        if self._count:  # allocated on first use, then only recycled
            self._count -= 1
            return self._make()
        return self._q.get()

    def put(self, buf) -> None:
        self._q.put(buf)


def _pread(fd: int, buf: np.ndarray, offset: int, path: str, name: str) -> None:
    view = memoryview(buf).cast("B")
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise BadInput("unexpected end of file (truncated)", file=path, tensor=name)
        view, offset = view[n:], offset + n


def _units(sp: ShardPlan, batch_groups: int):
    """The shard as a sequence of copy pieces and convert batches, in output order."""
    batch: list[Convert] = []
    size = 0
    for it in sp.items:
        if isinstance(it, Convert):
            if batch and size + it.groups > batch_groups:
                yield _Batch(batch)
                batch, size = [], 0
            batch.append(it)
            size += it.groups
            continue
        if batch:
            yield _Batch(batch)
            batch, size = [], 0
        info = it.info
        for off in range(0, max(info.nbytes, 1), COPY_PIECE):
            yield _CopyPiece(info.name, info.start + off, min(COPY_PIECE, info.nbytes - off))
    if batch:
        yield _Batch(batch)


class ShardConverter:
    """Converts shards with one requantizer (CPU reference or a GPU kernel) on ``device``."""

    def __init__(self, requantize: Requantizer, device: str = "cpu", batch_groups: int = 1 << 20,
                 sample: Callable[[Convert], bool] = lambda c: True):
        self.requantize, self.device = requantize, torch.device(device)
        self.batch_groups, self.sample = batch_groups, sample
        self.pin = self.device.type == "cuda"
        # in flight at most: DEPTH read ahead + 1 computing (inputs); 1 computing + DEPTH
        # being written (outputs); DEPTH + 1 + DEPTH (copy pieces)
        self._inputs = _Pool(DEPTH + 1, lambda: self._pair(torch.uint8))
        self._outputs = _Pool(DEPTH + 1, lambda: self._pair(torch.int16))
        self._copies = _Pool(2 * DEPTH + 1, lambda: np.empty(COPY_PIECE, dtype=np.uint8))

    def _pair(self, scale_dtype: torch.dtype, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        g = groups or self.batch_groups
        return (torch.empty((g, 16), dtype=torch.uint8, pin_memory=self.pin),
                torch.empty((g,), dtype=scale_dtype, pin_memory=self.pin))

    def _take(self, pool: _Pool, groups: int, scale_dtype: torch.dtype):
        """A pool buffer, or for a tensor larger than a batch a buffer of its own (not pooled)."""
        return pool.get() if groups <= self.batch_groups else self._pair(scale_dtype, groups)

    def _read(self, fd: int, path: str, unit):
        if isinstance(unit, _CopyPiece):
            unit.buf = self._copies.get()
            unit.data = unit.buf[:unit.size]
            _pread(fd, unit.data, unit.offset, path, unit.name)
            return unit
        groups = unit.groups
        unit.buf = self._take(self._inputs, groups, torch.uint8)
        packed, scales = unit.buf[0][:groups], unit.buf[1][:groups]
        pn, sn, g = packed.numpy(), scales.numpy(), 0
        for c in unit.items:
            _pread(fd, pn[g:g + c.groups], c.packed.start, path, c.packed.name)
            _pread(fd, sn[g:g + c.groups], c.scale.start, path, c.scale.name)
            g += c.groups
        unit.packed, unit.scales = packed, scales
        return unit

    def _compute(self, path: str, batch: _Batch, out_buf) -> tuple[list[tuple[str, object]], list[TensorFigures]]:
        offsets = np.cumsum([0] + [c.groups for c in batch.items]).tolist()
        dev = self.device
        groups = offsets[-1]
        out_packed, out_scales = out_buf[0][:groups], out_buf[1][:groups].view(torch.bfloat16)
        if dev.type == "cpu":
            packed, scales = batch.packed, batch.scales
            res = self.requantize(packed, scales, offsets, out=(out_packed, out_scales))
        else:
            packed = batch.packed.to(dev, non_blocking=True)
            scales = batch.scales.to(dev, non_blocking=True)
            res = self.requantize(packed, scales, offsets)
            out_packed.copy_(res.packed, non_blocking=True)
            out_scales.copy_(res.scales, non_blocking=True)
        stats = res.stats.cpu().tolist()  # stream-ordered: the copies above are done too
        pieces, figs = [], []
        nan_col, oor_col = STAT_FIELDS.index("nan_scale"), STAT_FIELDS.index("out_of_range")
        for i, c in enumerate(batch.items):
            lo, hi = offsets[i], offsets[i + 1]
            st = stats[i]
            if st[nan_col]:
                raise BadInput(f"{int(st[nan_col])} E8M0 scale byte(s) are 255 (NaN)", file=path, tensor=c.scale.name)
            if st[oor_col]:
                raise BadInput(f"{int(st[oor_col])} group(s) need an int4 scale outside bf16's normal range "
                               "(E8M0 exponent too close to 0 or 254)", file=path, tensor=c.scale.name)
            out_rel = None
            sampled = self.sample(c)
            if sampled and dev.type == "cpu":
                out_rel = cpu_output_error(batch.packed[lo:hi], batch.scales[lo:hi], out_packed[lo:hi],
                                           out_scales[lo:hi], c.cols, probe(c.cols))
            elif sampled:
                out_rel = output_error(
                    packed[lo:hi].reshape(c.rows, c.cols // 2), scales[lo:hi].reshape(c.rows, c.cols // 32),
                    res.packed[lo:hi].reshape(c.rows, -1).view(torch.int32),
                    res.scales[lo:hi].reshape(c.rows, c.cols // 32))
            nonfinite = 0  # scales are finite by construction: bad groups raise above
            figs.append(figures(f"{c.module}.{PACKED}", c.layer, st[0], st[1], st[2], nonfinite, out_rel))
            pieces += [
                (f"{c.module}.{PACKED}", out_packed[lo:hi].numpy()),
                (f"{c.module}.{SCALE}", out_scales[lo:hi].view(torch.uint8).numpy()),
                (f"{c.module}.{SHAPE}", np.array([c.rows, c.cols], dtype="<i8")),
            ]
        return pieces, figs

    def convert(self, sp: ShardPlan, dst_dir: str, progress: Callable[[int], None] = lambda n: None) -> ShardResult:
        """Write ``dst_dir/<shard>``; on any error the partial file is removed."""
        t0 = time.perf_counter()
        path = sp.header.path
        writer = ShardWriter(os.path.join(dst_dir, sp.name), sp.layout)
        figs: list[TensorFigures] = []
        fd = -1
        try:  # from here on anything (Ctrl-C too) drops the .partial
            progress(sp.header.data_start)  # progress counts source bytes: the header, then tensors
            fd = os.open(path, os.O_RDONLY)
            with ThreadPoolExecutor(1, "k3-read") as rd, ThreadPoolExecutor(1, "k3-write") as wr:
                units = _units(sp, self.batch_groups)
                reads: deque[Future] = deque(rd.submit(self._read, fd, path, u) for u in islice(units, DEPTH))
                writes: deque[Future] = deque()
                while reads:
                    unit = reads.popleft().result()
                    nxt = next(units, None)
                    if nxt is not None:
                        reads.append(rd.submit(self._read, fd, path, nxt))
                    if isinstance(unit, _CopyPiece):
                        pieces, nbytes, done = [(unit.name, unit.data)], unit.size, (self._copies, unit.buf)
                    else:
                        out_buf = self._take(self._outputs, unit.groups, torch.int16)
                        pieces, f = self._compute(path, unit, out_buf)
                        pooled = unit.groups <= self.batch_groups
                        if pooled:
                            self._inputs.put(unit.buf)
                        figs += f
                        nbytes = sum(c.packed.nbytes + c.scale.nbytes for c in unit.items)
                        done = (self._outputs, out_buf if pooled else None)
                    while len(writes) >= DEPTH:
                        writes.popleft().result()
                    writes.append(wr.submit(self._write_all, writer, pieces, progress, nbytes, done))
                for w in writes:
                    w.result()
            sha = writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        return ShardResult(sp.name, sha, sp.bytes_out, time.perf_counter() - t0, figs)

    @staticmethod
    def _write_all(writer, pieces, progress, nbytes: int, done: tuple) -> None:
        for name, data in pieces:
            writer.write(name, data)
        pool, buf = done
        if buf is not None:
            pool.put(buf)
        progress(nbytes)
