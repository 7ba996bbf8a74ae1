"""A whole conversion: preflight, DST checks, shards across devices, then index/config/report.

State lives in DST/.k3convert: ``run.json`` (what is being converted: source fingerprints and
options), and per finished shard a record and a figure table. The manifest, index, config
and report are derived from those; the run that finishes the last shard (or ``finalize``)
writes them, the manifest last. Shards go to one worker per GPU, or ``workers`` CPU
processes, from a shared queue, largest first; several runs (batch jobs) may share a DST
as long as their shard selections are disjoint: each run locks the shards it converts.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import __version__
from .devices import gpu_count
from .digest import ALGORITHM as DIGEST_ALGORITHM
from .errors import BadInput, Interrupted, OutputError, ThresholdExceeded
from .formats import checkpoint as ckpt
from .manifest import (MANIFEST, REPORT, STATE_DIR, TENSOR_TABLE, ShardLocks, file_fingerprint, read_json,
                       read_rows, write_json, write_rows)
from .plan import Plan, ShardPlan, build_plan
from .safepath import dest_file, fresh_file, lock_file
from .validate import TensorFigures, layer_summary
from .workers import Task, Workers, raise_error

TARGET_FORMAT = "compressed-tensors pack-quantized int4 group 32 symmetric, bf16 scales"


@dataclass
class Options:
    max_rel_rmse: float = 0.15   # optimal requantization of MXFP4 gives ~0.1 on real-like data
    sample_experts: int = 4      # experts per layer whose output error y = W x is measured
    devices: list[str] | None = None  # None: every visible GPU, else CPU
    workers: int = 1             # CPU processes when converting on the CPU
    workers_per_gpu: int = 2     # two shards in flight per GPU: one output file is one write stream
    overwrite: bool = False
    batch_groups: int | None = None   # groups per requantize call [default: 2**20 CPU, 2**21 GPU]
    shard_spec: str | None = None     # --shards 3,5-9: convert only these (batch jobs)
    part: str | None = None           # --part i/n
    profile: str | None = None        # model profile name or file [default: chosen from config.json]
    drop_activation_quant: bool = False  # convert a source that also quantizes activations, weight-only
    inline: bool | None = None        # one worker in this process [default: when torch is imported here]

    def identity(self) -> dict[str, Any]:
        """What must match for a run to continue (or share) a previous one's DST."""
        return {"version": __version__, "sample_experts": self.sample_experts, "profile": self.profile,
                "drop_activation_quant": self.drop_activation_quant}

    def plan(self, src: str) -> Plan:
        return build_plan(src, self.profile, self.drop_activation_quant)


@dataclass
class Summary:
    dst: str
    shards_done: int
    shards_total: int
    tensors: int
    seconds: float
    bytes_in: int
    bytes_out: int
    layers: list[dict] = field(default_factory=list)
    complete: bool = False
    status: str = "partial"
    worst: dict | None = None


Event = Callable[[str, dict], None]  # (kind, fields): progress for bars and JSON logs


def default_dst(src: str) -> str:
    return os.path.abspath(src).rstrip(os.sep) + "-int4"


def resolve_devices(options: Options) -> list[str]:
    """One entry per worker process: each GPU named (or found), else ``workers`` CPU slots."""
    devices = options.devices
    for d in devices or []:
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()):
            raise BadInput(f"--devices: {d!r} is not cpu or cuda:N (ROCm GPUs are cuda:N too)")
    if devices and "cpu" in devices and len(devices) > 1:
        raise BadInput("--devices: use either cpu (with --workers) or GPUs, not both")
    if devices is None and (n := gpu_count()):
        devices = [f"cuda:{i}" for i in range(n)]
    if devices and devices != ["cpu"]:
        return [d for d in devices for _ in range(max(1, options.workers_per_gpu))]
    return ["cpu"] * max(1, options.workers)


def select_shards(names: list[str], spec: str | None = None, part: str | None = None) -> list[str]:
    """``--shards 3,5-9`` (1-based, in file-name order) and/or ``--part i/n`` (round robin)."""
    chosen = list(names)
    if spec:
        idx: set[int] = set()
        for tok in spec.split(","):
            a, _, b = tok.strip().partition("-")
            try:
                lo, hi = int(a), int(b or a)
            except ValueError:
                raise BadInput(f"--shards: {tok!r} is not N or N-M") from None
            if not 1 <= lo <= hi <= len(names):
                raise BadInput(f"--shards: {tok!r} is outside 1-{len(names)}")
            idx.update(range(lo, hi + 1))
        chosen = [n for i, n in enumerate(names, 1) if i in idx]
    if part:
        try:
            i, n = (int(x) for x in part.split("/"))
        except ValueError:
            raise BadInput(f"--part: {part!r} is not i/n") from None
        if not 1 <= i <= n:
            raise BadInput(f"--part: {part!r} needs 1 <= i <= n")
        chosen = [c for c in chosen if names.index(c) % n == i - 1]
    return chosen


