"""Finalize: the manifest from the shard records and, once every shard is done, the side files,
config, index, tensor table and report, every file staged first and the manifest renamed last."""
from __future__ import annotations

import fcntl
import os
import time
from typing import Any, Mapping

from ..digest import bytes_digest, file_digest
from ..errors import OutputError
from ..quant.rules import ScaleRule
from ..safepath import dest_file, lock_file
from ..state.atomic import commit, copy_current, discard, stage, stage_copy
from ..state.files import MANIFEST, REPORT, TENSOR_TABLE
from ..state.locks import MANIFEST_LOCK, RUN_LOCK, state_file, writing
from ..state.manifest import Manifest, Report, Source, Status
from ..state.records import json_bytes, read_rows, rows_bytes
from .dst import (
    DERIVED,
    clean_dead_temporaries,
    entries,
    recorded_files,
    refuse_linked_state,
    reset_complete,
    unrecorded,
)
from .identity import (
    identity_difference,
    named,
    recorded_identity,
    run_identity,
    shard_record,
    source_change,
    state_path,
)
from .options import Options, Summary
from .outputs import expected
from .plan import Plan
from .validate import TensorFigures, error_ratio, layer_summary, mean, ratio_line


def finalize(dst: str, plan: Plan | None = None, options: Options | None = None) -> Summary:
    """Write the manifest from the shard records; when every shard is done, also the side
    files, config, index and report, and mark the manifest complete (last)."""
    t0 = time.perf_counter()
    dst = os.path.abspath(dst)
    refuse_linked_state(dst)
    nothing = "holds no k3convert state (nothing to finalize)"
    if not os.path.isdir(state_path(dst)):
        raise OutputError(f"{unrecorded(dst)}: nothing to finalize" if os.path.isfile(os.path.join(dst, MANIFEST))
                          else nothing, file=dst)
    # the locks first, one at a time, then what they protect: run.json read (and the plan built
    # from it) before them could describe a source that an --overwrite run replaced meanwhile
    with lock_file(state_path(dst, RUN_LOCK)) as using:
        fcntl.flock(using, fcntl.LOCK_SH)  # DST is in use: --overwrite must not empty it meanwhile
        with lock_file(state_path(dst, MANIFEST_LOCK)) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # several batch jobs may finish at once
            run, unreadable = recorded_identity(dst)
            if run is None:
                raise OutputError(f"{unreadable or unrecorded(dst)}: nothing to finalize; rerun mxfp4-to-int4 "
                                  "with --overwrite to start again" if unreadable or entries(dst) else nothing,
                                  file=dst)
            if options is None:
                options = Options.recorded(run.get("options") or {})
            if plan is None and (hub := hub_source(run)) is not None:   # a Hub commit (Plan.origin)
                raise OutputError(f"converted from the Hub commit {hub}, whose files were that run's "
                                  f"own: finish it with k3convert mxfp4-to-int4 {hub} -o {dst} and the "
                                  "same options (what is converted is kept)", file=dst)
            if plan is None and not isinstance(run.get("source"), str):
                raise OutputError("its run record names no source: nothing to finalize; rerun mxfp4-to-int4 "
                                  "with --overwrite to start again", file=dst)
            plan = plan or options.plan(run["source"])
            # what run.json records is what the shards were converted from, with: checked here too
            what = identity_difference(run, run_identity(plan, options)) or source_change(dst, plan, run)[0]
            if what is not None:
                raise OutputError(f"holds a conversion that no longer matches ({what}), recorded by "
                                  f"{named(run)}: rerun mxfp4-to-int4 (--overwrite to start again)", file=dst)
            with writing(dst):
                return _finalize_locked(dst, plan, options, run, t0)


def hub_source(run: Mapping[str, Any]) -> str | None:
    """``ORG/NAME@COMMIT`` where the run record's shards came from the Hub (their identities say so:
    hub/convert.py ``shard_identity``), else None; the record's source where it has one."""
    for ident in (run.get("shards") or {}).values():
        if isinstance(ident, dict) and isinstance(ident.get("hub"), str):
            source = run.get("source")
            return source if isinstance(source, str) else f"{ident['hub']}@{ident.get('commit')}"
    return None


