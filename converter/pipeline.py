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
import math
import os
import re
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import __version__
from .devices import gpu_count
from .digest import ALGORITHM as DIGEST_ALGORITHM, bytes_digest, file_digest
from .errors import BadInput, Interrupted, OutputError, ThresholdExceeded, from_event
from .formats import checkpoint as ckpt
from .formats.dialect import TARGET_FORMAT
from .outputs import expected
from .plan import TEMPORARY, Plan, ShardPlan, build_plan, side_file_target
from .profiles import MAX_EXPERTS
from .quant.rules import DEFAULT as SCALE_RULE_DEFAULT, ScaleRule, recorded_rule
from .safepath import contains, dest_file, lock_file
from .sources import config_identity, content_change, hint, profile_argument, profile_identity, shard_identity
from .state.atomic import commit, copy_current, discard, stage, stage_copy
from .state.files import MANIFEST, REPORT, STATE_DIR, TENSOR_TABLE
from .state.locks import LOCKS, MANIFEST_LOCK, READ_LOCK, RUN_LOCK, DstLock, ShardLocks, state_file, writing
from .state.records import file_fingerprint, json_bytes, read_json, read_rows, rows_bytes, write_json, write_rows
from .validate import TensorFigures, error_ratio, layer_summary, mean, ratio_line
from .whole import whole
from .workers import Task, Workers, cpu_workers


@dataclass
class Options:
    max_rel_rmse: float = 0.15   # optimal requantization of MXFP4 gives ~0.1 on real-like data
    sample_experts: int = 4      # experts per layer whose output error y = W x is measured
    devices: list[str] | None = None  # None: every visible GPU, else CPU
    workers: int | None = 1      # CPU processes when converting on the CPU; None: chosen from the machine
    workers_per_gpu: int = 2     # two shards in flight per GPU: one output file is one write stream
    overwrite: bool = False
    batch_groups: int | None = None   # groups per requantize call [default: 2**20 CPU, 2**21 GPU]
    shard_spec: str | None = None     # --shards 3,5-9: convert only these (batch jobs)
    part: str | None = None           # --part i/n
    profile: str | None = None        # model profile name or file [default: chosen from config.json]
    drop_activation_quant: bool = False  # convert a source that also quantizes activations, weight-only
    inline: bool | None = None        # one worker in this process [default: when torch is imported here]
    scale_rule: ScaleRule = SCALE_RULE_DEFAULT  # --scale-rule (quant/rules.py); a name is parsed here
    fp8_bf16_tp: int | None = None    # --fp8-bf16-at-tp N: FP8 linears vLLM refuses at TP N written as bf16

    def identity(self) -> dict[str, Any]:
        """Every option that changes what DST holds or whether it is complete: what must match for a
        run (a job-array part, a resume, ``finalize``) to continue or share a previous one's DST."""
        return {"version": __version__, "sample_experts": self.sample_experts,
                "profile": profile_identity(self.profile),  # what the profile is, not where it was found
                "drop_activation_quant": self.drop_activation_quant, "scale_rule": self.scale_rule,
                "max_rel_rmse": self.max_rel_rmse,
                **({"fp8_bf16_tp": self.fp8_bf16_tp} if self.fp8_bf16_tp is not None else {})}

    @classmethod
    def recorded(cls, identity: Mapping[str, Any]) -> "Options":
        """The options a DST's run.json records (``identity``), for a standalone ``finalize``."""
        return cls(profile=profile_argument(identity.get("profile")),
                   drop_activation_quant=bool(identity.get("drop_activation_quant")),
                   scale_rule=ScaleRule.parse(recorded_rule(identity)),
                   sample_experts=identity.get("sample_experts", 4),
                   max_rel_rmse=identity.get("max_rel_rmse", Options.max_rel_rmse),
                   fp8_bf16_tp=identity.get("fp8_bf16_tp"))

    def plan(self, src: str) -> Plan:
        return build_plan(src, self.profile, self.drop_activation_quant, self.fp8_bf16_tp)

    def check(self) -> None:
        """Refuse option values that would silently turn a check off (``nan`` compares false)."""
        x = self.max_rel_rmse
        if not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            raise BadInput(f"--max-rel-rmse {x}: expected a finite number >= 0")
        n = self.sample_experts
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_EXPERTS:
            raise BadInput(f"--sample-experts {n!r}: expected a whole number from 0 to {MAX_EXPERTS}")
        t = self.fp8_bf16_tp
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise BadInput(f"--fp8-bf16-at-tp {t!r}: expected a whole number >= 1")
        self.scale_rule = ScaleRule.parse(self.scale_rule)   # the one check of a rule name: typed from here on


