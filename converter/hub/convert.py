"""Convert a Hub repository while it downloads: shards fetched k ahead into a bounded staging area
(huggingface_hub's cache layout), each checked against its LFS SHA-256, converted as soon as it and
the partner shards it reads are there, and removed once no shard left needs it (``keep_source``:
kept in the cache, where ``hf`` and vLLM find it).

The conversion itself is the local one (converter.run.pipeline), one run on the commit's view
(converter.hub.view) whose workers wait for each shard's files (converter.run.fetch_wait): its DST
checks, locks, resume and finalize are the same. The source's identity is the repo, the commit
resolved at the start and each shard's SHA-256 (``sources.know``), so a rerun continues what is
converted and fetches only what is missing, and a branch that moved since is refused by name.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import BadInput, ConvertError, OutputError
from ..run import fetch_wait
from ..run.sources import know
from . import owners, remote as remote, view as hub_view
from .owners import Fate
from .source import HubSource

AHEAD = 2          # shards on disk at once by default: one converting while the next downloads


def default_cache() -> str:
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def default_dst(source: HubSource) -> str:
    """``NAME-int4`` in the working directory."""
    return os.path.abspath(f"{source.name}-int4")


def shard_identity(snap: remote.Snapshot, name: str) -> dict[str, Any]:
    """A Hub shard's identity: where it comes from and what it holds."""
    f = snap.files[name]
    if f.sha256 is None:
        raise BadInput("not stored with LFS: the Hub lists no SHA-256 to check it against", file=f"{snap.label}/{name}")
    return {"hub": snap.source.repo, "commit": snap.commit, "size": f.size, "sha256": f.sha256}


def recorded_commit(dst: str, repo: str) -> str | None:
    """The commit a DST's run record says its Hub source was (None: none, or not this repo)."""
    from ..run.pipeline import recorded_identity
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
    space: owners.RunSpace   # this run's folder under the cache (the view's); ``close`` when done


def prepare(source: HubSource, dst: str | None, options, cache_dir: str, full_side_files: bool,
            token: str | None = None) -> Prepared:
    """Resolve the commit, write this run's own view of it (headers only), know each shard's identity,
    plan: no shard fetched. The plan's source is the commit (``origin``), not the folder: the run
    record of a DST does not depend on the cache a run used, nor on which run's view it read."""
    snap = remote.resolve(source, token)
    dst = os.path.abspath(dst or default_dst(source))
    check_revision(source, snap, dst, options.overwrite)
    space = owners.RunSpace(cache_dir, source.repo)
    try:
        view = hub_view.build(snap, space.view, cache_dir, full_side_files, token)
        for name in view.shards:
            if name in snap.files:
                know(view.path(name), shard_identity(snap, name))
        plan = dataclasses.replace(options.plan(view.root), origin=snap.label)
    except BaseException:
        space.close()
        raise
    return Prepared(snap, view, plan, dst, space)


def task_order(todo) -> list:
    """The order the workers take shards in (workers.Workers.run)."""
    from ..run.workers import size_first
    return sorted(todo, key=size_first)


def staging_bytes(plan, todo, ahead: int) -> int:
    """Peak source bytes on disk, shards converted in order: the files the next ``ahead`` unfinished shards
    read, and those fetched earlier that a later shard still reads (a partner)."""
    size = {s.name: s.bytes_in for s in plan.shards}
    order = task_order(todo)
    needs = [[s.name] + s.partners for s in order]
    peak = 0
    for i in range(len(order)):
        fetched = {n for t in needs[: i + ahead] for n in t}
        still = {n for t in needs[i:] for n in t}
        peak = max(peak, sum(size[n] for n in fetched & still))
    return peak


def describe(source: HubSource, dst: str | None, options, cache_dir: str, ahead: int = AHEAD,
             token: str | None = None) -> dict[str, Any]:
    """``--dry-run`` of a Hub source: the local dry run on the view, plus what downloading takes."""
    from ..run import identity, pipeline, selection
    from ..run.space import NoRoom
    p = prepare(source, dst, options, cache_dir, full_side_files=False, token=token)
    try:
        refusal = None
        try:
            info = pipeline.describe(p.plan, p.dst, options)
        except NoRoom as e:   # the plan first, then the refusal
            assert e.plan is not None   # describe gives every NoRoom it raises its plan
            info, refusal = e.plan, e
        todo = [s for s in selection.selected(p.plan, options)
                if not (os.path.isdir(p.dst) and identity.shard_record(p.dst, s.name))]
        peak = staging_bytes(p.plan, todo, ahead)
        out = {"source": f"{source.repo}@{p.snap.commit}" + (f" ({source.revision})" if source.revision else ""),
               **{k: v for k, v in info.items() if k != "source"},
               "download_bytes": sum(s.bytes_in for s in todo) + sum(
                   p.snap.files[r].size for r in p.plan.other_files if r in p.snap.files),
               "staging": os.path.abspath(cache_dir), "staging_peak_bytes": peak, "ahead": ahead}
        try:
            _check_staging(p.dst, cache_dir, info["bytes_out"], peak)
        except NoRoom as e:
            refusal = refusal or e
        if refusal is not None:
            refusal.plan = out
            raise refusal
        return out
    finally:
        p.space.close()


