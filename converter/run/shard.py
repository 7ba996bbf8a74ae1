"""Convert one shard: read, requantize, write — overlapped, with memory bounded by a few batches.

The output header is fixed before any data is written, so every piece of the output has
a known offset: reader threads fill batches ahead (pinned when a GPU computes), the calling
thread requantizes in order, and writer threads put each piece at its place in any order,
while chunks are hashed as they complete. No single thread sees every byte, so no single
core caps the rate. Buffers come from small fixed pools and are reused (on a VM, touching
fresh pages costs more than the copy itself): memory does not grow with the shard.
"""
from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..errors import BadInput, OutputError
from ..formats import fp8_block, mxfp4, nvfp4
from ..formats.checkpoint import PACKED, SCALE, SHAPE
from ..formats.safetensors_io import ShardWriter, TensorInfo
from ..quant.requant import STAT_FIELDS, Result
from ..quant.rules import DEFAULT, ScaleRule
from ..safepath import open_regular
from .plan import Convert, Dequant, Fp8Dequant, Nvfp4Convert, ShardPlan
from .validate import TensorFigures, figures, output_error, probe

COPY_PIECE = 16 << 20
DEQUANT_PIECE = 1 << 20  # bf16 bytes of a Dequant piece: its float32 decode (2x) stays in cache (bench_dequant.py)
Requantizer = Callable[..., Result]


@dataclass
class ShardResult:
    name: str
    digest: str
    bytes_out: int
    seconds: float
    figures: list[TensorFigures] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # busy seconds per stage (profile)