def _compared(identity: Mapping[str, Any]) -> dict[str, Any]:
    """An identity as compared: without who recorded it, the hints, where the profile was found,
    and the source shards' mtimes. An mtime says when a copy was made, not what it holds (a job
    array's per-node copies of SRC, T9): like the inode and ctime it is a hint, and where it moved
    the finished shards' content is compared with the digests recorded (``source_change``)."""
    out = {k: v for k, v in identity.items() if k not in (_WHO, HINTS)}
    prof = (out.get("options") or {}).get("profile")
    if isinstance(prof, dict):
        out["options"] = {**out["options"], "profile": {k: v for k, v in prof.items() if k != "file"}}
    shards = out.get("shards")
    if isinstance(shards, dict):
        out["shards"] = {n: {k: v for k, v in i.items() if k != "mtime_ns"} if isinstance(i, dict) else i
                         for n, i in shards.items()}
    return out


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
    scale_rule: str = SCALE_RULE_DEFAULT
    cmp_ratio: float | None = None  # the other rule's error over ours (validate.error_ratio)
    status: str = "partial"
    worst: dict | None = None
    bf16: int = 0   # MXFP4 modules that are not routed experts, written as exact bf16 (plan.Dequant)


Event = Callable[[str, dict], None]  # (kind, fields): progress for bars and JSON logs


def default_dst(src: str) -> str:
    return os.path.abspath(src).rstrip(os.sep) + "-int4"


def resolve_devices(options: Options, shards: int | None = None) -> list[str]:
    """One entry per worker process: each GPU named (or found), else ``workers`` CPU slots."""
    return plan_workers(options, shards)[0]


def plan_workers(options: Options, shards: int | None = None) -> tuple[list[str], str, int | None]:
    """The worker processes (one device each), a line saying how many and why, and each CPU
    worker's threads as that line states them (None for GPU workers: a share of the cores);
    ``shards`` (to convert) caps ``--workers auto``."""
    devices = options.devices
    for d in devices or []:
        if d != "cpu" and not (d.startswith("cuda:") and whole(d[5:]) is not None and d[5:].strip() == d[5:]):
            raise BadInput(f"--devices: {d!r} is not cpu or cuda:N (ROCm GPUs are cuda:N too)")
    if devices and "cpu" in devices and len(devices) > 1:
        raise BadInput("--devices: use either cpu (with --workers) or GPUs, not both")
    if devices and devices != ["cpu"]:
        n = gpu_count()
        for d in devices:
            if int(d[5:]) >= n:   # ASCII digits: checked above
                raise BadInput(f"--devices: {d} is not a visible GPU ("
                               + (f"{n} visible: cuda:0-{n - 1})" if n else "none is: no CUDA or ROCm driver found)"))
    if devices is None and (n := gpu_count()):
        devices = [f"cuda:{i}" for i in range(n)]
    if devices and devices != ["cpu"]:
        per = max(1, options.workers_per_gpu)
        return [d for d in devices for _ in range(per)], f"{len(devices)} GPU(s) x {per} worker(s)", None
    choice = cpu_workers(options.workers, shards)
    return ["cpu"] * choice.workers, str(choice), choice.threads


def shard_count(src: str, options: Options) -> int | None:
    """Shards a run will select, counted from SRC's listing before the plan is read (which
    takes seconds on the real model, while the workers already start); None if unknown."""
    try:
        names = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    except OSError:
        return None
    try:
        return len(select_shards(names, options.shard_spec, options.part)) if names else None
    except BadInput:  # the plan reports it, against the index's shards
        return None


