"""Convert a Hub repository while it downloads: shards fetched k ahead into a bounded staging area
(huggingface_hub's cache layout), each checked against its LFS SHA-256, converted as soon as it and
the partner shards it reads are there, and removed once no shard left needs it (``keep_source``:
kept in the cache, where ``hf`` and vLLM find it).

The conversion itself is the local one (converter.pipeline), run on the commit's view
(converter.hub_view) in rounds of the shards that are ready: its DST checks, locks, resume and
finalize are the same. The source's identity is the repo, the commit resolved at the start and each
shard's SHA-256 (``sources.know``), so a rerun continues what is converted and fetches only what
is missing, and a branch that moved since is refused by name.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import hub_remote as remote
from . import hub_view
from .errors import BadInput, OutputError
from .hub_source import HubSource
from .sources import know

AHEAD = 2          # shards on disk at once by default: one converting while the next downloads
VIEWS = ".k3convert-views"   # under the cache folder: one view per repo and commit


def default_cache() -> str:
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def default_dst(source: HubSource) -> str:
    """``NAME-int4`` in the working directory."""
    return os.path.abspath(f"{source.name}-int4")


def view_root(cache_dir: str, snap: remote.Snapshot) -> str:
    return os.path.join(os.path.abspath(cache_dir), VIEWS, snap.source.repo.replace("/", "--"), snap.commit)


def shard_identity(snap: remote.Snapshot, name: str) -> dict[str, Any]:
    """A Hub shard's identity: where it comes from and what it holds."""
    f = snap.files[name]
    if f.sha256 is None:
        raise BadInput("not stored with LFS: the Hub lists no SHA-256 to check it against", file=f"{snap.label}/{name}")
    return {"hub": snap.source.repo, "commit": snap.commit, "size": f.size, "sha256": f.sha256}


def recorded_commit(dst: str, repo: str) -> str | None:
    """The commit a DST's run record says its Hub source was (None: none, or not this repo)."""
    from .pipeline import recorded_identity
    if not os.path.isdir(os.path.join(dst, ".k3convert")):
        return None
    old, _ = recorded_identity(dst)
    for ident in ((old or {}).get("shards") or {}).values():
        if isinstance(ident, dict) and ident.get("hub") == repo and isinstance(ident.get("commit"), str):
            return ident["commit"]
    return None


def check_revision(source: HubSource, snap: remote.Snapshot, dst: str, overwrite: bool) -> None:
    """Refuse, in one line, a revision that moved since DST's first run (its commit is the one to pin)."""
    old = recorded_commit(dst, source.repo)
    if old is not None and old != snap.commit and not overwrite:
        raise OutputError(f"{source} now resolves to commit {snap.commit}, but this DST was converted from "
                          f"{old}: finish it with {source.repo}@{old} (or --overwrite to start again)", file=dst)


@dataclass
class Prepared:
    snap: remote.Snapshot
    view: hub_view.View
    plan: Any
    dst: str


def prepare(source: HubSource, dst: str | None, options, cache_dir: str, full_side_files: bool,
            token: str | None = None) -> Prepared:
    """Resolve the commit, write its view (headers only), know each shard's identity, plan: no shard fetched."""
    snap = remote.resolve(source, token)
    dst = os.path.abspath(dst or default_dst(source))
    check_revision(source, snap, dst, options.overwrite)
    view = hub_view.build(snap, view_root(cache_dir, snap), cache_dir, full_side_files, token)
    for name in view.shards:
        if name in snap.files:
            know(view.path(name), shard_identity(snap, name))
    return Prepared(snap, view, options.plan(view.root), dst)


def staging_bytes(plan, todo, ahead: int) -> int:
    """Peak source bytes on disk: the ``ahead`` largest shards, or a shard with all its partners."""
    size = {s.name: s.bytes_in for s in plan.shards}
    biggest = sorted((s.bytes_in for s in todo), reverse=True)[:ahead]
    need = max((sum(size[n] for n in [s.name] + s.partners) for s in todo), default=0)
    return max(sum(biggest), need)