def _probe(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _check_staging(dst: str, cache_dir: str, out_bytes: int, peak: int) -> None:
    """Room for the output plus the staging area (one check where both are on one file system)."""
    from ..run.pipeline import check_space
    d, c = _probe(dst), _probe(os.path.abspath(cache_dir))
    if os.stat(d).st_dev == os.stat(c).st_dev:
        check_space(dst, out_bytes + peak, at=d)
    else:
        check_space(cache_dir, peak, at=c)


class _Fetcher(threading.Thread):
    """Downloads what the shards need, in the order the workers take them (``task_order``): the
    sources of at most ``ahead`` unfinished shards at once; each file checked (size, SHA-256, and
    its header against the plan's), put in this run's view, and its pending marker removed
    (converter.run.fetch_wait), or the marker told why it will not come. A shard done with goes
    back to its stub and its blob to the cache's owners (converter.hub.owners)."""

    def __init__(self, p: Prepared, tasks: list[str], needs: dict[str, list[str]], ahead: int, cache_dir: str,
                 token: str | None, on_event, keep_source: bool):
        super().__init__(name="k3-hub-fetch", daemon=True)
        self.p, self.tasks, self.needs, self.ahead = p, tasks, needs, ahead
        self.cache_dir, self.token, self.on_event, self.keep_source = cache_dir, token, on_event, keep_source
        self.cond = threading.Condition()
        self.fetched: dict[str, str] = {}   # name -> its path in the cache
        self.on_disk: set[str] = set()
        self.finished: set[str] = set()     # shards converted (``done`` events)
        self.fates: dict[Fate, list[str]] = {}
        self.found = 0                      # files that were in the cache already (not downloaded)
        self.error: BaseException | None = None
        self.stop = False
        self.peak = 0
        self.seconds = 0.0
        files = sorted({n for t in tasks for n in needs[t]})
        p.space.claim({self._sha(n) for n in files})   # no other run removes them meanwhile
        self.pending = fetch_wait.Pending(p.view.root)
        for name in files:
            self.pending.mark(p.view.path(name))

    def _sha(self, name: str) -> str:
        sha = self.p.snap.files[name].sha256
        assert sha is not None   # shard_identity refused a shard the Hub lists no SHA-256 for
        return sha

    def staged_bytes(self) -> int:
        return sum(self.p.snap.files[n].size for n in self.on_disk)

    def run(self) -> None:
        name = None
        try:
            for i, task in enumerate(self.tasks):
                with self.cond:   # the sources of at most `ahead` unfinished shards on disk
                    # wait_for calls the predicate now, in this iteration: i is the current one
                    self.cond.wait_for(lambda: self.stop or
                                       sum(t not in self.finished for t in self.tasks[:i]) < self.ahead)  # noqa: B023
                    if self.stop:
                        return
                    todo = [n for n in self.needs[task] if n not in self.on_disk]
                for name in todo:
                    self._fetch(name)
                name = None
        except BaseException as e:  # noqa: BLE001  (the workers waiting for it are told; the run stops)
            with self.cond:
                self.error = e
                self.cond.notify_all()
            err = e if isinstance(e, ConvertError) else OutputError(f"fetching failed: {e!r}")
            for n in self.p.view.shards:   # every shard still on its way: the run stops at the first
                if n not in self.on_disk and n in self.p.snap.files:
                    fetch_wait.failed(self.p.view.path(n), err)
        finally:
            self.pending.done()

    def _fetch(self, name: str) -> None:
        t = time.perf_counter()
        f = self.p.snap.files[name]
        self.on_event("fetch", {"shard": name, "bytes": f.size})
        self.found += self.p.space.before_fetch(self._sha(name), f.size)
        path = remote.download(self.p.snap, name, self.cache_dir, self.token)
        if why := remote.problem(self.p.snap, name, path):   # a bad download is never kept for the next run
            then = "the download was removed; run again to fetch it anew" if self.p.space.discard_bad(
                self._sha(name), [path]) else ("the file in the cache was not fetched by k3convert: yours, "
                                               "not removed; remove it, or use another --cache-dir")
            raise BadInput(f"{why}: not converted ({then})", file=f"{self.p.snap.label}/{name}")
        self.p.view.check_header(name, path)
        self.p.view.place(name, path)
        self.seconds += time.perf_counter() - t
        with self.cond:
            self.fetched[name] = path
            self.on_disk.add(name)
            self.peak = max(self.peak, staged := self.staged_bytes())
            self.cond.notify_all()
        fetch_wait.arrived(self.p.view.path(name))
        self.on_event("fetched", {"shard": name, "seconds": round(time.perf_counter() - t, 3), "staged_bytes": staged})

    def converted(self, shard: str) -> None:
        """A shard is done: every file no unfinished shard reads goes back to its stub, and its blob to
        the cache's owners (removed where this run fetched it and no other run reads it)."""
        with self.cond:
            self.finished.add(shard)
            still = {x for t in self.tasks if t not in self.finished for x in self.needs[t]}
            for n in sorted(self.on_disk - still):
                self.p.view.stub(n)
                fate = self.p.space.release(self._sha(n), [self.fetched[n]], self.keep_source)
                self.fates.setdefault(fate, []).append(n)
                self.on_disk.discard(n)
            self.cond.notify_all()


@dataclass
class HubSummary:
    summary: Any
    commit: str
    fetched: int
    peak_staging_bytes: int
    fetch_seconds: float
    fates: dict[Fate, list[str]]   # what became of each shard this run was done with
    found: int = 0                 # of ``fetched``, already in the cache


def convert(source: HubSource, dst: str | None, options, on_event=lambda k, f: None, cache_dir: str | None = None,
            ahead: int = AHEAD, keep_source: bool = False, token: str | None = None) -> HubSummary:
    """Convert while downloading (module docstring): one local run over this run's view, whose workers
    wait for each shard's files (converter.run.fetch_wait) while the fetcher brings them ``ahead``
    shards ahead. The fetcher starts once the run holds DST and its shards (the ``plan`` event): a
    run that is refused fetches nothing."""
    from ..run import identity, pipeline, selection
    if ahead < 1:
        raise BadInput(f"--ahead {ahead}: expected 1 or more")
    cache_dir = os.path.abspath(cache_dir or default_cache())
    t0 = time.perf_counter()
    p = prepare(source, dst, options, cache_dir, full_side_files=True, token=token)
    fetcher: _Fetcher | None = None
    try:
        plan = p.plan
        chosen = selection.selected(plan, options)
        done = {s.name for s in chosen if os.path.isdir(p.dst) and identity.shard_record(p.dst, s.name)}
        todo = [s for s in chosen if s.name not in done]
        pipeline.describe(plan, p.dst, options)   # DST refused where the run would refuse it, before any download
        _check_staging(p.dst, cache_dir, sum(s.bytes_out for s in todo), staging_bytes(plan, todo, ahead))
        needs = {s.name: [s.name] + s.partners for s in todo}

        def events(kind: str, f: dict) -> None:
            nonlocal fetcher
            if kind == "plan":   # DST and this run's shards are claimed: what is still to do is settled
                order = [s.name for s in task_order(todo) if not identity.shard_record(p.dst, s.name)]
                fetcher = _Fetcher(p, order, needs, ahead, cache_dir, token, on_event, keep_source)
                if order:
                    fetcher.start()
                else:
                    fetcher.pending.done()
            on_event(kind, f)
            if kind == "done" and fetcher is not None:
                fetcher.converted(f["shard"])

        names = [s.name for s in plan.shards]
        spec = ",".join(str(names.index(s.name) + 1) for s in chosen)
        try:
            summary = pipeline.convert(p.view.root, p.dst, dataclasses.replace(options, shard_spec=spec, part=None),
                                       events, plan=plan)
        except BaseException:
            if fetcher is not None and fetcher.error is not None:   # the fetch's own error, not a worker's word of it
                if isinstance(fetcher.error, ConvertError):
                    raise fetcher.error from None
                raise OutputError(f"fetching from the Hub failed: {fetcher.error!r}", file=str(source)) from None
            raise
    finally:
        if fetcher is not None:
            with fetcher.cond:
                fetcher.stop = True
                fetcher.cond.notify_all()
            if fetcher.is_alive():
                fetcher.join(timeout=1.0)
        p.space.close()
    summary.seconds = time.perf_counter() - t0
    return HubSummary(summary, p.snap.commit, len(fetcher.fetched) if fetcher else 0,
                      fetcher.peak if fetcher else 0, fetcher.seconds if fetcher else 0.0,
                      fetcher.fates if fetcher else {}, fetcher.found if fetcher else 0)
