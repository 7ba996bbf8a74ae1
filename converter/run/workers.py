"""Worker processes: ``--workers-per-gpu`` per GPU, or ``--workers`` on the CPU, fed shards
from a shared queue, largest first; each converts one shard at a time.

Workers start before the parent plans, so their imports (torch, Triton, numba: seconds)
and kernel warm-up overlap the parent's reading of every header. A single worker runs in
the calling process when torch is already imported there (library use, tests): nothing
would be gained by a process then.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .. import digest
from ..devices import cpus, memory_available
from ..errors import BadInput, ConvertError, OutputError
from ..kernels import requantizer, server_requantizer
from ..quant.rules import DEFAULT, ScaleRule
from ..terminal.whole import whole
from . import fetch_wait
from .plan import ShardPlan
from .sources import read_digests, start_content_digest

Handler = Callable[[str, dict], None]   # (event kind, fields); raises to stop the run


@dataclass(frozen=True)
class Task:
    """One shard to convert, with what the worker needs beyond the plan."""

    shard: ShardPlan
    dst: str
    sample_stride: int        # experts whose output error is measured: expert % stride == 0
    sample_per_layer: int     # 0: none
    scale_shift: int          # added to every E8M0 byte (source dialect's bias correction)
    batch_groups: int | None
    scale_rule: ScaleRule = DEFAULT  # --scale-rule, parsed by Options


# ---------------------------------------------------------------- how many CPU workers

THREADS_PER_WORKER = 2      # cores per CPU worker under --workers auto (docs/decisions.md)
MEMORY_SHARE = 0.5          # of the available memory, at most, for all workers together
CPU_BATCH_GROUPS = 1 << 20  # groups per requantize call on the CPU
RUNTIME_BYTES = 512 << 20   # a worker's Python + torch + numba after warm-up: 350 MB RSS measured
COPY_PIECE = 16 << 20       # shard.COPY_PIECE (shard.py imports torch; the parent must not)
READERS, WRITERS = 3, 2     # ShardConverter's I/O threads unless K3CONVERT_IO_THREADS says otherwise


def worker_bytes(threads: int, batch_groups: int = CPU_BATCH_GROUPS, readers: int = READERS,
                 writers: int = WRITERS) -> int:
    """Peak memory of one CPU worker: its runtime, ShardConverter's buffer pools (inputs
    uint8 [G, 16] + [G], or [G, 2] for NVFP4; outputs uint8 [G, 16] + int16 [G]; copy pieces) and the
    64 MiB output chunks its hashing threads map. A shard's size does not enter: memory is bounded by these."""
    inputs = (readers + 2) * 18 * batch_groups   # one input pool fills: a source is MXFP4 or NVFP4
    outputs = (writers + 2) * 18 * batch_groups
    copies = (readers + writers + 2) * COPY_PIECE
    return RUNTIME_BYTES + inputs + outputs + copies + digest.threads_for(threads) * digest.CHUNK


@dataclass(frozen=True)
class CpuWorkers:
    """How many CPU worker processes, with how many compute threads each, and why."""

    workers: int
    threads: int
    reason: str

    def __str__(self) -> str:
        return f"cpu: {self.workers} worker(s) x {self.threads} thread(s) ({self.reason})"


def _machine(cores: int, memory: int | None) -> str:
    return f"{cores} cores, " + (f"{memory / 2**30:.1f} GiB available" if memory is not None else "memory unknown")