def select_shards(names: list[str], spec: str | None = None, part: str | None = None) -> list[str]:
    """``--shards 3,5-9`` (1-based, in file-name order) and/or ``--part i/n`` (round robin).
    None selects every shard; a selection of no shard is refused, whatever made it empty (an
    empty value, ``--shards 1`` with ``--part 2/3``, more parts than shards): a job file's or a
    script's empty variable must neither turn into "all" nor into a run that converts nothing
    and exits 0. Numbers are ASCII digits (``whole``); a range needs both ends (``2-`` is
    refused, not read as 2 alone or as 2 to the end: docs/decisions.md)."""
    chosen = list(names)
    if spec is not None:
        if not spec.strip():
            raise BadInput(f"--shards {spec!r}: selects no shard (expected N or N-M, comma-separated)")
        idx: set[int] = set()
        for tok in spec.split(","):
            a, dash, b = tok.strip().partition("-")
            lo, hi = whole(a), whole(b) if dash else whole(a)
            if dash and a.strip() and not b.strip():
                raise BadInput(f"--shards: {tok!r} has no end: write {a.strip()}-{len(names)} for shard "
                               f"{a.strip()} to the last")
            if lo is None or hi is None:
                raise BadInput(f"--shards: {tok!r} is not N or N-M (ASCII digits)")
            if lo > hi:
                raise BadInput(f"--shards: {tok!r} is reversed (write {hi}-{lo})")
            if not 1 <= lo <= hi <= len(names):
                raise BadInput(f"--shards: {tok!r} is outside 1-{len(names)}")
            idx.update(range(lo, hi + 1))
        chosen = [n for i, n in enumerate(names, 1) if i in idx]
    if part is not None:
        i_s, slash, n_s = part.partition("/")
        i, n = whole(i_s), whole(n_s)
        if not slash or i is None or n is None:
            raise BadInput(f"--part: {part!r} is not i/n (ASCII digits)")
        if not 1 <= i <= n:
            raise BadInput(f"--part: {part!r} needs 1 <= i <= n")
        chosen = [c for c in chosen if names.index(c) % n == i - 1]
        if not chosen:
            given = f"--shards {spec} with " if spec is not None else ""
            raise BadInput(f"{given}--part {part} selects no shard (of {len(names)}): "
                           + ("the two selections do not meet" if spec is not None
                              else f"use at most {len(names)} parts"))
    return chosen


def selected(plan: Plan, options: Options) -> list[ShardPlan]:
    names = set(select_shards([s.name for s in plan.shards], options.shard_spec, options.part))
    return [s for s in plan.shards if s.name in names]


def _state(dst: str, *parts: str) -> str:
    return os.path.join(dst, STATE_DIR, *parts)


def _refuse_linked_state(dst: str) -> None:
    """DST's state folder is read and written: through a planted link it would be elsewhere."""
    if os.path.islink(_state(dst)):
        raise OutputError(f"{STATE_DIR} is a symlink: refusing to write through it", file=dst)


IDENTITY = "run.json"
_WHO = "created_by"  # which run recorded the identity: named when another is refused
HINTS = "hints"      # per source shard, what tells that it may have been written since (sources.hint)


def run_identity(plan: Plan, options: Options) -> dict[str, Any]:
    return {
        "tool": "k3convert", "options": options.identity(), "source": plan.src,
        "profile": plan.profile.name, "quantization": plan.source.record(),
        "config": config_identity(os.path.join(plan.src, "config.json")),
        "shards": {s.name: shard_identity(s.path) for s in plan.shards},
    }


def source_change(dst: str, plan: Plan, recorded: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """What the identity cannot see: a finished shard's source (or partner) rewritten in place with
    its mtime put back. Re-read only where a hint moved (sources.content_change)."""
    records = {s.name: shard_record(dst, s.name) for s in plan.shards}
    return content_change(plan.shards, records, recorded.get(HINTS) or {})


def identity_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """What differs between a recorded identity and this run's, in words (both values), or None."""
    old, new = _compared(old), _compared(new)
    if old == new:
        return None
    if old.get("source") != new.get("source"):
        return f"another source: {old.get('source')} (recorded) vs {new.get('source')}"
    o, n = old.get("options") or {}, new.get("options") or {}
    for key in sorted(set(o) | set(n)):
        if o.get(key) != n.get(key):
            flag = "--" + key.replace("_", "-")
            return f"other options: {flag} {o.get(key)!r} (recorded) vs {n.get(key)!r}"
    if old.get("config") != new.get("config"):
        return "source files changed: config.json"
    os_, ns = old.get("shards") or {}, new.get("shards") or {}
    for name in sorted(set(os_) | set(ns)):
        if os_.get(name) != ns.get(name):
            what = "is new" if name not in os_ else "is gone" if name not in ns else "changed"
            return f"source files changed: {name} {what}"
    return "source files changed"


def _who() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _named(old: Mapping[str, Any] | None) -> str:
    w = old.get(_WHO) if old else None
    if not isinstance(w, dict):
        return "an earlier run"
    return f"the run of pid {w.get('pid')} on {w.get('host')} started {w.get('started_at')}"


def _remove(path: str) -> None:
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)