def selected(plan: Plan, options: Options) -> list[ShardPlan]:
    names = set(select_shards([s.name for s in plan.shards], options.shard_spec, options.part))
    return [s for s in plan.shards if s.name in names]


def _inside(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep)


def _state(dst: str, *parts: str) -> str:
    return os.path.join(dst, STATE_DIR, *parts)


def _refuse_linked_state(dst: str) -> None:
    """DST's state folder is read and written: through a planted link it would be elsewhere."""
    if os.path.islink(_state(dst)):
        raise OutputError(f"{STATE_DIR} is a symlink: refusing to write through it", file=dst)


def run_identity(plan: Plan, options: Options) -> dict[str, Any]:
    return {
        "tool": "k3convert", "options": options.identity(), "source": plan.src,
        "profile": plan.profile.name, "quantization": plan.source.record(),
        "config": file_fingerprint(os.path.join(plan.src, "config.json")),
        "shards": {s.name: file_fingerprint(s.path) for s in plan.shards},
    }


def prepare_dst(plan: Plan, dst: str, options: Options) -> None:
    """Create DST, or check that it continues this very conversion (else refuse/replace)."""
    if _inside(dst, plan.src) or _inside(plan.src, dst):
        raise OutputError(f"DST and SRC ({plan.src}) must not contain each other", file=dst)
    ident = run_identity(plan, options)
    if os.path.exists(dst):
        if not os.path.isdir(dst) or not os.access(dst, os.W_OK | os.X_OK):
            raise OutputError("is not a writable directory", file=dst)
        _refuse_linked_state(dst)
        old = read_json(_state(dst, "run.json"))
        if old is None and [f for f in os.listdir(dst) if f != STATE_DIR]:
            raise OutputError("exists, is not empty and holds no k3convert state: choose a new directory", file=dst)
        if old is not None and old != ident:
            if not options.overwrite:
                what = "source files changed" if old.get("source") == plan.src else "another source or options"
                raise OutputError(f"holds a different conversion ({what}): use --overwrite to replace it", file=dst)
            held = [n[:-5] for n in os.listdir(_state(dst)) if n.endswith(".lock") and n != "manifest.lock"]
            ShardLocks(dst, held).release()  # refuses if another run is converting any of them
            for name in os.listdir(dst):
                p = os.path.join(dst, name)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    try:
        os.makedirs(_state(dst), exist_ok=True)
        _refuse_linked_state(dst)
        if read_json(_state(dst, "run.json")) is None:
            write_json(_state(dst, "run.json"), ident)
    except OSError as e:
        raise OutputError(f"cannot write: {e.strerror}", file=dst) from None


