"""Runs that survive: kill -9, Ctrl-C, changed sources and options, a full disk, unwritable or
unreadable paths, and two runs on one DST (docs/convert.md, "Runs that survive").

Every test leaves SRC byte-identical and never leaves a DST that claims to be complete when
the run did not finish. The conversions that are killed or raced run as real processes
(``python -m converter``); a killed run is stopped (SIGSTOP) while a ``.partial`` exists in
DST, so "killed mid-shard" does not depend on timing. Source checkpoints get random MXFP4
codes: a 6-shard source of ~80 MB builds in about a second and converts in a few.
"""
from __future__ import annotations

import errno
import filecmp
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from sigint import interruptible_children

import converter.fixture as fixture_mod
from converter.cli import main as cli_main
from converter.errors import BadInput, OutputError
from converter.fixture import FixtureSpec, make_fixture
from converter.formats import safetensors_io
from converter.run import pipeline
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.run.plan import build_plan
from tests.conftest import sha256, shard_names, tree_hash

REPO = Path(__file__).resolve().parents[2]
MANIFEST = "k3convert_manifest.json"
REPORT = "k3convert_report.json"
INDEX = "model.safetensors.index.json"
STATE = ".k3convert"
SHARDS = 6

# One MoE layer a shard (shard 1: the dense layer 0 and the embeddings); 16 MB a MoE shard,
# so a shard takes ~0.15 s or more to convert: long enough to be caught mid-way.
SLOW = FixtureSpec(layers=6, experts=8, shards=SHARDS, hidden=256, inter=1024, latent=1024, seed=11)
# The same structure, ~300 kB a shard: for the in-process tests.
SMALL = FixtureSpec(layers=6, experts=4, shards=SHARDS, hidden=128, inter=128, latent=128, seed=12)


# ------------------------------------------------------------------------------ helpers