class Stages(dict):
    """Seconds spent per pipeline stage, summed over a shard: where a slow run spends its time.

    ``read`` and ``write`` are summed over their threads; the ``wait_*`` entries are the
    compute thread's stalls, so the stage it waits on most is the one that limits the run.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # several reader and writer threads add to one entry

    def time(self, name: str) -> "_Timer":
        return _Timer(self, name)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self[name] = self.get(name, 0.0) + seconds


class _Timer:
    __slots__ = ("stages", "name", "t0")

    def __init__(self, stages: Stages, name: str):
        self.stages, self.name = stages, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.stages.add(self.name, time.perf_counter() - self.t0)


@dataclass
class _CopyPiece:
    info: TensorInfo   # of the tensor
    offset: int        # within the tensor
    size: int
    name: str = ""     # its name in DST (items.Copy.out_name)
    data: np.ndarray | None = None
    buf: Any = None    # pool buffer, given back once written


@dataclass
class _DequantPiece:
    """Rows [lo, hi) of a ``Dequant`` module: read, decoded to bf16 by the reader, written at ``offset``."""

    item: Dequant | Fp8Dequant   # Dequant; an _Fp8Piece's Fp8Dequant
    lo: int
    hi: int
    data: np.ndarray | None = None
    buf: Any = None     # pool buffer (a copy piece's), given back once written

    @property
    def name(self) -> str:
        return self.item.outputs()[0].name

    @property
    def offset(self) -> int:     # in the output tensor
        return self.lo * self.item.cols * 2

    @property
    def size(self) -> int:       # bytes written
        return (self.hi - self.lo) * self.item.cols * 2

    @property
    def nbytes(self) -> int:     # source bytes read
        d = self.item
        assert isinstance(d, Dequant)   # an _Fp8Piece has its own
        return (self.hi - self.lo) * (d.packed.nbytes + d.scale.nbytes) // d.rows


class _Fp8Piece(_DequantPiece):
    """Rows [lo, hi) of an ``Fp8Dequant`` module (e4m3 bytes and the whole fp32 scale tensor read)."""

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.item.cols + self.item.scale.nbytes * (self.lo == 0)


@dataclass
class _Nvfp4Unit:
    """One NVFP4 module, read whole and requantized alone (``kernels.nvfp4_requantizer``): its
    groups span two E4M3 blocks, so the MXFP4 batch layout does not fit. Read into a pooled buffer
    (pinned for a GPU) and written from a pooled output buffer, as batches are."""

    item: Nvfp4Convert
    packed: torch.Tensor | None = None   # uint8 [rows, cols / 2]
    scales: torch.Tensor | None = None   # float8_e4m3fn [rows, cols / 16]
    gscale: float = 0.0
    buf: Any = None

    @property
    def groups(self) -> int:
        return self.item.groups


@dataclass
class _Batch:
    items: list[Convert]
    packed: torch.Tensor | None = None  # [G, 16] uint8, all items back to back
    scales: torch.Tensor | None = None  # [G] uint8
    buf: Any = None

    @property
    def groups(self) -> int:
        return sum(c.groups for c in self.items)


class _Pool:
    """A fixed set of reusable buffers; ``get`` waits while all are in flight."""

    def __init__(self, count: int, make: Callable[[], object]):
        self._make, self._count = make, count
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def get(self):
        if self._count:  # allocated on first use, then only recycled
            self._count -= 1
            return self._make()
        return self._q.get()

    def put(self, buf) -> None:
        self._q.put(buf)


def _pread(fd: int, buf: np.ndarray, offset: int, path: str, name: str) -> None:
    view = buf.data.cast("B")
    while view:
        try:
            n = os.preadv(fd, [view], offset)
        except OSError as e:  # EIO from a failing disk: the source file, not DST's of that name
            raise OutputError(f"cannot read the source: {e.strerror}", file=path, tensor=name) from None
        if n == 0:
            raise BadInput("unexpected end of file (truncated)", file=path, tensor=name)
        view, offset = view[n:], offset + n


def _units(sp: ShardPlan, batch_groups: int):
    """The shard as a sequence of copy pieces and convert batches, in output order."""
    batch: list[Convert] = []
    size = 0
    for it in sp.items:
        if isinstance(it, Nvfp4Convert):
            if batch:
                yield _Batch(batch)
                batch, size = [], 0
            yield _Nvfp4Unit(it)
            continue
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
        if isinstance(it, (Dequant, Fp8Dequant)):  # whole rows, each piece's bf16 within a copy buffer
            step = max(1, DEQUANT_PIECE // (2 * it.cols))
            piece = _Fp8Piece if isinstance(it, Fp8Dequant) else _DequantPiece
            for lo in range(0, it.rows, step):
                yield piece(it, lo, min(it.rows, lo + step))
            continue
        info = it.info
        for off in range(0, max(info.nbytes, 1), COPY_PIECE):
            yield _CopyPiece(info, off, min(COPY_PIECE, info.nbytes - off), it.out_name)
    if batch:
        yield _Batch(batch)


def _scale_refusal(items: list[Convert] | list[Dequant], index: int, why: str) -> BadInput:
    """BadInput naming the file, tensor and group of a batch's ``index``-th group."""
    for c in items:
        if index < c.groups:
            per_row = c.cols // 32
            return BadInput(f"group {index % per_row} of row {index // per_row}: {why}",
                            file=c.scale.path, tensor=c.scale.name)
        index -= c.groups
    raise AssertionError("group index outside the batch")


