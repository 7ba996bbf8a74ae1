"""A whole conversion: preflight, DST checks, shards across devices, then index/config/report.

Shards go to one worker per device (GPU) or ``workers`` CPU processes from a shared queue,
largest first. The parent alone writes the manifest, after each finished shard, so a run
that is killed resumes from there; index, config and report come last.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import __version__
from .errors import BadInput, ConvertError, Interrupted, OutputError, ThresholdExceeded
from .formats import checkpoint as ckpt
from .manifest import (MANIFEST, STATE_DIR, Lock, file_fingerprint, read_json, read_rows,
                       write_json, write_rows)
from .plan import Plan, build_plan, shard_plan
from .validate import TensorFigures, layer_summary

REPORT = "k3convert_report.json"
TENSOR_TABLE = "k3convert_tensors.jsonl.zst"
SOURCE_FORMAT = "compressed-tensors mxfp4-pack-quantized"
TARGET_FORMAT = "compressed-tensors pack-quantized int4 group 32 symmetric, bf16 scales"


@dataclass
class Options:
    max_rel_rmse: float = 0.15   # optimal requantization of MXFP4 gives ~0.09 on real-like data
    sample_experts: int = 4      # experts per layer whose output error y = W x is measured
    devices: list[str] | None = None  # None: every visible GPU, else CPU
    workers: int = 1             # CPU processes when converting on the CPU
    overwrite: bool = False
    batch_groups: int | None = None  # groups per requantize call [default: 2**18 CPU, 2**21 GPU]
    shards: list[str] | None = None   # convert only these (batch jobs); None: all

    def identity(self) -> dict[str, Any]:
        """What must match for a resumed run to continue a previous one."""
        return {"version": __version__, "sample_experts": self.sample_experts}


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
    worst: dict | None = None


Event = Callable[[str, dict], None]  # (kind, fields): progress for bars and JSON logs


def default_dst(src: str) -> str:
    src = os.path.abspath(src).rstrip(os.sep)
    return f"{src}-int4"


def resolve_devices(options: Options) -> list[str]:
    if options.devices:
        return list(options.devices)
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"] * max(1, options.workers)


def requantizer(device: str):
    """The CPU reference or the Triton kernel; both give the same bytes."""
    if device.startswith("cpu"):
        from .quant.cpu_kernel import requantize
        return requantize
    from .kernels.triton_requant import requantize
    return requantize


def _inside(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep)


def source_identity(plan: Plan) -> dict[str, Any]:
    return {
        "path": plan.src,
        "config": file_fingerprint(os.path.join(plan.src, "config.json")),
        "shards": {s.name: file_fingerprint(s.header.path) for s in plan.shards},
    }


def prepare_dst(plan: Plan, dst: str, options: Options) -> dict:
    """Check DST and return the manifest to continue (new, or a previous run's)."""
    if _inside(dst, plan.src) or _inside(plan.src, dst):
        raise OutputError(f"DST and SRC ({plan.src}) must not contain each other", file=dst)
    fresh = {
        "tool": "k3convert", "version": __version__, "status": "converting", "complete": False,
        "source_format": SOURCE_FORMAT, "target_format": TARGET_FORMAT,
        "activation": plan.activation, "options": options.identity(),
        "source": source_identity(plan), "shards": {},
    }
    if not os.path.exists(dst):
        os.makedirs(dst)
        return fresh
    if not os.path.isdir(dst) or not os.access(dst, os.W_OK):
        raise OutputError("is not a writable directory", file=dst)
    old = read_json(os.path.join(dst, MANIFEST))
    if old is None:
        if [f for f in os.listdir(dst) if f != STATE_DIR]:
            raise OutputError("exists, is not empty and holds no k3convert manifest: choose a new directory", file=dst)
        return fresh
    same = old.get("source", {}).get("path") == plan.src and old.get("options") == options.identity() \
        and old.get("source", {}).get("config") == fresh["source"]["config"]
    if same:
        changed = [n for n, fp in old["source"]["shards"].items() if fresh["source"]["shards"].get(n) != fp]
        same = not changed
    if same and not options.overwrite:
        fresh["shards"] = {n: r for n, r in old.get("shards", {}).items()}
        return fresh
    if not options.overwrite:
        raise OutputError("holds a different conversion (other source, changed source files or other options): "
                          "use --overwrite to replace it", file=dst)
    for name in os.listdir(dst):
        p = os.path.join(dst, name)
        if name != STATE_DIR:
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    return fresh


def check_space(dst: str, need: int) -> None:
    free = shutil.disk_usage(dst).free
    margin = max(1 << 30, need // 50)
    if free < need + margin:
        raise OutputError(f"needs {need / 1e9:.1f} GB (+{margin / 1e9:.1f} GB margin) but has {free / 1e9:.1f} GB free",
                          file=dst)


def _worker(src: str, dst: str, device: str, quant, act, sample_cfg, batch_groups: int,
            tasks: "mp.Queue", events: "mp.Queue") -> None:
    """One process per device: take shard names until the queue is empty."""
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        conv_fn = requantizer(device)
        from .shard import ShardConverter
        stride, per_layer = sample_cfg
        batch_groups = batch_groups or (1 << 18 if device.startswith("cpu") else 1 << 21)
        conv = ShardConverter(conv_fn, device, batch_groups,
                              lambda c: c.expert is None or (per_layer > 0 and c.expert % stride == 0))
        while True:
            try:
                name = tasks.get_nowait()
            except queue.Empty:
                return
            events.put(("start", {"shard": name, "device": device}))
            try:
                sp = shard_plan(src, name, quant, act, [])
                res = conv.convert(sp, dst, lambda n: events.put(("bytes", {"n": n})))
            except ConvertError as e:
                events.put(("error", {"shard": name, "message": str(e), "code": e.exit_code}))
                return
            events.put(("done", {"shard": name, "sha256": res.sha256, "bytes": res.bytes_out,
                                 "seconds": res.seconds, "figures": [f.row() for f in res.figures]}))
    except KeyboardInterrupt:
        return
    except BaseException as e:  # anything else: report it with the device, let the parent stop the run
        events.put(("error", {"shard": None, "message": f"worker on {device} failed: {e!r}", "code": 1}))


def convert(src: str, dst: str | None = None, options: Options | None = None,
            on_event: Event = lambda kind, f: None, plan: Plan | None = None) -> Summary:
    """Convert SRC into DST (library entry point; the CLI is a thin layer over this)."""
    options = options or Options()
    plan = plan or build_plan(src)
    dst = os.path.abspath(dst or default_dst(plan.src))
    manifest = prepare_dst(plan, dst, options)
    with Lock(dst):
        return _run(plan, dst, options, manifest, on_event)


def _run(plan: Plan, dst: str, options: Options, manifest: dict, on_event: Event) -> Summary:
    t0 = time.perf_counter()
    state = os.path.join(dst, STATE_DIR)
    for f in os.listdir(dst):  # leftovers of a killed run never look complete; drop them
        if f.endswith(".partial"):
            os.unlink(os.path.join(dst, f))
    selected = [s for s in plan.shards if options.shards is None or s.name in options.shards]
    todo = [s for s in selected if not _shard_done(dst, s.name, manifest)]
    check_space(dst, sum(s.bytes_out for s in todo))
    write_json(os.path.join(dst, MANIFEST), manifest)
    devices = resolve_devices(options)
    total_in = sum(s.bytes_in for s in todo)
    on_event("plan", {"shards": len(selected), "todo": len(todo), "bytes_in": total_in,
                      "bytes_out": sum(s.bytes_out for s in todo), "devices": devices})
    experts = 1 + max((c.expert or 0) for s in plan.shards for c in s.converts)
    stride = max(1, experts // max(1, options.sample_experts))
    ctx = mp.get_context("spawn")
    tasks, events = ctx.Queue(), ctx.Queue()
    for s in sorted(todo, key=lambda s: -s.bytes_in):
        tasks.put(s.name)
    procs = []
    threads = max(1, (os.cpu_count() or 1) // len(devices)) if devices[0] == "cpu" else None
    try:
        if todo:
            procs = [ctx.Process(target=_worker_entry, daemon=True, args=(
                plan.src, dst, d, plan.quant, plan.activation, (stride, options.sample_experts),
                options.batch_groups, tasks, events, threads)) for d in devices[:len(todo)]]
            for p in procs:
                p.start()
        remaining = {s.name for s in todo}
        while remaining:
            try:
                kind, f = events.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    raise ConvertError(f"workers exited with {len(remaining)} shard(s) unconverted: "
                                       f"{sorted(remaining)[0]} ...")
                continue
            if kind == "error":
                on_event("error", f)
                code = f.get("code", 1)
                cls = {2: BadInput, 4: OutputError}.get(code, ConvertError)
                raise cls(f["message"])
            if kind == "done":
                _record_shard(dst, state, manifest, f)
                remaining.discard(f["shard"])
                worst = max((r["rel_rmse"] for r in f["figures"]), default=0.0)
                on_event("done", {"shard": f["shard"], "seconds": f["seconds"], "rel_rmse_worst": worst})
                if worst > options.max_rel_rmse:
                    bad = max(f["figures"], key=lambda r: r["rel_rmse"])
                    _finish(plan, dst, manifest, options, t0, status="failed-validation")
                    raise ThresholdExceeded(f"relative RMSE {bad['rel_rmse']:.4f} exceeds --max-rel-rmse "
                                            f"{options.max_rel_rmse}", file=os.path.join(dst, f["shard"]),
                                            tensor=bad["name"])
            else:
                on_event(kind, f)
    except KeyboardInterrupt:
        raise Interrupted("interrupted: finished shards are kept; run the same command to resume") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
    return _finish(plan, dst, manifest, options, t0)


def _worker_entry(src, dst, device, quant, act, sample_cfg, batch_groups, tasks, events, threads) -> None:
    if threads:
        torch.set_num_threads(threads)
    _worker(src, dst, device, quant, act, sample_cfg, batch_groups, tasks, events)


def _shard_done(dst: str, name: str, manifest: dict) -> bool:
    """A shard counts as done if the manifest has it and its file is there with that size."""
    rec = manifest["shards"].get(name)
    path = os.path.join(dst, name)
    return bool(rec) and os.path.exists(path) and os.path.getsize(path) == rec["bytes"] and \
        os.path.exists(os.path.join(dst, STATE_DIR, name + ".figures.jsonl.zst"))


def _record_shard(dst: str, state: str, manifest: dict, f: dict) -> None:
    write_rows(os.path.join(state, f["shard"] + ".figures.jsonl.zst"), f["figures"])
    rows = f["figures"]
    manifest["shards"][f["shard"]] = {
        "sha256": f["sha256"], "bytes": f["bytes"], "converted": len(rows),
        "seconds": round(f["seconds"], 3),
        "rel_rmse_worst": max((r["rel_rmse"] for r in rows), default=0.0),
        "snr_db_min": min((r["snr_db"] for r in rows), default=None),
    }
    write_json(os.path.join(dst, MANIFEST), manifest)


def _finish(plan: Plan, dst: str, manifest: dict, options: Options, t0: float, status: str = "complete") -> Summary:
    """Once every shard is there: side files, config, index, report, then the manifest."""
    done = [s for s in plan.shards if _shard_done(dst, s.name, manifest)]
    rows = [r for s in done for r in read_rows(os.path.join(dst, STATE_DIR, s.name + ".figures.jsonl.zst"))]
    figs = [TensorFigures(**r) for r in rows]
    layers = layer_summary(figs)
    summary = Summary(dst, len(done), len(plan.shards), len(figs), time.perf_counter() - t0,
                      sum(s.bytes_in for s in done), sum(s.bytes_out for s in done), layers)
    if figs:
        w = max(figs, key=lambda r: r.rel_rmse)
        summary.worst = {"tensor": w.name, "rel_rmse": w.rel_rmse}
    all_done = len(done) == len(plan.shards)
    if not all_done:  # a batch job's part: another run (or `k3convert finalize`) completes DST
        return summary
    # shards finished by earlier runs were never checked against this run's --max-rel-rmse
    over = status == "complete" and summary.worst is not None and summary.worst["rel_rmse"] > options.max_rel_rmse
    if over:
        status = "failed-validation"
    for rel in plan.other_files:
        os.makedirs(os.path.dirname(os.path.join(dst, rel)) or dst, exist_ok=True)
        shutil.copyfile(os.path.join(plan.src, rel), os.path.join(dst, rel))
    write_json(os.path.join(dst, "config.json"), ckpt.int4_config(plan.config, plan.quant))
    total = sum(t.nbytes for s in plan.shards for t in s.layout.tensors)
    write_json(os.path.join(dst, ckpt.INDEX), {"metadata": {"total_size": total}, "weight_map": dict(sorted(plan.weight_map().items()))})
    write_rows(os.path.join(dst, TENSOR_TABLE), rows)
    write_json(os.path.join(dst, REPORT), {
        "tool": "k3convert", "version": __version__, "source": plan.src, "status": status,
        "source_format": SOURCE_FORMAT, "target_format": TARGET_FORMAT, "activation": plan.activation,
        "max_rel_rmse": options.max_rel_rmse, "tensors": len(figs), "worst": summary.worst,
        "rel_rmse_mean": sum(r.rel_rmse for r in figs) / max(1, len(figs)),
        "tensor_table": TENSOR_TABLE, "layers": layers,
    })
    manifest["status"] = status
    manifest["complete"] = status == "complete"
    manifest["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(os.path.join(dst, MANIFEST), manifest)
    summary.complete = manifest["complete"]
    if over:
        w = summary.worst
        raise ThresholdExceeded(f"relative RMSE {w['rel_rmse']:.4f} exceeds --max-rel-rmse {options.max_rel_rmse}",
                                file=os.path.join(dst, plan.weight_map()[w["tensor"]]), tensor=w["tensor"])
    return summary