def describe(source: HubSource, dst: str | None, options, cache_dir: str, ahead: int = AHEAD,
             token: str | None = None) -> dict[str, Any]:
    """``--dry-run`` of a Hub source: the local dry run on the view, plus what downloading takes."""
    from . import pipeline
    p = prepare(source, dst, options, cache_dir, full_side_files=False, token=token)
    info = pipeline.describe(p.plan, p.dst, options)
    todo = [s for s in pipeline.selected(p.plan, options)
            if not (os.path.isdir(p.dst) and pipeline.shard_record(p.dst, s.name))]
    peak = staging_bytes(p.plan, todo, ahead)
    _check_staging(p.dst, cache_dir, info["bytes_out"], peak)
    return {"source": f"{source.repo}@{p.snap.commit}" + (f" ({source.revision})" if source.revision else ""),
            **{k: v for k, v in info.items() if k != "source"},
            "download_bytes": sum(s.bytes_in for s in todo) + sum(
                p.snap.files[r].size for r in p.plan.other_files if r in p.snap.files),
            "staging": os.path.abspath(cache_dir), "staging_peak_bytes": peak, "ahead": ahead}


def _probe(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _check_staging(dst: str, cache_dir: str, out_bytes: int, peak: int) -> None:
    """Room for the output plus the staging area (one check where both are on one file system)."""
    from .pipeline import check_space
    d, c = _probe(dst), _probe(os.path.abspath(cache_dir))
    if os.stat(d).st_dev == os.stat(c).st_dev:
        check_space(dst, out_bytes + peak, at=d)
    else:
        check_space(cache_dir, peak, at=c)


class _Fetcher(threading.Thread):
    """Downloads the files shards need, in order, never more than ``limit`` on disk (beyond that
    only when nothing is ready to convert: a shard with more partners than ``limit`` still goes)."""

    def __init__(self, p: Prepared, order: list[str], limit: int, cache_dir: str, token: str | None,
                 on_event):
        super().__init__(name="k3-hub-fetch", daemon=True)
        self.p, self.order, self.limit, self.cache_dir, self.token = p, order, limit, cache_dir, token
        self.on_event = on_event
        self.cond = threading.Condition()
        self.fetched: dict[str, str] = {}   # name -> path in the cache
        self.on_disk: set[str] = set()
        self.idle = False                   # the converter waits for a shard
        self.error: BaseException | None = None
        self.stop = False
        self.peak = 0
        self.seconds = 0.0

    def staged_bytes(self) -> int:
        return sum(self.p.snap.files[n].size for n in self.on_disk)

    def run(self) -> None:
        try:
            for name in self.order:
                with self.cond:
                    self.cond.wait_for(lambda: self.stop or len(self.on_disk) < self.limit or self.idle)
                    if self.stop:
                        return
                t = time.perf_counter()
                self.on_event("fetch", {"shard": name, "bytes": self.p.snap.files[name].size})
                path = remote.download(self.p.snap, name, self.cache_dir, self.token)
                try:
                    remote.check(self.p.snap, name, path)
                except BadInput:
                    _drop(path)   # a corrupt download is never kept for the next run
                    raise
                self.p.view.place(name, path)
                self.seconds += time.perf_counter() - t
                with self.cond:
                    self.fetched[name] = path
                    self.on_disk.add(name)
                    self.idle = False
                    self.peak = max(self.peak, self.staged_bytes())
                    self.cond.notify_all()
                self.on_event("fetched", {"shard": name, "seconds": round(time.perf_counter() - t, 3)})
        except BaseException as e:  # noqa: BLE001  (handed to the converting thread)
            with self.cond:
                self.error = e
                self.cond.notify_all()


def _drop(cache_path: str) -> None:
    """Remove a file from the HF cache: the blob and the snapshot's link to it."""
    blob = os.path.realpath(cache_path)
    for p in (cache_path, blob):
        try:
            os.unlink(p)
        except OSError:
            pass


@dataclass
class HubSummary:
    summary: Any
    commit: str
    fetched: int
    peak_staging_bytes: int
    fetch_seconds: float


def convert(source: HubSource, dst: str | None, options, on_event=lambda k, f: None, cache_dir: str | None = None,
            ahead: int = AHEAD, keep_source: bool = False, token: str | None = None) -> HubSummary:
    """Convert while downloading (module docstring); the local pipeline's Summary, with the fetch figures."""
    from . import pipeline
    if ahead < 1:
        raise BadInput(f"--ahead {ahead}: expected 1 or more")
    cache_dir = os.path.abspath(cache_dir or default_cache())
    t0 = time.perf_counter()
    p = prepare(source, dst, options, cache_dir, full_side_files=True, token=token)
    plan, view = p.plan, p.view
    names = [s.name for s in plan.shards]
    chosen = pipeline.selected(plan, options)
    done = {s.name for s in chosen if os.path.isdir(p.dst) and pipeline.shard_record(p.dst, s.name)}
    todo = sorted((s for s in chosen if s.name not in done), key=lambda s: s.name)
    _check_staging(p.dst, cache_dir, sum(s.bytes_out for s in todo), staging_bytes(plan, todo, ahead))
    needs = {s.name: [s.name] + s.partners for s in todo}
    order = list(dict.fromkeys(n for s in todo for n in needs[s.name]))
    on_event("plan", {"shards": len(chosen), "todo": len(todo), "bytes_in": sum(s.bytes_in for s in todo),
                      "bytes_out": sum(s.bytes_out for s in todo), "devices": [], "workers":
                      f"converting while downloading from {source.repo}@{p.snap.commit[:12]}, {ahead} shard(s) ahead"})
    fetcher = _Fetcher(p, order, ahead, cache_dir, token, on_event)
    pending = [s.name for s in todo]
    summary = None

    def quiet_plan(kind: str, f: dict) -> None:
        if kind != "plan":  # one plan for the whole run (above), not one per round
            on_event(kind, f)

    if pending:
        fetcher.start()
    try:
        while pending:
            with fetcher.cond:
                def ready() -> list[str]:
                    return [n for n in pending if all(x in fetcher.on_disk for x in needs[n])]
                fetcher.idle = not ready()
                fetcher.cond.notify_all()
                fetcher.cond.wait_for(lambda: fetcher.error is not None or ready())
                if fetcher.error is not None:
                    raise fetcher.error
                batch = ready()
                fetcher.idle = False
            spec = ",".join(str(names.index(n) + 1) for n in batch)
            summary = pipeline.convert(view.root, p.dst, dataclasses.replace(options, shard_spec=spec, part=None),
                                       quiet_plan, plan=plan)
            pending = [n for n in pending if n not in batch]
            still = {x for n in pending for x in needs[n]}
            with fetcher.cond:
                for n in sorted(fetcher.on_disk - still):
                    view.stub(n)   # the view holds its header again; the data goes
                    if not keep_source:
                        _drop(fetcher.fetched[n])
                    fetcher.on_disk.discard(n)
                fetcher.cond.notify_all()
        if summary is None:  # nothing left to convert here: the local run finalizes (or says so)
            summary = pipeline.convert(view.root, p.dst, dataclasses.replace(options, part=None,
                                       shard_spec=",".join(str(names.index(s.name) + 1) for s in chosen)),
                                       quiet_plan, plan=plan)
    finally:
        with fetcher.cond:
            fetcher.stop = True
            fetcher.cond.notify_all()
    summary.seconds = time.perf_counter() - t0
    summary.bytes_in = sum(s.bytes_in for s in todo)
    return HubSummary(summary, p.snap.commit, len(fetcher.fetched), fetcher.peak, fetcher.seconds)