def _make_source(path: str, spec: FixtureSpec) -> None:
    """make_fixture with uniform random MXFP4 codes and cheap bf16 values: builds in ~1 s.
    (The conversion does not care where the codes came from; their error is ~0.07.)"""
    gen = torch.Generator().manual_seed(spec.seed)

    def values(_gen, rows, cols):
        return torch.empty(rows, cols).uniform_(-1, 1, generator=gen)

    def encode(w):
        rows, cols = w.shape
        return (torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen),
                torch.randint(118, 124, (rows, cols // 32), dtype=torch.uint8, generator=gen))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fixture_mod, "_student_t", values, raising=False)
        make_fixture(path, spec, encoder=encode)


def partials(dst: str) -> list[str]:
    try:
        return sorted(f for f in os.listdir(dst) if f.endswith(".partial"))
    except FileNotFoundError:
        return []


def records(dst: str) -> set[str]:
    """Shards with a done record whose output file is there."""
    state = os.path.join(dst, STATE)
    if not os.path.isdir(state):
        return set()
    return {f[: -len(".done.json")] for f in os.listdir(state)
            if f.endswith(".done.json") and os.path.exists(os.path.join(dst, f[: -len(".done.json")]))}


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def assert_not_complete(dst: str) -> None:
    """Nothing in DST claims a finished conversion."""
    if not os.path.exists(dst):
        return
    man = os.path.join(dst, MANIFEST)
    if os.path.exists(man):
        m = read_json(man)
        assert m["complete"] is False and m["status"] != "complete", m["status"]
        assert not any(p[: -len(".partial")] in m["shards"] for p in partials(dst))
    for f in (INDEX, "config.json", REPORT):
        assert not os.path.exists(os.path.join(dst, f)), f"{f} in an unfinished DST"


def assert_same_output(dst: str, ref: str) -> None:
    """Every file the reference run wrote, byte for byte (manifest and report hold timings)."""
    assert shard_names(dst) == shard_names(ref)
    names = [f for f in os.listdir(ref) if os.path.isfile(os.path.join(ref, f)) and f not in (MANIFEST, REPORT)]
    assert INDEX in names and "config.json" in names
    for f in names:
        assert filecmp.cmp(os.path.join(dst, f), os.path.join(ref, f), shallow=False), f
    assert not partials(dst)
    m = read_json(os.path.join(dst, MANIFEST))
    assert m["complete"] is True and m["status"] == "complete" and sorted(m["shards"]) == shard_names(ref)


def run_cli(*args):
    return CliRunner().invoke(cli_main, [str(a) for a in args])


def cli_error(result, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    err = result.stderr.strip().splitlines()[-1]
    assert err.startswith("k3convert: error: "), result.stderr
    assert "Traceback" not in result.output
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    return err


_RUNS: list["Run"] = []


def _reap() -> None:
    """Kill the runs a failed test left behind (stopped ones too: SIGKILL ends them)."""
    while _RUNS:
        r = _RUNS.pop()
        if r.p.poll() is None:
            r.p.kill()
            r.p.wait()


@pytest.fixture(autouse=True)
def _no_leftover_runs():
    yield
    _reap()


class Run:
    """``python -m converter mxfp4-to-int4 SRC -o DST --progress json`` as a process; its stderr
    is read by a thread into events (JSON lines) and text (everything else)."""

    def __init__(self, src: str, dst: str, *extra: str):
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with interruptible_children():  # a background job (CI: ``pytest &``) ignores SIGINT, and so would the child
            self.p = subprocess.Popen(
                [sys.executable, "-m", "converter", "mxfp4-to-int4", src, "-o", dst, "--progress", "json",
                 "--devices", "cpu", *extra],
                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True, start_new_session=True)  # its own process group: the command and its workers
        _RUNS.append(self)
        self.events: list[dict] = []
        self.text: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.p.stderr:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                self.text.append(line.rstrip("\n"))
                continue
            self.events.append(ev)
            self._q.put(ev)
        self._q.put(None)

    def wait_for(self, kind: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {kind!r} event in {timeout} s") from None
            if ev is None:
                raise AssertionError(f"run exited ({self.p.wait()}) before a {kind!r} event:\n" + self.log())
            if ev["event"] == kind:
                return ev

    def finish(self, timeout: float = 180) -> int:
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise AssertionError("run did not finish:\n" + self.log()) from None
        self._reader.join(10)
        return rc

    def log(self) -> str:
        return "\n".join(self.text[-20:])

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    def shards(self, kind: str) -> set[str]:
        return {e["shard"] for e in self.of(kind)}

    def signal(self, sig: int) -> None:
        """To the command and its worker processes, as a terminal or a batch scheduler sends it."""
        os.killpg(self.p.pid, sig)

    def state(self) -> str:
        """The process's state letter in /proc: R, S, D, T (stopped), Z (exited, not reaped)..."""
        with open(f"/proc/{self.p.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def stop_mid_shard(self, dst: str, after_done: int = 0, timeout: float = 120) -> list[str]:
        """SIGSTOP the run while a shard is being written (its .partial exists in DST), once
        ``after_done`` shards are finished. Returns the .partial names; the run stays stopped."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.p.poll() is None, f"run exited ({self.p.returncode}) before a shard was caught:\n{self.log()}"
            if len(records(dst)) >= after_done and partials(dst):
                self.signal(signal.SIGSTOP)
                while (st := self.state()) != "T":
                    assert st != "Z", f"run exited before a shard was caught:\n{self.log()}"
                    time.sleep(0.001)
                if found := partials(dst):
                    return found
                self.signal(signal.SIGCONT)
            time.sleep(0.002)
        raise AssertionError(f"no .partial seen in {timeout} s")

    def kill(self) -> None:
        if self.p.poll() is None:
            self.signal(signal.SIGKILL)
        self.finish()


def _reference(tmp_path_factory, name: str, spec) -> tuple[str, str, dict]:
    """(src, reference DST, hash of src): ``spec`` converted once, uninterrupted, in-process."""
    root = tmp_path_factory.mktemp(name)
    src, ref = str(root / "src"), str(root / "ref")
    _make_source(src, spec)
    convert(src, ref, Options(devices=["cpu"]))
    assert read_json(os.path.join(ref, MANIFEST))["complete"] is True
    return src, ref, tree_hash(src)


@pytest.fixture(scope="session")
def slow(tmp_path_factory):
    return _reference(tmp_path_factory, "resume-slow", SLOW)


@pytest.fixture(scope="session")
def small(tmp_path_factory):
    return _reference(tmp_path_factory, "resume-small", SMALL)


@pytest.fixture
def slow_dst(tmp_path):
    """DST for SLOW (~85 MB): removed afterwards, so kept test directories stay small."""
    path = str(tmp_path / "dst")
    yield path
    _reap()
    shutil.rmtree(path, ignore_errors=True)


def _resume(src: str, dst: str, ref: str, finished: set[str]) -> Run:
    """Run the same command again: exit 0, the finished shards kept (not rewritten), the rest
    converted, and DST byte-identical to the uninterrupted reference."""
    kept = {s: os.stat(os.path.join(dst, s)).st_mtime_ns for s in finished}
    for s in finished:  # a finished shard is final
        assert filecmp.cmp(os.path.join(dst, s), os.path.join(ref, s), shallow=False), s
    run = Run(src, dst)
    rc = run.finish()
    assert rc == 0, run.log()
    (plan,) = run.of("plan")
    assert plan["shards"] == SHARDS and plan["todo"] == SHARDS - len(finished) < SHARDS
    assert run.shards("start") == run.shards("done") == set(shard_names(ref)) - finished
    assert {s: os.stat(os.path.join(dst, s)).st_mtime_ns for s in finished} == kept
    assert run.of("finished")[-1]["complete"] is True
    assert_same_output(dst, ref)
    return run


# ------------------------------------------------------------------------------ 1. kill -9

@pytest.mark.parametrize("when", ["after-first-done", "mid-shard"])
def test_kill_9_then_resume_is_byte_identical(slow, slow_dst, when):
    src, ref, src_hash = slow
    dst = slow_dst
    run = Run(src, dst)
    if when == "after-first-done":
        run.wait_for("done")
        run.kill()
    else:  # a shard finished and the next one half written
        caught = run.stop_mid_shard(dst, after_done=1)
        run.kill()
        assert partials(dst) == caught  # kill -9 cannot clean up; the next run must
    assert run.p.returncode == -signal.SIGKILL
    finished = records(dst)
    assert run.shards("done") <= finished and 1 <= len(finished) < SHARDS
    assert_not_complete(dst)

    _resume(src, dst, ref, finished)
    assert tree_hash(src) == src_hash


# ------------------------------------------------------------------------------ 2. Ctrl-C

def test_ctrl_c_exits_130_promptly_then_resumes(slow, slow_dst):
    src, ref, src_hash = slow
    dst = slow_dst
    run = Run(src, dst)
    run.stop_mid_shard(dst, after_done=1)
    t0 = time.monotonic()
    run.signal(signal.SIGINT)
    run.signal(signal.SIGCONT)
    rc = run.finish(60)
    took = time.monotonic() - t0
    assert rc == 130, run.log()
    assert took < 15, f"Ctrl-C took {took:.1f} s to stop the run"
    failed = [e for e in run.events if e.get("event") == "failed"]   # the error, as the last event
    assert failed and "interrupted" in failed[-1]["error"] and "resume" in failed[-1]["error"], run.log()
    assert failed[-1]["exit_code"] == 130
    assert not partials(dst)  # the shard in progress was dropped on the way out
    assert_not_complete(dst)
    # every shard reported done is kept; a shard whose record was written just before the stop may not
    # have reached its "done" event yet (the record comes first): kept too, and resume takes it as done
    finished = records(dst)
    assert run.shards("done") <= finished and len(finished) >= 1

    _resume(src, dst, ref, finished)
    assert tree_hash(src) == src_hash


# ------------------------------------------------------------------------------ 3. changed source, changed options

def _flip_bf16_byte(shard: str) -> None:
    """Flip one byte in the middle of a BF16 tensor; size and mtime stay as they were."""
    header = safetensors_io.read_header(shard)
    t = next(t for t in header.tensors.values() if t.dtype == "BF16" and t.nbytes >= 64)
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(t.start + t.nbytes // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_changed_source_refused_then_overwrite_redoes(small, tmp_path):
    _, ref, _ = small
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shutil.copytree(small[0], src)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--shards", "1-3", "--progress", "none", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    assert_not_complete(dst)
    changed = shard_names(src)[1]  # converted by the partial run
    _flip_bf16_byte(os.path.join(src, changed))
    src_hash, dst_hash = tree_hash(src), tree_hash(dst)

    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", "--devices", "cpu")
    cli_error(r, 4, dst, "source files changed", "--overwrite")
    assert tree_hash(dst) == dst_hash and tree_hash(src) == src_hash

    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "json", "--devices", "cpu", "--overwrite")
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stderr.splitlines()]
    plan = next(e for e in events if e["event"] == "plan")
    assert plan["todo"] == plan["shards"] == SHARDS  # everything redone, nothing kept
    assert read_json(os.path.join(dst, MANIFEST))["complete"] is True
    for s in shard_names(ref):  # the flipped copied tensor is in the output, the rest as before
        assert filecmp.cmp(os.path.join(dst, s), os.path.join(ref, s), shallow=False) == (s != changed), s
    assert tree_hash(src) == src_hash


def test_changed_options_refused(small, tmp_path):
    src, _, src_hash = small
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--shards", "2", "--progress", "none", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    dst_hash = tree_hash(dst)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--sample-experts", "2", "--progress", "none", "--devices", "cpu")
    cli_error(r, 4, dst, "options", "--overwrite")
    assert tree_hash(dst) == dst_hash
    assert_not_complete(dst)
    assert tree_hash(src) == src_hash


# ------------------------------------------------------------------------------ 4. disk full

def _disk_full_after(monkeypatch, limit: int) -> dict:
    """ShardWriter._pwrite writes ``limit`` bytes in all, then fails with ENOSPC (and keeps failing)."""
    real = safetensors_io.ShardWriter._pwrite
    state = {"written": 0, "path": None}
    lock = threading.Lock()  # several writer threads

    def _pwrite(self, data, offset):
        view = memoryview(data).cast("B")
        with lock:
            room = limit - state["written"]
            state["written"] += min(room, len(view)) if room > 0 else 0
            if len(view) > room:
                state["path"] = state["path"] or self.path
        if len(view) > room:
            if room > 0:
                real(self, view[:room], offset)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, view, offset)

    monkeypatch.setattr(safetensors_io.ShardWriter, "_pwrite", _pwrite)
    return state


def test_disk_full_mid_shard_then_resume(small, tmp_path, monkeypatch):
    src, ref, src_hash = small
    dst = str(tmp_path / "dst")
    order = [s.name for s in sorted(build_plan(src).shards, key=lambda s: -s.bytes_in)]  # the run's order
    first, second = (os.path.getsize(os.path.join(ref, n)) for n in order[:2])
    full = _disk_full_after(monkeypatch, first + second // 2)  # half-way through the second shard
    with pytest.raises(OutputError) as e:
        convert(src, dst, Options(devices=["cpu"]))
    assert full["path"] == os.path.join(dst, order[1])
    assert os.path.join(dst, order[1]) in str(e.value) and os.strerror(errno.ENOSPC) in str(e.value)
    assert e.value.exit_code == 4
    assert not partials(dst)
    assert records(dst) == {order[0]} and not os.path.exists(os.path.join(dst, order[1]))
    assert_not_complete(dst)

    monkeypatch.undo()
    events = []
    summary = convert(src, dst, Options(devices=["cpu"]), lambda k, f: events.append((k, f)))
    assert summary.complete and dict(events)["plan"]["todo"] == SHARDS - 1
    assert_same_output(dst, ref)
    assert tree_hash(src) == src_hash


def test_disk_full_at_first_write_cli_exit_4(small, tmp_path, monkeypatch):
    """ENOSPC on the very first bytes (the header, written as the .partial is opened)."""
    src, ref, src_hash = small
    dst = str(tmp_path / "dst")
    full = _disk_full_after(monkeypatch, 0)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", "--devices", "cpu")
    cli_error(r, 4, full["path"], os.strerror(errno.ENOSPC))
    assert not partials(dst) and not shard_names(dst)
    assert_not_complete(dst)
    monkeypatch.undo()
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    assert_same_output(dst, ref)
    assert tree_hash(src) == src_hash


def test_preflight_space_check_before_any_shard(small, tmp_path, monkeypatch):
    src, _, src_hash = small
    dst = str(tmp_path / "dst")
    monkeypatch.setattr(pipeline.shutil, "disk_usage",
                        lambda p: types.SimpleNamespace(total=1 << 40, used=(1 << 40) - 4096, free=4096))
    written = []
    real = safetensors_io.ShardWriter.__init__
    monkeypatch.setattr(safetensors_io.ShardWriter, "__init__",
                        lambda self, *a, **k: (written.append(a), real(self, *a, **k))[1])
    with pytest.raises(OutputError) as e:
        convert(src, dst, Options(devices=["cpu"]))
    assert dst in str(e.value) and "GB free" in str(e.value)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", "--devices", "cpu")
    cli_error(r, 4, dst, "GB free")
    assert not written and not shard_names(dst) and not partials(dst)
    assert_not_complete(dst)
    assert tree_hash(src) == src_hash


# ------------------------------------------------------------------------------ 5. unwritable DST, unreadable SRC

def test_read_only_dst_exit_4(small):
    src, _, src_hash = small
    dst = "/sys/k3convert-test-dst"
    try:  # sysfs takes no new directories, not even from root
        os.mkdir(dst)
    except OSError:
        pass
    else:
        os.rmdir(dst)
        pytest.skip("/sys accepts new directories here")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", "--devices", "cpu")
    cli_error(r, 4, dst, "cannot write")
    assert not os.path.exists(dst)
    assert tree_hash(src) == src_hash


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)


def _corrupt_header(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(8)
        assert f.read(1) == b"{"
        f.seek(8)
        f.write(b"[")


@pytest.mark.parametrize("damage", [_truncate, _corrupt_header], ids=["truncated", "corrupt-header"])
def test_damaged_source_exit_2_nothing_written(small, tmp_path, damage):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shutil.copytree(small[0], src)
    bad = os.path.join(src, shard_names(src)[3])
    damage(bad)
    src_hash = tree_hash(src)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--progress", "none", "--devices", "cpu")
    cli_error(r, BadInput.exit_code, bad)
    assert BadInput.exit_code == 2
    assert not os.path.exists(dst)
    assert tree_hash(src) == src_hash


# ------------------------------------------------------------------------------ 6. two runs on one DST

def test_second_run_on_same_dst_refused_first_completes(slow, slow_dst):
    src, ref, src_hash = slow
    dst = slow_dst
    a = Run(src, dst)
    try:
        a.wait_for("start")
        caught = a.stop_mid_shard(dst)  # A holds its locks and is mid-shard for as long as B runs
        t0 = time.monotonic()
        b = Run(src, dst)
        rc_b = b.finish(120)
        took = time.monotonic() - t0
        assert rc_b == 4, b.log()
        assert any("another k3convert run" in e.get("error", "") for e in b.events if e.get("event") == "failed"), \
            b.log()
        assert not b.of("start") and took < 60, took
        assert partials(dst) == caught  # B left A's shard in progress alone
    finally:
        a.signal(signal.SIGCONT)
    assert a.finish() == 0, a.log()
    assert a.of("finished")[-1]["complete"] is True
    assert_same_output(dst, ref)
    assert tree_hash(src) == src_hash


@pytest.mark.parametrize("timing", ["free", "interleaved"])
def test_parallel_parts_share_dst_and_complete_once(slow, slow_dst, timing):
    """--part 1/2 and 2/2 at once on one DST: both succeed, DST is the single run's, and it is
    completed once, by the part that finished last. "interleaved": part 1 is paused mid-shard
    while part 2 starts, converts all of its shards and finalizes; then part 1 goes on."""
    src, ref, src_hash = slow
    dst = slow_dst
    names = shard_names(ref)
    runs = [Run(src, dst, "--part", "1/2")]
    if timing == "interleaved":
        caught = runs[0].stop_mid_shard(dst)
        try:
            runs.append(Run(src, dst, "--part", "2/2"))
            assert runs[1].finish() == 0, runs[1].log()
            assert runs[1].of("finished")[-1]["complete"] is False
            assert_not_complete(dst)
            assert partials(dst) == caught  # part 2 left part 1's shard in progress alone
        finally:
            runs[0].signal(signal.SIGCONT)
    else:
        runs.append(Run(src, dst, "--part", "2/2"))
    for r in runs:
        assert r.finish() == 0, r.log()
    mine = [r.shards("done") for r in runs]
    assert mine[0] == {n for i, n in enumerate(names) if i % 2 == 0} and mine[1] == set(names) - mine[0]
    for r, shards in zip(runs, mine):
        assert r.shards("start") == shards and r.of("plan")[0]["todo"] == len(shards)
    assert_same_output(dst, ref)
    # completed once every shard was done, and only then: a part that finished while the other
    # was still converting reports a partial DST; the one that finished the last shard, complete
    state = os.path.join(dst, STATE)
    last_record = max(os.stat(os.path.join(state, n + ".done.json")).st_mtime_ns for n in names)
    assert os.stat(os.path.join(dst, MANIFEST)).st_mtime_ns >= last_record
    ends = [max(e["time"] for e in r.of("done")) for r in runs]
    flags = [r.of("finished")[-1]["complete"] for r in runs]
    assert flags[ends.index(max(ends))] is True
    for r, flag, other in zip(runs, flags, ends[::-1]):
        if r.of("finished")[-1].get("time", float("inf")) < other - 0.1:
            assert flag is False
    if timing == "interleaved":
        assert flags == [True, False]
    assert tree_hash(src) == src_hash


def test_parts_then_finalize(small, tmp_path):
    src, ref, src_hash = small
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--part", "2/2", "--progress", "none", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    r = run_cli("finalize", dst)
    assert r.exit_code == 4 and "partial" in r.stdout, r.output
    assert_not_complete(dst)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--part", "1/2", "--progress", "none", "--devices", "cpu")
    assert r.exit_code == 0 and r.stdout.splitlines()[-2].startswith("complete:"), r.output
    assert_same_output(dst, ref)
    before = {f: sha256(os.path.join(dst, f)) for f in shard_names(dst) + [INDEX, "config.json"]}
    r = run_cli("finalize", dst)
    assert r.exit_code == 0 and r.stdout.startswith("complete:"), r.output
    assert {f: sha256(os.path.join(dst, f)) for f in before} == before
    assert_same_output(dst, ref)
    assert tree_hash(src) == src_hash


def test_finalize_of_a_record_with_no_source_says_so_not_a_hub_commit(small, tmp_path):
    src, _, _ = small
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--part", "2/2", "--progress", "none", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    path = os.path.join(dst, ".k3convert", "run.json")
    with open(path) as f:
        record = json.load(f)
    del record["source"]
    with open(path, "w") as f:
        json.dump(record, f)
    r = run_cli("finalize", dst)
    assert r.exit_code == 4 and "names no source" in r.output and "Hub" not in r.output, r.output
    assert_not_complete(dst)


# ------------------------------------------------------------------------------ 7. dry run

def test_dry_run_writes_nothing(small, tmp_path):
    src, ref, src_hash = small
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--dry-run", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    lines = dict(line.strip().split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert lines["shards"] == str(SHARDS) and lines["shards_todo"] == str(SHARDS)
    assert int(lines["tensors_to_convert"]) == (SMALL.layers - 1) * SMALL.experts * 3
    assert lines["bytes_in"].endswith(" MB") and lines["bytes_out"].endswith(" MB")  # sizes for people
    assert not os.path.exists(dst)

    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--dry-run", "--progress", "json", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["shards"] == info["shards_todo"] == SHARDS and info["shards_done"] == 0
    assert info["bytes_out"] == sum(os.path.getsize(os.path.join(ref, s)) for s in shard_names(ref))
    assert 0 < info["bytes_in"] <= sum(os.path.getsize(os.path.join(src, s)) for s in shard_names(src))
    assert not os.path.exists(dst)

    # on a partly converted DST: reports what is left, changes nothing
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--shards", "1-2", "--progress", "none", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    dst_hash = tree_hash(dst)
    r = run_cli("mxfp4-to-int4", src, "-o", dst, "--dry-run", "--progress", "json", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert (info["shards_done"], info["shards_todo"]) == (2, SHARDS - 2)
    assert tree_hash(dst) == dst_hash
    assert tree_hash(src) == src_hash
