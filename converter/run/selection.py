"""Which shards this run converts (``--shards``, ``--part``) and on which workers (``--devices``,
``--workers``, ``--workers-per-gpu``)."""
from __future__ import annotations

import os

from ..devices import gpu_count
from ..errors import BadInput
from ..terminal.whole import whole
from .options import Options
from .plan import Plan, ShardPlan
from .workers import cpu_workers


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