def _wipe(dst: str) -> None:
    """Empty DST for --overwrite, keeping the lock files (other runs may be waiting on them)."""
    for name in os.listdir(dst):
        if name != STATE_DIR:
            _remove(os.path.join(dst, name))
    for name in os.listdir(_state(dst)):
        if name not in LOCKS:
            _remove(_state(dst, name))


def _clean_temporaries(dst: str, plan: Plan, options: Options) -> None:
    """Drop what killed runs left: only called with no other run using DST, so none of it can be
    work in progress. Only this tool's own temporaries: anything in its state folder, and in DST
    ``NAME.partial`` of a shard and ``NAME.tmpPID`` of a file a run writes there (the plan's
    outputs, what the manifest records as written, the manifest itself). A user's
    ``notes/eval.tmp`` or ``run.partial`` is theirs (T4)."""
    state = _state(dst)
    for f in os.listdir(state):
        if TEMPORARY.search(f):
            discard(os.path.join(state, f))
    want = expected(plan, options.scale_rule)
    ours = want.names | set(DERIVED) | {MANIFEST} | _recorded_files(dst)
    _clean_dead_temporaries(dst, [s.name for s in plan.shards], ours)


def _reopen(dst: str) -> None:
    """A shard is about to be (re)done: first DST must stop claiming to be complete, so that a
    kill during the redo cannot leave a "complete" manifest with a shard missing."""
    with lock_file(_state(dst, MANIFEST_LOCK)) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with writing(dst):  # an upload reading DST is never given a half-redone one (S14)
            _reset_complete(dst)


DERIVED = (ckpt.INDEX, "config.json", REPORT, TENSOR_TABLE)  # written by finalize from the shard records


def _reset_complete(dst: str) -> None:
    """If the manifest says complete (or cannot be read, so may), make it say partial (an unreadable
    one is removed: finalize writes it anew), then remove what finalize derives (``DERIVED``):
    meanwhile no loader takes DST for a checkpoint, and no report describes shards that may go.
    Called with manifest.lock held."""
    path = os.path.join(dst, MANIFEST)
    try:
        manifest = read_json(path)
    except OutputError:  # corrupt: no advice to give, the run rewrites it (T13)
        manifest = None
        discard(path)
        if os.path.lexists(path):
            raise OutputError("is corrupt and cannot be removed", file=path) from None
    else:
        if not isinstance(manifest, dict) or manifest.get("complete") is False:
            return
        manifest.update(complete=False, status="partial")
        manifest.pop("finished_at", None)
        write_json(path, manifest)
    for name in DERIVED:
        p = os.path.join(dst, name)
        try:
            if os.path.lexists(p):
                os.unlink(p)
        except OSError as e:
            raise OutputError(f"cannot remove: {e.strerror}", file=p) from None


_FOREIGN = "exists, is not empty and holds no k3convert state: choose a new directory"


def _entries(dst: str) -> list[str]:
    """What DST holds besides our state folder."""
    return [f for f in os.listdir(dst) if f != STATE_DIR]


def _usable_dst(plan: Plan, dst: str) -> None:
    """What refuses DST before anything of ours is put there (the run and --dry-run alike): a
    directory holding neither our state folder nor our manifest is someone else's."""
    if contains(plan.src, dst) or contains(dst, plan.src):
        raise OutputError(f"DST and SRC ({plan.src}) must not contain each other", file=dst)
    if os.path.exists(dst) and (not os.path.isdir(dst) or not os.access(dst, os.W_OK | os.X_OK)):
        raise OutputError("is not a writable directory", file=dst)
    if os.path.isdir(dst) and not os.path.lexists(_state(dst)) and not os.path.isfile(os.path.join(dst, MANIFEST)) \
            and _entries(dst):
        raise OutputError(_FOREIGN, file=dst)  # (a run started at the same moment may just have made the
        # state folder: that one is not foreign)