def choose_cpu_workers(cores: int, memory: int | None, shards: int | None = None) -> CpuWorkers:
    """``--workers auto``: one worker per THREADS_PER_WORKER cores, no more than there are shards
    (a worker converts one shard at a time), and no more than fit in MEMORY_SHARE of the available
    memory; the cores are then shared among the workers chosen. The memory is sized with the
    threads each worker is given (``cores // n``: more threads, more hashing buffers)."""
    cores = max(1, cores)
    n, bound = max(1, cores // THREADS_PER_WORKER), "cores"
    if shards and shards < n:
        n, bound = shards, "shards"
    if memory is not None:
        budget = int(memory * MEMORY_SHARE)
        fit = n
        while fit > 1 and fit * worker_bytes(max(1, cores // fit)) > budget:
            fit -= 1
        if fit < n:
            n, bound = fit, "memory"
    why = {"cores": f"one per {THREADS_PER_WORKER} cores",
           "memory": f"{worker_bytes(max(1, cores // n)) / 2**30:.2f} GiB each in half the available memory",
           "shards": f"one per shard, {shards} to convert"}[bound]
    return CpuWorkers(n, max(1, cores // n), f"auto: {why}; {_machine(cores, memory)}")


def _numba_cap(choice: CpuWorkers) -> CpuWorkers:
    """A NUMBA_NUM_THREADS set lower than a worker's share caps its compute threads (numba refuses
    more): said here, where the choice is shown, not found out in the worker."""
    raw = os.environ.get("NUMBA_NUM_THREADS", "")
    cap = whole(raw) or None
    if cap is None or cap >= choice.threads:
        return choice
    return CpuWorkers(choice.workers, cap, f"{choice.reason}; NUMBA_NUM_THREADS={cap}")


MAX_WORKERS = 4096  # a count no machine's cores reach: beyond it, a typo


def cpu_workers(requested: int | None, shards: int | None = None) -> CpuWorkers:
    """The CPU workers for this machine: ``requested`` (``--workers N``), or chosen (None).

    An explicit count is kept as asked (its owner may know the storage better), but refused
    (BadInput, exit 2) when that many workers cannot fit in the available memory (each
    ``worker_bytes``) or exceed MAX_WORKERS; more workers than cores is said in the workers line
    (docs/decisions.md)."""
    cores, memory = cpus(), memory_available()
    if requested is None:
        return _numba_cap(choose_cpu_workers(cores, memory, shards))
    n = max(1, requested)
    each = worker_bytes(1)
    fit = min(MAX_WORKERS, memory // each) if memory is not None else MAX_WORKERS
    if n > max(1, fit):
        why = f"{each / 2**30:.2f} GiB each in {memory / 2**30:.1f} GiB available" \
            if fit < MAX_WORKERS and memory is not None else "the most this tool starts"
        raise BadInput(f"--workers {n}: at most {max(1, fit)} worker(s) fit on this machine ({why})")
    more = f"; more workers than the {cores} core(s): they share them" if n > cores else ""
    return _numba_cap(CpuWorkers(n, max(1, cores // n), f"--workers {n}; {_machine(cores, memory)}{more}"))


def _warm_up(device: str) -> None:
    """Load the kernel (Triton/numba caches) and the device context before the first shard."""
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():  # a CPU-only torch: torch.cuda.set_device would raise AttributeError
            raise BadInput(f"--devices {device}: this torch {torch.__version__} has no CUDA or ROCm support "
                           "(install a GPU build of torch, or use --devices cpu)")
        torch.cuda.set_device(torch.device(device))
    # a batch shaped like real ones (a multiple of 16 groups, several blocks per program), so
    # that Triton compiles the same specialization the shards use, now rather than mid-shard
    groups = 1 << 17
    p = torch.zeros((groups, 16), dtype=torch.uint8, device=device)
    for kernel in (requantizer(device), server_requantizer(device)):  # optimal-pm7: the same kernel
        kernel(p, torch.full((groups,), 127, dtype=torch.uint8, device=device), [0, groups])
    if device.startswith("cpu"):
        from ..quant.cpu_kernel import output_errors
        from .validate import probe
        z, zs = torch.zeros((1, 16), dtype=torch.uint8), torch.zeros(1, dtype=torch.bfloat16)
        for other in (None, (z, zs)):  # both kernels: one encoding, and two in one pass
            output_errors(z, torch.full((1,), 127, dtype=torch.uint8), (z, zs), other, 32, probe(32))


def io_threads() -> dict[str, int]:
    """Reader and writer threads per worker: ``K3CONVERT_IO_THREADS=readers,writers`` tunes them
    for unusual storage (the defaults were measured on an H200 host: BENCHMARKS.md)."""
    raw = os.environ.get("K3CONVERT_IO_THREADS")
    if not raw:
        return {}
    counts = [whole(x) for x in raw.split(",")]
    if len(counts) != 2 or not all(counts):  # ASCII digits, not 0
        raise BadInput(f"K3CONVERT_IO_THREADS={raw!r}: expected two positive numbers, readers,writers")
    readers, writers = counts
    assert readers and writers   # checked above
    return {"readers": readers, "writers": writers}


class _Converters:
    """One ShardConverter per distinct task setting, reused across shards (its buffer pools)."""

    def __init__(self, device: str):
        self.device = device
        self.cache: dict[tuple, Any] = {}   # task setting -> shard.ShardConverter (imported late: torch)

    def get(self, task: Task):
        from .shard import ShardConverter

        key = (task.sample_stride, task.sample_per_layer, task.scale_shift, task.batch_groups, task.scale_rule)
        if key not in self.cache:
            stride, per_layer = task.sample_stride, task.sample_per_layer
            cpu = self.device.startswith("cpu")
            self.cache[key] = ShardConverter(
                requantizer(self.device, task.scale_rule.qmin), self.device,
                task.batch_groups or (CPU_BATCH_GROUPS if cpu else 1 << 21),
                lambda c: c.expert is None or (per_layer > 0 and c.expert % stride == 0),
                scale_shift=task.scale_shift, rule=task.scale_rule, server=server_requantizer(self.device),
                **io_threads())
        return self.cache[key]


def _run(convs: _Converters, task: Task, put: Callable[[tuple[str, dict]], None]) -> bool:
    """Convert one shard, reporting through ``put``; False after an error (the worker stops)."""
    name = task.shard.name
    put(("start", {"shard": name, "device": convs.device}))
    try:
        fetch_wait.wait(task.shard.sources)  # a Hub shard (or partner) still downloading: until it is there
        hashing = start_content_digest(task.shard.path)  # beside the conversion, which reads it too
        try:
            res = convs.get(task).convert(task.shard, task.dst, lambda n: put(("bytes", {"n": n})))
        except BaseException:
            hashing.cancel()
            raise
        read_from = {"source_digest": hashing.result(), **read_digests(task.shard)}
    except ConvertError as e:
        put(("error", {"shard": name, "message": str(e), "code": e.exit_code, "file": e.file, "tensor": e.tensor}))
        return False
    except OSError as e:
        put(("error", {"shard": name, "code": OutputError.exit_code,
                       "message": f"file {e.filename or os.path.join(task.dst, name)}: {e.strerror}"}))
        return False
    put(("done", {"shard": name, "digest": res.digest, "bytes": res.bytes_out, "seconds": res.seconds,
                  "stages": res.stages, "sources": [os.path.basename(p) for p in task.shard.sources], **read_from,
                  "figures": [f.row() for f in res.figures]}))
    return True


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _die_with(parent: int) -> None:
    """A worker must not outlive its run (kill -9 of the command): it would go on writing into a
    DST whose locks died with the parent. Linux kills it with the parent; elsewhere a thread
    watches."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _serve(device: str, share: int, parent: int, tasks, events) -> None:
    """A worker process: warm up, then convert tasks until the parent sends None."""
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it terminates us,
    signal.signal(signal.SIGTERM, _interrupt)     # and the shard in hand drops its .partial
    hook = sys.unraisablehook  # a stop that lands in a finalizer is no error worth a traceback
    sys.unraisablehook = lambda u: None if issubclass(u.exc_type, KeyboardInterrupt) else hook(u)
    try:
        t0 = time.perf_counter()
        import torch
        t_torch = time.perf_counter()
        digest.set_threads(share)
        if device.startswith("cpu"):
            import numba
            share = min(share, numba.config.NUMBA_NUM_THREADS)  # cpu_workers said so already; numba refuses more
            torch.set_num_threads(share)
            numba.set_num_threads(share)
        _warm_up(device)
        t = time.perf_counter()  # where start-up goes: the imports, then the kernel's load and first run
        events.put(("ready", {"device": device, "threads": share, "seconds": round(t - t0, 3),
                              "import_torch_s": round(t_torch - t0, 3), "warm_up_s": round(t - t_torch, 3)}))
        convs = _Converters(device)
        while (task := tasks.get()) is not None:
            if not _run(convs, task, events.put):
                return
    except KeyboardInterrupt:  # stopped by the parent
        pass
    except ConvertError as e:  # a problem the user can fix (a CPU-only torch for --devices cuda:N)
        events.put(("error", {"shard": None, "message": str(e), "code": e.exit_code}))
    except BaseException as e:  # report anything, naming the device; the parent stops the run
        events.put(("error", {"shard": None, "message": f"worker on {device} failed: {e!r}", "code": 1}))
    finally:  # from here on, a SIGTERM just ends the process (no traceback at exit)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # done: every event reaches the parent, then the process ends at once (torch's and numba's
    # teardown takes a second or more, and the parent would wait for it at the run's end)
    events.close()
    events.join_thread()
    os._exit(0)


def size_first(shard) -> int:
    """The order workers take shards in (a sort key): the largest first, ties in the order given
    (a Hub source's fetcher brings them in the same order: converter.hub.convert)."""
    return -shard.bytes_in


class Workers:
    """The run's workers, started at once; ``run`` feeds them shards and handles their events."""

    def __init__(self, devices: list[str], inline: bool | None = None, note: str = "", threads: int | None = None):
        """``threads``: each worker's compute (CPU) and hashing threads, as ``note`` states them
        (``CpuWorkers.threads``); None: an equal share of the cores (GPU workers)."""
        self.devices, self.note = devices, note  # note: how many workers, and why (progress, --dry-run)
        self.inline = len(devices) == 1 and ("torch" in sys.modules if inline is None else inline)
        self.procs: list = []
        if self.inline:
            return
        ctx = mp.get_context("spawn")
        self.tasks, self.events = ctx.Queue(), ctx.Queue()
        share = threads or max(1, cpus() // len(devices))  # each worker's cores: compute threads (CPU), hashing
        self.procs = [ctx.Process(target=_serve, daemon=True, args=(d, share, os.getpid(), self.tasks, self.events))
                      for d in devices]
        for p in self.procs:
            p.start()

    def run(self, tasks: list[Task], handle: Handler) -> None:
        """Convert every task (largest shard first); ``handle`` sees each event and may raise."""
        tasks = sorted(tasks, key=lambda t: size_first(t.shard))
        if self.inline:
            convs = _Converters(self.devices[0])
            _warm_up(self.devices[0])
            for t in tasks:
                _run(convs, t, lambda ev: handle(*ev))
            return
        for t in tasks:
            self.tasks.put(t)
        for _ in self.procs:
            self.tasks.put(None)
        remaining = {t.shard.name for t in tasks}
        while remaining:
            try:
                kind, f = self.events.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in self.procs):
                    raise ConvertError(f"workers stopped with {len(remaining)} shard(s) unconverted, "
                                       f"e.g. {sorted(remaining)[0]}") from None
                continue
            if kind == "done":
                remaining.discard(f["shard"])
            handle(kind, f)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
        if self.procs:  # tasks no worker took must not hold up this process's exit
            for q in (self.tasks, self.events):
                q.cancel_join_thread()
                q.close()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

