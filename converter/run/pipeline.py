"""A whole conversion: preflight, DST checks, shards across devices, then finalize.

State lives in DST/.k3convert: ``run.json`` (``identity``), and per finished shard a record and a
figure table. The manifest, index, config and report are derived from those (``finalize``); the
run that finishes the last shard (or the ``finalize`` command) writes them, the manifest last.
Shards go to one worker per GPU, or CPU processes, from a shared queue, largest first; each run
locks the shards it converts (``dst``), so runs whose selections are disjoint share a DST.
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from typing import Any

from ..errors import Interrupted, OutputError, ThresholdExceeded, from_event
from ..state.locks import RUN_LOCK, ShardLocks, state_file
from ..state.manifest import Status
from ..state.records import file_fingerprint, write_json, write_rows
from .dst import held, in_use, judge_dst, prepare_dst, refuse_while_read, reopen, usable_dst
from .finalize import finalize
from .identity import recorded_identity, run_identity, shard_record, state_path
from .options import Event, Options, Summary, default_dst
from .plan import Plan, ShardPlan
from .selection import plan_workers, selected, shard_count
from .space import NoRoom, bytes_needed, bytes_under, check_space
from .workers import Task, Workers


def convert(src: str, dst: str | None = None, options: Options | None = None,
            on_event: Event = lambda kind, f: None, plan: Plan | None = None) -> Summary:
    """Convert SRC into DST (library entry point; the CLI is a thin layer over this).

    The workers start first, so that their imports overlap the preflight; they are stopped
    on any error, the preflight's included.
    """
    t0 = time.perf_counter()
    options = options or Options()
    options.check()
    devices, note, threads = plan_workers(options, len(selected(plan, options)) if plan else shard_count(src, options))
    with Workers(devices, options.inline, note, threads) as workers:
        plan = plan or options.plan(src)
        dst = os.path.abspath(dst or default_dst(plan.src))
        chosen = selected(plan, options)  # a selection of nothing is refused before DST is made (T6)
        dst_lock = prepare_dst(plan, dst, options)
        try:
            todo = [s for s in chosen if shard_record(dst, s.name) is None]
            check_space(dst, bytes_needed(plan, dst, todo))
            locks = ShardLocks(dst, [s.name for s in todo])  # under the DST lock: one step with the identity
            todo = [s for s in todo if shard_record(dst, s.name) is None]  # a run that just ended may have done some
            old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
            try:
                if todo:
                    reopen(dst)
                dst_lock.join()
                # leftovers of a killed run never look complete; drop them, but only of the shards
                # locked above: a .partial of another shard may be another run's (--part) work in progress
                for s in todo:
                    partial = os.path.join(dst, s.name + ".partial")
                    try:
                        if os.path.lexists(partial):
                            os.unlink(partial)
                    except OSError as e:
                        raise OutputError(f"cannot remove: {e.strerror}", file=partial) from None
                _convert_shards(plan, dst, options, todo, len(chosen), workers, on_event)
            except KeyboardInterrupt:
                raise Interrupted("interrupted: finished shards are kept; run the same command to resume") from None
            finally:
                signal.signal(signal.SIGTERM, old_term)
                locks.release()
        except BaseException:
            dst_lock.close()
            raise
    try:
        summary = finalize(dst, plan, options)
    finally:
        dst_lock.close()
    if summary.status == Status.FAILED_VALIDATION:  # also shards finished (unchecked) by earlier runs
        w = summary.worst
        assert w is not None   # failed-validation: it names the worst tensor
        raise ThresholdExceeded(f"relative RMSE {w['rel_rmse']:.4f} exceeds --max-rel-rmse {options.max_rel_rmse}",
                                file=os.path.join(dst, plan.weight_map()[w["tensor"]]), tensor=w["tensor"])
    summary.seconds = time.perf_counter() - t0
    summary.bytes_in = sum(s.bytes_in for s in todo)
    return summary


def describe(plan: Plan, dst: str, options: Options) -> dict[str, Any]:
    """What a run would do (``--dry-run``): nothing is written."""
    options.check()
    dst = os.path.abspath(dst)
    chosen = selected(plan, options)
    usable_dst(plan, dst)  # the run's own decisions, so that the dry run says what the run will do
    old, unreadable = recorded_identity(dst) if os.path.isdir(state_path(dst)) else (None, None)
    action = "create it" if not os.path.exists(dst) else "start in it (empty)"
    if os.path.isdir(dst):
        what, _ = judge_dst(plan, dst, options, run_identity(plan, options), old, unreadable)  # refused: exit 4
        if what is not None:
            holds = "a different conversion" if old is not None else "k3convert output that cannot be continued"
            action = f"replace it (--overwrite): it holds {holds} ({what})"
            if held(state_path(dst, RUN_LOCK)):  # the run's own refusal (prepare_dst: lock.alone)
                raise in_use(dst, what, old)
        elif old is not None:
            action = "continue the conversion it holds"
    replaced = action.startswith("replace")
    if replaced:  # the wipe waits for no upload (T7)
        refuse_while_read(dst)
    done = [s.name for s in chosen if old is not None and not replaced and shard_record(dst, s.name)]
    todo = [s for s in chosen if s.name not in done]
    probe = dst
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    # the run's space check (issue 33): a replacement first frees what DST holds; refused after the plan
    refusal = None
    try:
        check_space(dst, bytes_needed(plan, dst, todo, emptied=replaced), bytes_under(dst) if replaced else 0, probe)
    except NoRoom as e:
        refusal = e
    refuse_while_read(dst)  # every run ends in finalize, which changes DST: not under an upload (T7)
    devices, workers, _ = plan_workers(options, len(chosen))
    info = {
        "source": plan.label, "dst": dst, "dst_action": action,
        "profile": f"{plan.profile.name} ({plan.profile_reason})",
        "scale_convention": plan.source.scale_note, "scale_rule": options.scale_rule, "devices": devices,
        "workers": workers,
        "shards": len(chosen), "shards_done": len(done), "shards_todo": len(todo), "experts": plan.experts,
        "tensors_to_convert": sum(len(s.converts) for s in todo),
        "modules_to_bf16": sum(len(s.dequants) for s in todo),
        "tensors_copied": sum(len(s.items) - len(s.pairs) for s in todo),
        "modules_split_across_shards": sum(c.split for s in todo for c in s.pairs),
        "also_reads": {s.name: s.partners for s in todo if s.partners},
        "dropped": [d["where"] for d in plan.source.dropped] + plan.dropped,
        "bytes_in": sum(s.bytes_in for s in todo), "bytes_out": sum(s.bytes_out for s in todo),
        "free_bytes_at_dst": shutil.disk_usage(probe).free, "activation": plan.activation,
    }
    if refusal is not None:
        refusal.plan = info
        raise refusal
    return info


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _convert_shards(plan: Plan, dst: str, options: Options, todo: list[ShardPlan], n_selected: int,
                    workers: Workers, on_event: Event) -> None:
    on_event("plan", {"shards": n_selected, "todo": len(todo), "bytes_in": sum(s.bytes_read for s in todo),
                      "bytes_out": sum(s.bytes_out for s in todo), "devices": workers.devices[: max(1, len(todo))],
                      "workers": workers.note})
    if not todo:
        return
    stride = max(1, -(-max(1, plan.experts) // max(1, options.sample_experts)))
    shift = 127 - plan.source.scale_bias
    tasks = [Task(s, dst, stride, options.sample_experts, shift, options.batch_groups, options.scale_rule)
             for s in todo]
    if not workers.inline:
        _prefetch([s.path for s in sorted(todo, key=lambda s: -s.bytes_in)[: len(workers.devices)]])

    def handle(kind: str, f: dict) -> None:
        if kind == "error":
            on_event("error", f)
            raise from_event(f)
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
    write_rows(state_file(dst, f["shard"], ".figures.jsonl.zst"), rows)
    worst = max(rows, key=lambda r: r["rel_rmse"], default=None)
    write_json(state_file(dst, f["shard"], ".done.json"), {
        "shard": f["shard"], "digest": f["digest"], "bytes": f["bytes"], "converted": len(rows),
        "seconds": round(f["seconds"], 3),
        "sources": f["sources"], "source_digest": f["source_digest"], "partner_digests": f["partner_digests"],
        "rel_rmse_worst": worst["rel_rmse"] if worst else 0.0,
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