def recorded_identity(dst: str) -> tuple[dict | None, str | None]:
    """DST's run.json (None when absent), or why it cannot be continued: unreadable (T13)."""
    path = _state(dst, IDENTITY)
    try:
        old = read_json(path)
    except OutputError:
        return None, f"its run record {STATE_DIR}/{IDENTITY} is corrupt"
    if old is not None and not isinstance(old, dict):
        return None, f"its run record {STATE_DIR}/{IDENTITY} is not an object"
    return old, None


def _unrecorded(dst: str) -> str:
    """Why a DST of ours without a run record cannot be continued, in words (T12, T13)."""
    state = [f for f in os.listdir(_state(dst)) if f not in LOCKS] if os.path.isdir(_state(dst)) else []
    if not state and os.path.isfile(os.path.join(dst, MANIFEST)):  # (locks: this run may just have made it)
        return (f"a k3convert output without its {STATE_DIR} state folder, copied without it? "
                "verify and upload take it as it is")
    return f"no run record {STATE_DIR}/{IDENTITY}"


def judge_dst(plan: Plan, dst: str, options: Options, ident: Mapping[str, Any], old: Mapping[str, Any] | None,
              unreadable: str | None = None) -> tuple[str | None, dict[str, Any]]:
    """Whether DST (its recorded identity ``old``, None if none; ``unreadable``: why that record
    cannot be read) continues this conversion: None, or what differs, which --overwrite replaces
    (else refused, exit 4); and the source hints to record. The one decision of the run and of
    --dry-run. Every refusal's advice works when followed: output of ours that cannot be continued
    (a corrupt or missing run record, a copy without the state folder) is replaced by --overwrite."""
    hints = {s.name: hint(s.path) for s in plan.shards}
    if old is None:
        if unreadable is None and not _entries(dst):
            return None, hints
        what: str | None = unreadable or _unrecorded(dst)
        if not options.overwrite:
            raise OutputError(f"holds k3convert output that cannot be continued ({what}): "
                              "use --overwrite to replace it", file=dst)
        return what, hints
    what = identity_difference(old, ident)
    if what is None:
        what, hints = source_change(dst, plan, old)
    if what is not None and not options.overwrite:
        raise OutputError(f"holds a different conversion ({what}), recorded by {_named(old)}: "
                          "use --overwrite to replace it", file=dst)
    return what, hints


def _in_use(dst: str, what: str, old: Mapping[str, Any] | None) -> OutputError:
    return OutputError(f"holds a different conversion ({what}) that another k3convert run is using "
                       f"(recorded by {_named(old)}): refusing to replace it", file=dst)