def check_space(dst: str, need: int) -> None:
    free = shutil.disk_usage(dst).free
    margin = max(1 << 30, need // 50)
    if free < need + margin:
        raise OutputError(f"needs {need / 1e9:.1f} GB (+{margin / 1e9:.1f} GB margin) but has "
                          f"{free / 1e9:.1f} GB free", file=dst)


def shard_record(dst: str, name: str) -> dict | None:
    """A finished shard's record, if its output is still the file that was written."""
    rec = read_json(_state(dst, name + ".done.json"))
    path = os.path.join(dst, name)
    if rec is None or not os.path.exists(path) or file_fingerprint(path) != rec["output"]:
        return None
    return rec


def convert(src: str, dst: str | None = None, options: Options | None = None,
            on_event: Event = lambda kind, f: None, plan: Plan | None = None) -> Summary:
    """Convert SRC into DST (library entry point; the CLI is a thin layer over this).

    The workers start first, so that their imports overlap the preflight; they are stopped
    on any error, the preflight's included.
    """
    t0 = time.perf_counter()
    options = options or Options()
    with Workers(resolve_devices(options), options.inline) as workers:
        plan = plan or options.plan(src)
        dst = os.path.abspath(dst or default_dst(plan.src))
        prepare_dst(plan, dst, options)
        chosen = selected(plan, options)
        todo = [s for s in chosen if shard_record(dst, s.name) is None]
        check_space(dst, sum(s.bytes_out for s in todo))
        locks = ShardLocks(dst, [s.name for s in todo])
        todo = [s for s in todo if shard_record(dst, s.name) is None]  # a run that just ended may have done some
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            # leftovers of a killed run never look complete; drop them, but only of the shards
            # locked above: a .partial of another shard may be another run's (--part) work in progress
            for s in todo:
                if os.path.lexists(os.path.join(dst, s.name + ".partial")):
                    os.unlink(os.path.join(dst, s.name + ".partial"))
            _convert_shards(plan, dst, options, todo, len(chosen), workers, on_event)
        except KeyboardInterrupt:
            raise Interrupted("interrupted: finished shards are kept; run the same command to resume") from None
        finally:
            signal.signal(signal.SIGTERM, old_term)
            locks.release()
    summary = finalize(dst, plan, options)
    if summary.status == "failed-validation":  # also shards finished (unchecked) by earlier runs
        w = summary.worst
        raise ThresholdExceeded(f"relative RMSE {w['rel_rmse']:.4f} exceeds --max-rel-rmse {options.max_rel_rmse}",
                                file=os.path.join(dst, plan.weight_map()[w["tensor"]]), tensor=w["tensor"])
    summary.seconds = time.perf_counter() - t0
    summary.bytes_in = sum(s.bytes_in for s in todo)
    return summary


def describe(plan: Plan, dst: str, options: Options) -> dict[str, Any]:
    """What a run would do (``--dry-run``): nothing is written."""
    dst = os.path.abspath(dst)
    chosen = selected(plan, options)
    done = [s.name for s in chosen if os.path.isdir(dst) and shard_record(dst, s.name)]
    todo = [s for s in chosen if s.name not in done]
    probe = dst
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return {
        "source": plan.src, "dst": dst, "profile": f"{plan.profile.name} ({plan.profile_reason})",
        "scale_convention": plan.source.scale_note, "devices": resolve_devices(options),
        "shards": len(chosen), "shards_done": len(done), "shards_todo": len(todo),
        "tensors_to_convert": sum(len(s.converts) for s in todo),
        "tensors_copied": sum(len(s.items) - len(s.converts) for s in todo),
        "modules_split_across_shards": sum(c.scale.path != c.packed.path for s in todo for c in s.converts),
        "also_reads": {s.name: s.partners for s in todo if s.partners},
        "dropped": [d["where"] for d in plan.source.dropped] + plan.dropped,
        "bytes_in": sum(s.bytes_in for s in todo), "bytes_out": sum(s.bytes_out for s in todo),
        "free_bytes_at_dst": shutil.disk_usage(probe).free, "activation": plan.activation,
    }


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _convert_shards(plan: Plan, dst: str, options: Options, todo: list[ShardPlan], n_selected: int,
                    workers: Workers, on_event: Event) -> None:
    on_event("plan", {"shards": n_selected, "todo": len(todo), "bytes_in": sum(s.bytes_read for s in todo),
                      "bytes_out": sum(s.bytes_out for s in todo), "devices": workers.devices[: max(1, len(todo))]})
    if not todo:
        return
    experts = 1 + max((c.expert or 0) for s in plan.shards for c in s.converts)
    stride = max(1, -(-experts // max(1, options.sample_experts)))
    shift = 127 - plan.source.scale_bias
    tasks = [Task(s, dst, stride, options.sample_experts, shift, options.batch_groups) for s in todo]
    if not workers.inline:
        _prefetch([s.path for s in sorted(todo, key=lambda s: -s.bytes_in)[: len(workers.devices)]])

    def handle(kind: str, f: dict) -> None:
        if kind == "error":
            on_event("error", f)
            raise_error(f)
        if kind == "done":
            _record(dst, plan, options, f, on_event)
        else:
            on_event(kind, f)

    workers.run(tasks, handle)


PREFETCH = 2 << 30  # bytes of each worker's first shard read ahead while the workers start


def _prefetch(paths: list[str]) -> None:
    """While the workers import torch (seconds), have the kernel read the start of the shards
    they take first: from a cold disk, those seconds of reading are then already done."""
    def run() -> None:
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, min(PREFETCH, os.fstat(fd).st_size), os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            except OSError:  # only a hint
                pass

    threading.Thread(target=run, name="k3-prefetch", daemon=True).start()


def _record(dst: str, plan: Plan, options: Options, f: dict, on_event: Event) -> None:
    """A finished shard: its figure table and record (the resume state), then the threshold."""
    rows = f["figures"]
    write_rows(_state(dst, f["shard"] + ".figures.jsonl.zst"), rows)
    worst = max(rows, key=lambda r: r["rel_rmse"], default=None)
    write_json(_state(dst, f["shard"] + ".done.json"), {
        "digest": f["digest"], "bytes": f["bytes"], "converted": len(rows), "seconds": round(f["seconds"], 3),
        "sources": f["sources"], "rel_rmse_worst": worst["rel_rmse"] if worst else 0.0,
        "snr_db_min": min((r["snr_db"] for r in rows), default=None),
        "output": file_fingerprint(os.path.join(dst, f["shard"])),
        "stages": {k: round(v, 3) for k, v in f.get("stages", {}).items()},
    })
    on_event("done", {"shard": f["shard"], "seconds": f["seconds"],
                      "rel_rmse_worst": worst["rel_rmse"] if worst else 0.0})
    if worst and worst["rel_rmse"] > options.max_rel_rmse:
        finalize(dst, plan, options)
        raise ThresholdExceeded(f"relative RMSE {worst['rel_rmse']:.4f} exceeds --max-rel-rmse "
                                f"{options.max_rel_rmse}", file=os.path.join(dst, f["shard"]), tensor=worst["name"])


def finalize(dst: str, plan: Plan | None = None, options: Options | None = None) -> Summary:
    """Write the manifest from the shard records; when every shard is done, also the side
    files, config, index and report, and mark the manifest complete (last)."""
    t0 = time.perf_counter()
    _refuse_linked_state(dst)
    run = read_json(_state(dst, "run.json"))
    if run is None:
        raise OutputError("holds no k3convert state (nothing to finalize)", file=dst)
    if options is None:
        recorded = run.get("options") or {}
        options = Options(profile=recorded.get("profile"),
                          drop_activation_quant=bool(recorded.get("drop_activation_quant")))
    plan = plan or options.plan(run["source"])
    lock = lock_file(_state(dst, "manifest.lock"))
    fcntl.flock(lock, fcntl.LOCK_EX)  # several batch jobs may finish at once
    try:
        return _finalize_locked(dst, plan, options, run, t0)
    finally:
        lock.close()


def _source_record(plan: Plan, run: dict) -> dict[str, Any]:
    return {"path": plan.src, "profile": {**plan.profile.record(), "reason": plan.profile_reason},
            "quantization": plan.source.record(), "dropped_tensors": plan.dropped,
            "config": run["config"], "shards": run["shards"]}


def _finalize_locked(dst: str, plan: Plan, options: Options, run: dict, t0: float) -> Summary:
    records = {s.name: shard_record(dst, s.name) for s in plan.shards}
    done = [s for s in plan.shards if records[s.name]]
    rows = [r for s in done for r in read_rows(_state(dst, s.name + ".figures.jsonl.zst"))]
    figs = [TensorFigures(**r) for r in rows]
    worst = max(figs, key=lambda r: r.rel_rmse, default=None)
    failed = worst is not None and worst.rel_rmse > options.max_rel_rmse
    all_done = len(done) == len(plan.shards)
    status = "failed-validation" if failed else ("complete" if all_done else "partial")
    summary = Summary(dst, len(done), len(plan.shards), len(figs), time.perf_counter() - t0,
                      sum(s.bytes_in for s in done), sum(s.bytes_out for s in done), layer_summary(figs),
                      status=status, worst=worst and {"tensor": worst.name, "rel_rmse": worst.rel_rmse})
    source = _source_record(plan, run)
    source_format = f"{plan.source.dialect} MXFP4"
    manifest = {
        "tool": "k3convert", "version": __version__, "status": status, "complete": False,
        "source_format": source_format, "target_format": TARGET_FORMAT, "activation": plan.activation,
        "source": source, "options": run["options"], "digest_algorithm": DIGEST_ALGORITHM,
        "shards": {n: r for n, r in records.items() if r},
    }
    if all_done and not failed:
        for rel in plan.other_files:
            out = dest_file(dst, rel)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(os.path.join(plan.src, rel), "rb") as r, os.fdopen(fresh_file(out + ".tmp"), "wb") as w:
                shutil.copyfileobj(r, w)
            os.replace(out + ".tmp", out)
        write_json(os.path.join(dst, "config.json"), plan.output_config())
        total = sum(t.nbytes for s in plan.shards for t in s.layout.tensors)
        write_json(os.path.join(dst, ckpt.INDEX),
                   {"metadata": {"total_size": total}, "weight_map": dict(sorted(plan.weight_map().items()))})
    if all_done or failed:
        write_rows(os.path.join(dst, TENSOR_TABLE), rows)
        write_json(os.path.join(dst, REPORT), {
            "tool": "k3convert", "version": __version__, "source": plan.src, "status": status,
            "profile": source["profile"], "quantization": source["quantization"],
            "dropped_tensors": plan.dropped, "source_format": source_format, "target_format": TARGET_FORMAT,
            "activation": plan.activation, "max_rel_rmse": options.max_rel_rmse, "tensors": len(figs),
            "worst": summary.worst, "rel_rmse_mean": sum(r.rel_rmse for r in figs) / max(1, len(figs)),
            "tensor_table": TENSOR_TABLE, "layers": summary.layers,
        })
    if all_done and not failed:
        manifest["complete"] = True
        manifest["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        summary.complete = True
    write_json(os.path.join(dst, MANIFEST), manifest)
    return summary