def _makedirs(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the folder: {e.strerror}", file=path) from None


def _source_record(plan: Plan, run: dict) -> Source:
    return Source(path=plan.label, profile={**plan.profile.record(), "reason": plan.profile_reason},
                  quantization=plan.source.record(), dropped_tensors=plan.dropped, dequantized=plan.dequantized,
                  config=run["config"], shards=run["shards"])


def _file_record(path: str) -> dict[str, Any]:
    """A file's size and digest, as the manifest records every file written beside the shards."""
    try:
        return {"bytes": os.stat(path).st_size, "digest": file_digest(path)}
    except OSError as e:
        raise OutputError(f"cannot read: {e.strerror}", file=path) from None


def _staged_record(dst: str, name: str, data: bytes, files: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """Stage ``data`` as DST's ``name`` and record its size and digest in ``files``."""
    path = os.path.join(dst, name)
    files[name] = {"bytes": len(data), "digest": bytes_digest(data)}
    return stage(path, data), path


def _remove_stale(dst: str, names: set[str]) -> None:
    """Remove side files an earlier finalize copied that SRC no longer has (S15): DST must hold
    what SRC gives now, not a stale copy that verify then rejects. Only names the manifest
    recorded as ours; called while the manifest says partial, so a kill leaves a DST to redo."""
    for name in sorted(names):
        try:
            path = dest_file(dst, name)
        except OutputError:
            continue  # a name leading outside DST or through a link: never followed
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        try:
            os.unlink(path)
            folder = os.path.dirname(path)
            while os.path.abspath(folder) != os.path.abspath(dst) and not os.listdir(folder):
                os.rmdir(folder)  # a folder of side files that is now empty
                folder = os.path.dirname(folder)
        except OSError as e:
            raise OutputError(f"cannot remove a side file SRC no longer has: {e.strerror}", file=path) from None


def _rule_record(rule: ScaleRule, figs: list[TensorFigures]) -> dict[str, Any]:
    """The report's scale rule and the other rule's figures on the same weights (docs/maths.md)."""
    cmp = [r.cmp_rel_rmse for r in figs if r.cmp_rel_rmse is not None]
    ratio = error_ratio(figs)
    return {"scale_rule": str(rule), "compare_rule": rule.compared_with,
            "cmp_rel_rmse_mean": mean(cmp) if cmp else None, "cmp_ratio": ratio,
            "compare": ratio_line(ratio, rule)}


def _finalize_locked(dst: str, plan: Plan, options: Options, run: dict, t0: float) -> Summary:
    records = {s.name: shard_record(dst, s.name) for s in plan.shards}
    done = [s for s in plan.shards if records[s.name]]
    rows = [r for s in done for r in read_rows(state_file(dst, s.name, ".figures.jsonl.zst"))]
    figs = [TensorFigures(**r) for r in rows]
    worst = max(figs, key=lambda r: r.rel_rmse, default=None)
    failed = worst is not None and worst.rel_rmse > options.max_rel_rmse
    all_done = len(done) == len(plan.shards)
    status = Status.FAILED_VALIDATION if failed else (Status.COMPLETE if all_done else Status.PARTIAL)
    summary = Summary(dst, len(done), len(plan.shards), len(figs), time.perf_counter() - t0,
                      sum(s.bytes_in for s in done), sum(s.bytes_out for s in done), layer_summary(figs),
                      status=status,
                      worst=None if worst is None else {"tensor": worst.name, "rel_rmse": worst.rel_rmse})
    summary.scale_rule, summary.cmp_ratio = options.scale_rule, error_ratio(figs)
    summary.bf16 = sum(len(s.dequants) for s in done)
    source = _source_record(plan, run)
    source_format = plan.source.source_format
    manifest = Manifest(status=status, source_format=source_format, activation=plan.activation, source=source,
                        options=run["options"], scale_rule=options.scale_rule,
                        shards={n: r for n, r in records.items() if r})
    # every file is first written under a temporary name, then all are renamed, the manifest
    # last: a failure (a full disk, no inodes) on the way leaves no config or index that looks
    # like a finished checkpoint, and no temporary
    staged: list[tuple[str, str]] = []
    files: dict[str, dict[str, Any]] = {}  # every file written beside the shards: bytes and digest
    recorded = recorded_files(dst)
    if all_done or failed:  # DERIVED is replaced: an old "complete" must not stand over a half-replaced set
        reset_complete(dst)  # (before staging: it writes the manifest through the same temporary name)
    try:
        if all_done and not failed:
            want = expected(plan, options.scale_rule)
            _remove_stale(dst, recorded - set(want.side_files) - set(want.documents) - {TENSOR_TABLE, REPORT})
            for target, rel in want.side_files.items():
                src, out = os.path.join(plan.src, rel), dest_file(dst, target)
                files[target] = _file_record(src)  # the source's bytes: a copy that differs fails verify
                if copy_current(src, out):  # a rerun: bytes_needed did not count it
                    continue
                _makedirs(os.path.dirname(out))
                staged.append((stage_copy(src, out), out))
            for name, obj in want.documents.items():
                staged.append(_staged_record(dst, name, json_bytes(obj), files))
        if all_done or failed:
            staged.append(_staged_record(dst, TENSOR_TABLE, rows_bytes(rows), files))
            report = Report(source=plan.label, status=status, profile=source.profile, quantization=source.quantization,
                            dropped_tensors=plan.dropped, dequantized=plan.dequantized, source_format=source_format,
                            activation=plan.activation, max_rel_rmse=options.max_rel_rmse, tensors=len(figs),
                            worst=summary.worst, rel_rmse_mean=mean(r.rel_rmse for r in figs),
                            rule=_rule_record(options.scale_rule, figs), layers=summary.layers)
            staged.append(_staged_record(dst, REPORT, json_bytes(report.to_json()), files))
        manifest.files = dict(sorted(files.items()))
        if all_done and not failed:
            manifest.complete = True
            manifest.finished_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        path = os.path.join(dst, MANIFEST)
        staged.append((stage(path, json_bytes(manifest.to_json())), path))
    except BaseException:
        for tmp, _ in staged:
            discard(tmp)
        raise
    # renamed before the manifest failed: what would look like a finished checkpoint goes
    commit(staged, undo={os.path.join(dst, n) for n in DERIVED})
    summary.complete = manifest.complete
    if summary.complete:
        clean_dead_temporaries(dst, [s.name for s in plan.shards], set(files) | {MANIFEST})
    return summary