def _held(path: str) -> bool:
    """Whether another process holds a flock on the lock file ``path`` (absent: no). Probed
    exclusively without waiting and released at once; nothing is created."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def prepare_dst(plan: Plan, dst: str, options: Options) -> DstLock:
    """Create DST, or check that it continues this very conversion (else refuse/replace).

    Returns the DST lock, held: run.json is read, compared and written under it, and the
    caller claims its shards before letting it go (``DstLock.join``), so runs started at once
    agree on one identity or all but one are refused, naming the run that recorded it."""
    _usable_dst(plan, dst)
    ident = run_identity(plan, options)
    try:
        _refuse_linked_state(dst)
        os.makedirs(_state(dst), exist_ok=True)
        _refuse_linked_state(dst)
    except OSError as e:
        raise OutputError(f"cannot write: {e.strerror}", file=dst) from None
    lock = DstLock(_state(dst))
    try:
        old, unreadable = recorded_identity(dst)
        what, hints = judge_dst(plan, dst, options, ident, old, unreadable)
        if what is not None:
            if not lock.alone():
                raise _in_use(dst, what, old)
            with writing(dst):
                _wipe(dst)
            old = None
        if lock.alone():
            _clean_temporaries(dst, plan, options)
        if old is None:
            write_json(_state(dst, IDENTITY), {**ident, HINTS: hints, _WHO: _who()})
        elif old.get(HINTS) != hints:  # the content was re-read and still matches (cp -al, chmod)
            write_json(_state(dst, IDENTITY), {**old, HINTS: hints})
    except OSError as e:
        lock.close()
        raise OutputError(f"cannot write: {e.strerror}", file=e.filename or dst) from None
    except BaseException:
        lock.close()
        raise
    return lock


def space_margin(need: int) -> int:
    """Head-room beyond the estimate: 2% of the job, a tenth of it up to 1 GiB, and 4 MiB at
    least (file system metadata): a small job fits a small file system."""
    return max(need // 50, min(1 << 30, need // 10), 4 << 20)


def gb(n: int) -> str:
    """Bytes in GB with two significant digits at least: a small figure never reads 0.0."""
    if n >= 1e9 or n <= 0:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e9:.{1 - math.floor(math.log10(n / 1e9))}f} GB"


def bytes_needed(plan: Plan, dst: str, todo: list[ShardPlan], emptied: bool = False) -> int:
    """What the rest of the run writes: its shards, and the side files not yet in DST (every one
    when ``emptied``: DST is about to be replaced)."""
    side = 0
    for rel in plan.other_files:  # the same test as finalize's, which copies only these
        path = os.path.join(plan.src, rel)
        if emptied or not copy_current(path, os.path.join(dst, side_file_target(rel))):  # OutputError naming it
            try:
                side += os.stat(path).st_size
            except OSError as e:
                raise OutputError(f"cannot read: {e.strerror}", file=path) from None
    return sum(s.bytes_out for s in todo) + side


def check_space(dst: str, need: int, freed: int = 0, at: str | None = None) -> None:
    """Refuse (exit 4) a job that does not fit; ``freed``: bytes a replacement removes first; ``at``:
    the folder whose file system DST will be on (the dry run's DST may not exist yet)."""
    free = shutil.disk_usage(at or dst).free + freed
    margin = space_margin(need)
    if free < need + margin:
        raise OutputError(f"needs {gb(need)} (+{gb(margin)} margin) but has {gb(free)} free", file=dst)


def shard_record(dst: str, name: str) -> dict | None:
    """A finished shard's record, if its output is still the file that was written."""
    try:
        rec = read_json(state_file(dst, name, ".done.json"))
    except OutputError:  # unreadable (T13): the shard is not known to be done, so it is converted again
        return None
    path = os.path.join(dst, name)
    if not isinstance(rec, dict) or not os.path.isfile(path) or file_fingerprint(path) != rec.get("output"):
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
                    _reopen(dst)
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
    if summary.status == "failed-validation":  # also shards finished (unchecked) by earlier runs
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
    _usable_dst(plan, dst)  # the run's own decisions, so that the dry run says what the run will do
    old, unreadable = recorded_identity(dst) if os.path.isdir(_state(dst)) else (None, None)
    action = "create it" if not os.path.exists(dst) else "start in it (empty)"
    if os.path.isdir(dst):
        what, _ = judge_dst(plan, dst, options, run_identity(plan, options), old, unreadable)  # refused: exit 4
        if what is not None:
            held = "a different conversion" if old is not None else "k3convert output that cannot be continued"
            action = f"replace it (--overwrite): it holds {held} ({what})"
            if _held(_state(dst, RUN_LOCK)):  # the run's own refusal (prepare_dst: lock.alone)
                raise _in_use(dst, what, old)
        elif old is not None:
            action = "continue the conversion it holds"
    replaced = action.startswith("replace")
    if replaced:  # the wipe waits for no upload (T7)
        _refuse_while_read(dst)
    done = [s.name for s in chosen if old is not None and not replaced and shard_record(dst, s.name)]
    todo = [s for s in chosen if s.name not in done]
    probe = dst
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    # the run's space check (issue 33): a replacement first frees what DST holds
    check_space(dst, bytes_needed(plan, dst, todo, emptied=replaced), _bytes_under(dst) if replaced else 0, probe)
    _refuse_while_read(dst)  # every run ends in finalize, which changes DST: not under an upload (T7)
    devices, workers, _ = plan_workers(options, len(chosen))
    return {
        "source": plan.src, "dst": dst, "dst_action": action, "profile": f"{plan.profile.name} ({plan.profile_reason})",
        "scale_convention": plan.source.scale_note, "scale_rule": options.scale_rule, "devices": devices,
        "workers": workers,
        "shards": len(chosen), "shards_done": len(done), "shards_todo": len(todo),
        "tensors_to_convert": sum(len(s.converts) for s in todo),
        "modules_to_bf16": sum(len(s.dequants) for s in todo),
        "tensors_copied": sum(len(s.items) - len(s.pairs) for s in todo),
        "modules_split_across_shards": sum(c.scale.path != c.packed.path for s in todo for c in s.pairs),
        "also_reads": {s.name: s.partners for s in todo if s.partners},
        "dropped": [d["where"] for d in plan.source.dropped] + plan.dropped,
        "bytes_in": sum(s.bytes_in for s in todo), "bytes_out": sum(s.bytes_out for s in todo),
        "free_bytes_at_dst": shutil.disk_usage(probe).free, "activation": plan.activation,
    }


def _refuse_while_read(dst: str) -> None:
    """The run's refusal when an upload reads DST (``manifest.writing``, exit 4), for the dry run:
    its read lock taken and released at once, only where a lock file is already there."""
    if os.path.exists(_state(dst, READ_LOCK)):
        with writing(dst):
            pass


def _bytes_under(dst: str) -> int:
    """Bytes the files under DST occupy (what --overwrite's wipe frees)."""
    total = 0
    for d, _, files in os.walk(dst):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _convert_shards(plan: Plan, dst: str, options: Options, todo: list[ShardPlan], n_selected: int,
                    workers: Workers, on_event: Event) -> None:
    on_event("plan", {"shards": n_selected, "todo": len(todo), "bytes_in": sum(s.bytes_read for s in todo),
                      "bytes_out": sum(s.bytes_out for s in todo), "devices": workers.devices[: max(1, len(todo))],
                      "workers": workers.note})
    if not todo:
        return
    experts = 1 + max((c.expert or 0) for s in plan.shards for c in s.converts)
    stride = max(1, -(-experts // max(1, options.sample_experts)))
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


def finalize(dst: str, plan: Plan | None = None, options: Options | None = None) -> Summary:
    """Write the manifest from the shard records; when every shard is done, also the side
    files, config, index and report, and mark the manifest complete (last)."""
    t0 = time.perf_counter()
    dst = os.path.abspath(dst)
    _refuse_linked_state(dst)
    nothing = "holds no k3convert state (nothing to finalize)"
    if not os.path.isdir(_state(dst)):
        raise OutputError(f"{_unrecorded(dst)}: nothing to finalize" if os.path.isfile(os.path.join(dst, MANIFEST))
                          else nothing, file=dst)
    # the locks first, one at a time, then what they protect: run.json read (and the plan built
    # from it) before them could describe a source that an --overwrite run replaced meanwhile
    with lock_file(_state(dst, RUN_LOCK)) as using:
        fcntl.flock(using, fcntl.LOCK_SH)  # DST is in use: --overwrite must not empty it meanwhile
        with lock_file(_state(dst, MANIFEST_LOCK)) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # several batch jobs may finish at once
            run, unreadable = recorded_identity(dst)
            if run is None:
                raise OutputError(f"{unreadable or _unrecorded(dst)}: nothing to finalize; rerun mxfp4-to-int4 "
                                  "with --overwrite to start again" if unreadable or _entries(dst) else nothing,
                                  file=dst)
            if options is None:
                options = Options.recorded(run.get("options") or {})
            plan = plan or options.plan(run["source"])
            # what run.json records is what the shards were converted from, with: checked here too
            what = identity_difference(run, run_identity(plan, options)) or source_change(dst, plan, run)[0]
            if what is not None:
                raise OutputError(f"holds a conversion that no longer matches ({what}), recorded by "
                                  f"{_named(run)}: rerun mxfp4-to-int4 (--overwrite to start again)", file=dst)
            with writing(dst):
                return _finalize_locked(dst, plan, options, run, t0)


def _makedirs(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the folder: {e.strerror}", file=path) from None


def _source_record(plan: Plan, run: dict) -> dict[str, Any]:
    return {"path": plan.src, "profile": {**plan.profile.record(), "reason": plan.profile_reason},
            "quantization": plan.source.record(), "dropped_tensors": plan.dropped, "dequantized": plan.dequantized,
            "config": run["config"], "shards": run["shards"]}


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


_DEAD = re.compile(r"tmp\d*")  # the tail of a temporary's name (manifest.temp_name; plan.TEMPORARY)


def _clean_dead_temporaries(dst: str, shards: list[str], written: set[str]) -> None:
    """Remove what killed runs left of the files finalize writes (``NAME.tmpPID``, any pid) and of
    the shards (``NAME.partial``). Safe without DST to itself: finalize writes those names only
    under manifest.lock, held here, and every shard is done, so no run is writing one."""
    ours: dict[str, set[str]] = {}
    for rel in written:
        ours.setdefault(os.path.dirname(rel), set()).add(os.path.basename(rel))  # the manifest: DST itself
    root = os.path.realpath(dst)
    for folder, names in ours.items():
        inside = os.path.normpath(os.path.join(root, folder))
        if not contains(root, inside) or os.path.realpath(os.path.join(dst, folder)) != inside:
            continue  # outside DST, or through a link (names in a manifest are untrusted)
        try:
            entries = os.listdir(os.path.join(dst, folder))
        except OSError:
            continue
        for e in entries:
            stem, _, tail = e.rpartition(".")
            if stem in names and _DEAD.fullmatch(tail) or not folder and stem in shards and tail == "partial":
                discard(os.path.join(dst, folder, e))


def _recorded_files(dst: str) -> set[str]:
    """The files beside the shards that DST's manifest says an earlier finalize wrote."""
    try:
        m = read_json(os.path.join(dst, MANIFEST))
    except OutputError:  # a corrupt manifest is replaced; what it named is not known
        return set()
    files = m.get("files") if isinstance(m, dict) else None
    return {n for n in files if isinstance(n, str)} if isinstance(files, dict) else set()


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
    return {"scale_rule": rule, "compare_rule": rule.compared_with,
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
    status = "failed-validation" if failed else ("complete" if all_done else "partial")
    summary = Summary(dst, len(done), len(plan.shards), len(figs), time.perf_counter() - t0,
                      sum(s.bytes_in for s in done), sum(s.bytes_out for s in done), layer_summary(figs),
                      status=status,
                      worst=None if worst is None else {"tensor": worst.name, "rel_rmse": worst.rel_rmse})
    summary.scale_rule, summary.cmp_ratio = options.scale_rule, error_ratio(figs)
    summary.bf16 = sum(len(s.dequants) for s in done)
    source = _source_record(plan, run)
    source_format = f"{plan.source.dialect} MXFP4"
    manifest = {
        "tool": "k3convert", "version": __version__, "status": status, "complete": False,
        "source_format": source_format, "target_format": TARGET_FORMAT, "activation": plan.activation,
        "source": source, "options": run["options"], "scale_rule": options.scale_rule,
        "digest_algorithm": DIGEST_ALGORITHM,
        "shards": {n: r for n, r in records.items() if r},
    }
    # every file is first written under a temporary name, then all are renamed, the manifest
    # last: a failure (a full disk, no inodes) on the way leaves no config or index that looks
    # like a finished checkpoint, and no temporary
    staged: list[tuple[str, str]] = []
    files: dict[str, dict[str, Any]] = {}  # every file written beside the shards: bytes and digest
    recorded = _recorded_files(dst)
    if all_done or failed:  # DERIVED is replaced: an old "complete" must not stand over a half-replaced set
        _reset_complete(dst)  # (before staging: it writes the manifest through the same temporary name)
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
            staged.append(_staged_record(dst, REPORT, json_bytes({
                "tool": "k3convert", "version": __version__, "source": plan.src, "status": status,
                "profile": source["profile"], "quantization": source["quantization"],
                "dropped_tensors": plan.dropped, "dequantized": plan.dequantized,
                "source_format": source_format, "target_format": TARGET_FORMAT,
                "activation": plan.activation, "max_rel_rmse": options.max_rel_rmse, "tensors": len(figs),
                "worst": summary.worst, "rel_rmse_mean": mean(r.rel_rmse for r in figs),
                **_rule_record(options.scale_rule, figs),
                "tensor_table": TENSOR_TABLE, "layers": summary.layers,
            }), files))
        manifest["files"] = dict(sorted(files.items()))
        if all_done and not failed:
            manifest["complete"] = True
            manifest["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        path = os.path.join(dst, MANIFEST)
        staged.append((stage(path, json_bytes(manifest)), path))
    except BaseException:
        for tmp, _ in staged:
            discard(tmp)
        raise
    # renamed before the manifest failed: what would look like a finished checkpoint goes
    commit(staged, undo={os.path.join(dst, n) for n in DERIVED})
    summary.complete = manifest["complete"]
    if summary.complete:
        _clean_dead_temporaries(dst, [s.name for s in plan.shards], set(files) | {MANIFEST})
    return summary