class ShardConverter:
    """Converts shards with one requantizer (CPU or GPU kernel) on ``device``.

    ``readers``/``writers`` threads move the bytes; ``scale_shift`` is added (mod 256) to
    every E8M0 byte as it is read (2 for compressed-tensors 0.13.0's bias-125 scales).
    """

    def __init__(self, requantize: Requantizer, device: str = "cpu", batch_groups: int = 1 << 20,
                 sample: Callable[[Convert], bool] = lambda c: True, readers: int = 3, writers: int = 2,
                 scale_shift: int = 0, rule: ScaleRule = DEFAULT, server: Requantizer | None = None):
        self.requantize, self.device = requantize, torch.device(device)
        rule = ScaleRule(rule)
        if server is None:
            from ..kernels import server_requantizer
            server = server_requantizer(str(self.device))
        # requantize: the optimum of the rule (optimal, optimal-pm7), or for vllm-gfx942 the default one
        self.rule, self.server = rule, server  # server: the vllm-gfx942 rule's kernel
        self._scratch_buf: tuple[torch.Tensor, torch.Tensor] | None = None
        self.optimum = rule.optimum  # the rule written is an exact optimum; its comparison, the server rule
        self.batch_groups, self.sample, self.scale_shift = batch_groups, sample, scale_shift % 256
        self.readers, self.writers = readers, writers
        self.pin = self.device.type == "cuda"
        self._local = threading.local()   # each reader thread's Dequant buffers
        # at most: `readers` batches being read, one ready, one computing (inputs); one being
        # filled, `writers` being written and one queued for them (outputs); copy pieces likewise
        self._inputs = _Pool(readers + 2, lambda: self._pair(torch.uint8))
        self._nvfp4_inputs = _Pool(readers + 2, lambda: self._pair(torch.uint8, width=2))   # E4M3 scales [G, 2]
        self._outputs = _Pool(writers + 2, lambda: self._pair(torch.int16))
        self._copies = _Pool(readers + writers + 2, lambda: np.empty(COPY_PIECE, dtype=np.uint8))
        if self.device.type == "cpu":
            from ..quant.cpu_kernel import output_errors as cpu_output_errors  # numba: CPU path only
            self._cpu_output_errors = cpu_output_errors

    def _pair(self, scale_dtype: torch.dtype, groups: int | None = None, width: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed bytes [G, 16] and ``width`` scales a group, pinned for a GPU."""
        g = groups or self.batch_groups
        return (torch.empty((g, 16), dtype=torch.uint8, pin_memory=self.pin),
                torch.empty((g, width) if width > 1 else (g,), dtype=scale_dtype, pin_memory=self.pin))

    def _take(self, pool: _Pool, groups: int, scale_dtype: torch.dtype, width: int = 1):
        """A pool buffer, or for a tensor larger than a batch a buffer of its own (not pooled)."""
        return pool.get() if groups <= self.batch_groups else self._pair(scale_dtype, groups, width)

    # ------------------------------------------------------------------ stages

    def _dequantize(self, fds: dict[str, int], piece: _DequantPiece) -> _DequantPiece:
        """Read a piece's rows and decode them to bf16 (exact: ``mxfp4.to_bf16``), refusing the
        scales the converter refuses and any group too large for bf16."""
        if isinstance(piece, _Fp8Piece):
            return self._fp8_dequantize(fds, piece)
        d, rows = piece.item, piece.hi - piece.lo
        assert isinstance(d, Dequant)   # _units pairs an Fp8Dequant with an _Fp8Piece
        half, groups = d.cols // 2, d.cols // 32
        pn, sn, scratch = self._dequant_buffers(rows * d.cols)
        pn, sn = pn[:rows * half].reshape(rows, half), sn[:rows * groups].reshape(rows, groups)
        _pread(fds[d.packed.path], pn, d.packed.start + piece.lo * half, d.packed.path, d.packed.name)
        _pread(fds[d.scale.path], sn, d.scale.start + piece.lo * groups, d.scale.path, d.scale.name)
        first = piece.lo * groups
        self._ocp_scales(pn.reshape(-1, 16), sn.reshape(-1), [d], first)
        out = piece.buf if piece.size <= COPY_PIECE else np.empty(piece.size, np.uint8)  # a row over 8M: its own
        piece.data = out[:piece.size]
        _, over = mxfp4.to_bf16(pn, sn, piece.data.view(np.uint16), scratch)
        if over is not None:
            raise _scale_refusal([d], first + over, f"its values exceed bf16's range (E8M0 byte "
                                 f"{int(sn.reshape(-1)[over])}): not a weight that dequantizes")
        return piece

    def _fp8_dequantize(self, fds: dict[str, int], piece: _Fp8Piece) -> _Fp8Piece:
        """Read an FP8 linear's rows and its block scales, decode to bf16 (``fp8_block.to_bf16``),
        refusing a value that is not finite (a NaN byte, or a scale that overflows)."""
        d, rows = piece.item, piece.hi - piece.lo
        assert isinstance(d, Fp8Dequant)   # _units pairs an Fp8Dequant with an _Fp8Piece
        w = np.empty((rows, d.cols), np.uint8)
        s = np.empty(d.scale.shape, np.float32)
        _pread(fds[d.weight.path], w, d.weight.start + piece.lo * d.cols, d.weight.path, d.weight.name)
        _pread(fds[d.scale.path], s, d.scale.start, d.scale.path, d.scale.name)
        out = fp8_block.to_bf16(torch.from_numpy(w), torch.from_numpy(s), d.block, piece.lo)
        bad = (~torch.isfinite(out)).nonzero()
        if len(bad):
            r, c = (int(x) for x in bad[0])
            raise BadInput(f"row {piece.lo + r}, column {c}: not finite once scaled by its block scale: not a "
                           "weight that dequantizes", file=d.weight.path, tensor=d.weight.name)
        buf = piece.buf if piece.size <= COPY_PIECE else np.empty(piece.size, np.uint8)
        piece.data = buf[:piece.size]
        piece.data.view(np.uint16).reshape(rows, d.cols)[:] = out.view(torch.uint16).numpy()
        return piece

    def _ocp_scales(self, packed: np.ndarray, scales: np.ndarray, items: list, first: int = 0) -> None:
        """Refuse the stored E8M0 bytes no dialect allows (``mxfp4.refused_scale``, on the bytes as
        stored), then shift ``scales`` in place to OCP's bias. ``first``: the groups' index in ``items``."""
        bad = mxfp4.refused_scale(packed, scales, 127 - self.scale_shift)
        if bad is not None:
            raise _scale_refusal(items, first + bad[0], bad[1])
        if self.scale_shift:
            np.add(scales, self.scale_shift, out=scales)  # uint8: wraps mod 256 (254 + 2 = 0)

    def _dequant_buffers(self, values: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This reader thread's buffers for a piece of ``values`` weights (packed, scales, float32),
        kept across pieces: fresh pages cost more than the decode itself."""
        bufs = getattr(self._local, "dequant", None)
        if bufs is None or bufs[2].size < values:
            n = max(values, DEQUANT_PIECE // 2)
            bufs = self._local.dequant = (np.empty(n // 2, np.uint8), np.empty(n // 32, np.uint8),
                                          np.empty(n, np.float32))
        return bufs

    def _read_nvfp4(self, fds: dict[str, int], unit: _Nvfp4Unit) -> _Nvfp4Unit:
        """A whole NVFP4 module into its (pinned) buffer, its scales' values checked
        (``nvfp4.global_problem``, ``scale_problem``)."""
        c = unit.item
        packed = unit.buf[0][:c.groups].reshape(c.packed.shape)
        scales = unit.buf[1][:c.groups].reshape(c.scale.shape)
        gn = np.empty(1, np.float32)
        for t, arr in ((c.packed, packed.numpy()), (c.scale, scales.numpy()), (c.global_scale, gn)):
            _pread(fds[t.path], arr, t.start, t.path, t.name)
        unit.packed, unit.scales = packed, scales.view(torch.float8_e4m3fn)
        unit.gscale = float(gn[0])
        for why, t in ((nvfp4.global_problem(unit.gscale), c.global_scale),
                       (nvfp4.scale_problem(unit.scales), c.scale)):
            if why:
                raise BadInput(why, file=t.path, tensor=t.name)
        return unit

    def _nvfp4_compute(self, unit: _Nvfp4Unit, out_buf, stages: Stages
                       ) -> tuple[list[tuple[str, object]], list[TensorFigures]]:
        """The module's int4 words, bf16 scales and shape (in ``out_buf``), and its figures: our error
        and the server rule's (``cmp_rel_rmse``), both against the NVFP4 values; no output-error figures."""
        from ..kernels import nvfp4_requantizer  # numba or Triton: NVFP4 sources only
        from ..quant.nvfp4_requant import GlobalScale

        c = unit.item
        assert self.rule is ScaleRule.OPTIMAL, "an NVFP4 plan under another rule is refused (Options.plan)"
        assert unit.packed is not None and unit.scales is not None   # _read_nvfp4 filled them
        r = nvfp4_requantizer(str(self.device))(unit.packed, unit.scales, GlobalScale(unit.gscale, c.divide),
                                                out=(out_buf[0][:c.groups], out_buf[1][:c.groups]))
        if r.out_of_range:
            raise BadInput(f"{r.out_of_range} group(s) need an int4 scale outside bf16's normal range: not written",
                           file=c.scale.path, tensor=c.scale.name)
        cmp = r.server_err2 if math.isfinite(r.server_err2) else math.inf   # the server rule overflows bf16
        figs = [figures(f"{c.module}.{PACKED}", c.layer, r.err2, r.ref2, r.max_abs, 0, None, cmp, None)]
        pieces: list[tuple[str, object]] = [
            (f"{c.module}.{PACKED}", r.words.numpy()),
            (f"{c.module}.{SCALE}", r.scales.view(torch.int16).numpy()),
            (f"{c.module}.{SHAPE}", np.array([c.rows, c.cols], dtype="<i8")),
        ]
        return pieces, figs

    def _read(self, fds: dict[str, int], unit, stages: Stages):
        with stages.time("read"):
            if isinstance(unit, _Nvfp4Unit):
                return self._read_nvfp4(fds, unit)
            if isinstance(unit, _DequantPiece):
                return self._dequantize(fds, unit)
            if isinstance(unit, _CopyPiece):
                unit.data = unit.buf[:unit.size]
                info = unit.info
                _pread(fds[info.path], unit.data, info.start + unit.offset, info.path, info.name)
                return unit
            packed, scales = unit.buf[0][:unit.groups], unit.buf[1][:unit.groups]
            pn, sn, g = packed.numpy(), scales.numpy(), 0
            for c in unit.items:
                _pread(fds[c.packed.path], pn[g:g + c.groups], c.packed.start, c.packed.path, c.packed.name)
                _pread(fds[c.scale.path], sn[g:g + c.groups], c.scale.start, c.scale.path, c.scale.name)
                g += c.groups
            self._ocp_scales(pn, sn, unit.items)
            unit.packed, unit.scales = packed, scales
            return unit

    def _compute(self, batch: _Batch, out_buf, stages: Stages
                 ) -> tuple[list[tuple[str, object]], list[TensorFigures]]:
        assert batch.packed is not None and batch.scales is not None   # _read filled them
        offsets = np.cumsum([0] + [c.groups for c in batch.items]).tolist()
        dev = self.device
        groups = offsets[-1]
        out_packed, out_scales = out_buf[0][:groups], out_buf[1][:groups].view(torch.bfloat16)
        # the rule written, and the other one whose figures the report sets beside ours
        write, other = (self.requantize, self.server) if self.optimum else (self.server, self.requantize)
        if dev.type == "cpu":
            packed, scales = batch.packed, batch.scales
            res = write(packed, scales, offsets, out=(out_packed, out_scales))
        else:
            packed = batch.packed.to(dev, non_blocking=True)
            scales = batch.scales.to(dev, non_blocking=True)
            res = write(packed, scales, offsets)
            out_packed.copy_(res.packed, non_blocking=True)
            out_scales.copy_(res.scales, non_blocking=True)
        cmp = None  # the other rule over the batch, unless the kernel gave its error on the way (numba)
        if not self.optimum or res.server_err2 is None:
            with stages.time("compare"):
                cmp = other(packed, scales, offsets, **({"out": self._scratch(groups)} if dev.type == "cpu" else {}))
        with stages.time("compute_sync"):
            stats = res.stats.cpu().tolist()  # stream-ordered: the copies above are done too
            # each read only where it was computed: cmp_stats where cmp is, server_err2 where it is not
            cmp_stats: list = cmp.stats.cpu().tolist() if cmp is not None else []
            server_err2: list = res.server_err2.tolist() if cmp is None and res.server_err2 is not None else []
        pieces, figs = [], []
        oor_col = STAT_FIELDS.index("out_of_range")  # NaN bytes never get here: _read refused them

        def out_errors(c: Convert, lo: int, hi: int, ours: tuple, theirs: tuple | None) -> tuple:
            """The output error of our int4 and, if given, of the other rule's (words, scales)."""
            if dev.type == "cpu":  # one pass over the MXFP4 weights for both
                return self._cpu_output_errors(packed[lo:hi], scales[lo:hi], ours, theirs, c.cols,  # batch's on CPU
                                               probe(c.cols))
            return out_error(c, lo, hi, *ours), (None if theirs is None else out_error(c, lo, hi, *theirs))

        def out_error(c: Convert, lo: int, hi: int, words: torch.Tensor, wscales: torch.Tensor) -> float:
            return output_error(packed[lo:hi].reshape(c.rows, c.cols // 2), scales[lo:hi].reshape(c.rows, c.cols // 32),
                                words.reshape(c.rows, -1).view(torch.int32), wscales.reshape(c.rows, c.cols // 32))

        for i, c in enumerate(batch.items):
            lo, hi = offsets[i], offsets[i + 1]
            st = stats[i]
            if st[oor_col]:
                why = ("E8M0 exponent too close to 0 or 254" if self.optimum else
                       "the server's rule dequantizes them to inf: E8M0 exponent 253 or 254")
                raise BadInput(f"{int(st[oor_col])} group(s) need an int4 scale outside bf16's normal range "
                               f"({why})", file=c.scale.path, tensor=c.scale.name)
            if cmp is None:
                cmp_err2 = server_err2[i]
            elif cmp_stats[i][oor_col]:  # the other rule cannot write this tensor
                cmp_err2 = math.inf if self.optimum else None
            else:
                cmp_err2 = cmp_stats[i][0]
            out_rel = cmp_out = None
            if self.sample(c):
                with stages.time("sample"):
                    theirs = None
                    if cmp_err2 is not None and math.isfinite(cmp_err2):
                        other_res = cmp if cmp is not None else other(batch.packed[lo:hi], batch.scales[lo:hi])
                        at = slice(lo, hi) if cmp is not None else slice(0, hi - lo)
                        theirs = (other_res.packed[at], other_res.scales[at])
                    # on the CPU, ours: the out buffers
                    out_rel, cmp_out = out_errors(c, lo, hi, (res.packed[lo:hi], res.scales[lo:hi]), theirs)
            # scales are finite by construction: groups that would not be raise above
            figs.append(figures(f"{c.module}.{PACKED}", c.layer, st[0], st[1], st[2], 0, out_rel, cmp_err2, cmp_out))
            pieces += [
                (f"{c.module}.{PACKED}", out_packed[lo:hi].numpy()),
                (f"{c.module}.{SCALE}", out_scales[lo:hi].view(torch.uint8).numpy()),
                (f"{c.module}.{SHAPE}", np.array([c.rows, c.cols], dtype="<i8")),
            ]
        return pieces, figs

    def _scratch(self, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU buffers for the other rule's bytes (used by the compute thread only)."""
        if self._scratch_buf is None or self._scratch_buf[0].shape[0] < groups:
            self._scratch_buf = (torch.empty((groups, 16), dtype=torch.uint8),
                                 torch.empty(groups, dtype=torch.bfloat16))
        return self._scratch_buf[0][:groups], self._scratch_buf[1][:groups]

    @staticmethod
    def _write(writer: ShardWriter, pieces, offset: int, pool: _Pool | None, buf, progress, nbytes: int,
               stages: Stages) -> None:
        """A copy piece (at ``offset`` in its tensor), or a batch's outputs: one contiguous run."""
        try:
            with stages.time("write"):
                if len(pieces) == 1:
                    writer.write(pieces[0][0], pieces[0][1], offset)
                else:
                    writer.write_run(pieces)
        finally:  # also on error: the compute thread may be waiting for this buffer
            if pool is not None:
                pool.put(buf)
        progress(nbytes)

    # ------------------------------------------------------------------ a shard

    def convert(self, sp: ShardPlan, dst_dir: str, progress: Callable[[int], None] = lambda n: None) -> ShardResult:
        """Write ``dst_dir/<shard>``; on any error the partial file is removed."""
        t0 = time.perf_counter()
        figs: list[TensorFigures] = []
        stages = Stages()
        fds: dict[str, int] = {}
        writer = ShardWriter(os.path.join(dst_dir, sp.name), sp.layout)
        try:  # from here on anything (Ctrl-C too) drops the .partial
            for p in sp.sources:
                fds[p] = open_regular(p)
                os.posix_fadvise(fds[p], 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead
            progress(sp.header_bytes)  # progress counts source bytes read: the header, then tensors
            with ThreadPoolExecutor(self.readers, "k3-read") as rd, ThreadPoolExecutor(self.writers, "k3-write") as wr:
                self._run(sp, writer, fds, rd, wr, figs, stages, progress)
            with stages.time("close_fsync"):
                digest = writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
        return ShardResult(sp.name, digest, sp.bytes_out, time.perf_counter() - t0, figs, dict(stages))

    def _run(self, sp: ShardPlan, writer: ShardWriter, fds: dict[str, int], rd: ThreadPoolExecutor,
             wr: ThreadPoolExecutor, figs: list[TensorFigures], stages: Stages, progress) -> None:
        units = _units(sp, self.batch_groups)
        reads: deque[Future] = deque()
        writes: deque[Future] = deque()

        def read_next() -> None:
            unit = next(units, None)
            if unit is None:
                return
            with stages.time("wait_write"):  # copy buffers come back from the writers
                if isinstance(unit, (_CopyPiece, _DequantPiece)):
                    unit.buf = self._copies.get()
                elif isinstance(unit, _Batch):
                    unit.buf = self._take(self._inputs, unit.groups, torch.uint8)
                elif isinstance(unit, _Nvfp4Unit):
                    unit.buf = self._take(self._nvfp4_inputs, unit.groups, torch.uint8, 2)
            reads.append(rd.submit(self._read, fds, unit, stages))

        for _ in range(self.readers + 1):
            read_next()
        while reads:
            with stages.time("wait_read"):
                unit = reads.popleft().result()
            read_next()
            while writes and writes[0].done():
                writes.popleft().result()  # a writer's error stops the shard here
            if isinstance(unit, _CopyPiece):
                writes.append(wr.submit(self._write, writer, [(unit.name, unit.data)], unit.offset,
                                        self._copies, unit.buf, progress, unit.size, stages))
                continue
            if isinstance(unit, _DequantPiece):
                writes.append(wr.submit(self._write, writer, [(unit.name, unit.data)], unit.offset,
                                        self._copies, unit.buf, progress, unit.nbytes, stages))
                continue
            with stages.time("wait_write"):
                out_buf = self._take(self._outputs, unit.groups, torch.int16)
            nvfp4 = isinstance(unit, _Nvfp4Unit)
            with stages.time("compute"):
                pieces, f = (self._nvfp4_compute if nvfp4 else self._compute)(unit, out_buf, stages)
            pooled = unit.groups <= self.batch_groups
            if pooled:
                (self._nvfp4_inputs if nvfp4 else self._inputs).put(unit.buf)
            figs += f
            nbytes = unit.item.nbytes if nvfp4 else sum(c.nbytes for c in unit.items)
            writes.append(wr.submit(self._write, writer, pieces, 0, self._outputs if pooled else None, out_buf,
                                    progress, nbytes, stages))
        with stages.time("wait_write"):
            for w in writes:
                w.result()
