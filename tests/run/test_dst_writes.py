"""What k3convert writes into DST, and what it removes: a failed write or commit leaves nothing that
looks complete and no temporary, killed runs' temporaries (and only ours) are cleaned up, finalize's
renames are made durable, and the free-space preflight counts what the run will write.

Each test is named for its defect in docs/reliability.md (D12, D16, D21, R17, T4, T5, T16, issue 33),
which describes the mechanism that fixed it; each failed before its fix. Write errors are injected by
patching ``os`` calls for one file's name.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import namedtuple

import pytest
from dst_helpers import CPU, REPO, cli_verify, complete, convert_cli, copy_dst, same_output, temporaries

from converter.run import dst as run_dst, finalize as run_finalize, pipeline, space
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.run.plan import build_plan
from converter.state import records as manifest_mod
from converter.state.files import STATE_DIR
from tests.conftest import (
    INDEX,
    MANIFEST,
    REPORT,
    TABLE,
    assert_clean_error,
    assert_not_complete,
    read_json,
    run_cli,
    shard_names,
    tree_hash,
)

# ---------------------------------------- D12, D16, D21: a failed write or commit leaves nothing that looks complete

def _fail_on(monkeypatch, name: str, where: str, code: int) -> dict:
    """Make the write of the file called ``name`` (its temporary, for fsync and create; the file
    itself, for replace) fail with ``code``, as a full disk, EIO or inode exhaustion would."""
    seen = {"n": 0}
    err = OSError(code, os.strerror(code))

    def hit(path: str) -> bool:
        base = os.path.basename(path)
        return base == name or re.fullmatch(re.escape(name) + r"\.tmp\d+", base) is not None

    if where == "fsync":
        real = os.fsync

        def fsync(fd):
            if hit(os.readlink(f"/proc/self/fd/{fd}")):
                seen["n"] += 1
                raise err
            return real(fd)
        monkeypatch.setattr(os, "fsync", fsync)
    elif where == "replace":
        real = os.replace

        def replace(a, b, **kw):
            if hit(os.fspath(b)):
                seen["n"] += 1
                raise err
            return real(a, b, **kw)
        monkeypatch.setattr(os, "replace", replace)
    else:  # "create": no inode for the new file
        real = os.open

        def open_(path, flags, *a, **kw):
            if flags & os.O_CREAT and hit(os.fspath(path)):
                seen["n"] += 1
                raise err
            return real(path, flags, *a, **kw)
        monkeypatch.setattr(os, "open", open_)
    return seen


COORDINATOR_WRITES = [  # (file, how it fails, errno): every file the coordinator writes itself
    ("run.json", "fsync", errno.ENOSPC),
    ("model-00002-of-00003.safetensors.figures.jsonl.zst", "fsync", errno.EIO),
    ("model-00002-of-00003.safetensors.done.json", "replace", errno.EIO),
    ("model-00003-of-00003.safetensors.done.json", "fsync", errno.ENOSPC),
    ("tokenizer_config.json", "fsync", errno.ENOSPC),     # a side file's copy
    ("chat_template.jinja", "create", errno.ENOSPC),
    ("config.json", "fsync", errno.EIO),
    (INDEX, "replace", errno.ENOSPC),
    (TABLE, "fsync", errno.ENOSPC),
    (REPORT, "create", errno.ENOSPC),
    (MANIFEST, "fsync", errno.EIO),
    (MANIFEST, "replace", errno.ENOSPC),
]


@pytest.mark.parametrize("name,where,code", COORDINATOR_WRITES,
                         ids=[f"{n}-{w}-{errno.errorcode[c]}" for n, w, c in COORDINATOR_WRITES])
def test_d12_coordinator_write_errors_exit_4_no_temporaries(fixture_src, converted, tmp_path, monkeypatch,
                                                            name, where, code):
    """ENOSPC/EIO in any of the coordinator's own writes: exit 4 naming the file, one line, no
    temporary left, nothing that looks complete (D16: no config or index without a complete
    manifest); the same command then completes DST as if nothing had happened."""
    dst = str(tmp_path / "dst")
    seen = _fail_on(monkeypatch, name, where, code)
    r = convert_cli(fixture_src, dst)
    monkeypatch.undo()
    assert seen["n"], f"{name} was never written"
    assert_clean_error(r, name, os.strerror(code), code=4)
    assert not temporaries(dst), temporaries(dst)
    assert_not_complete(dst)
    r = convert_cli(fixture_src, dst)
    assert r.exit_code == 0, r.output
    same_output(dst, converted.dst)


def test_d16_failed_finalize_leaves_nothing_that_looks_complete(fixture_src, tmp_path, monkeypatch):
    """No inode left for the manifest once every shard is done (the report's case): the run
    fails with exit 4 and DST holds neither config.json nor the index, so no loader takes the
    shards for a checkpoint."""
    dst = str(tmp_path / "dst")
    _fail_on(monkeypatch, MANIFEST, "create", errno.ENOSPC)
    assert_clean_error(convert_cli(fixture_src, dst), MANIFEST, code=4)
    assert len(shard_names(dst)) == 3
    for f in ("config.json", INDEX):
        assert not os.path.exists(os.path.join(dst, f)), f
    assert not temporaries(dst)


def test_d21_redo_clears_complete_first(fixture_src, converted, tmp_path):
    """A shard of a complete DST is deleted and the run redone: before the first shard is
    converted the manifest no longer says complete (and no index or config is there), so a
    kill during the redo leaves DST incomplete; the next run completes it."""
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    os.unlink(os.path.join(dst, shard_names(dst)[1]))
    seen = {}

    def on_event(kind, f):
        if kind == "start":
            seen["manifest"] = read_json(os.path.join(dst, MANIFEST))
            seen["index"] = os.path.exists(os.path.join(dst, INDEX))
            raise KeyboardInterrupt  # killed mid-redo
    with pytest.raises(Exception) as e:
        convert(fixture_src, dst, Options(), on_event)
    assert getattr(e.value, "exit_code", None) == 130
    assert seen["manifest"]["complete"] is False and seen["manifest"]["status"] != "complete"
    assert not seen["index"]
    assert_not_complete(dst)
    assert convert(fixture_src, dst, Options()).complete
    same_output(dst, converted.dst)


FAILED_COMMITS = [  # (DST as typed, the rename that fails): a standalone finalize of a complete DST
    ("slash", MANIFEST),     # `k3convert finalize out/`: the renamed index and config must still go
    ("plain", INDEX),        # before anything derived is renamed: the old complete manifest must not stay
    ("plain", "config.json"),
]


@pytest.mark.parametrize("typed,name", FAILED_COMMITS, ids=[f"{t}-{n}" for t, n in FAILED_COMMITS])
def test_failed_finalize_commit_leaves_nothing_complete(converted, tmp_path, monkeypatch, typed, name):
    """A rename failing while finalize replaces a complete DST's files: exit 4, and DST neither
    says complete nor holds an index or config (whatever the spelling of DST); the next
    finalize completes it again, byte for byte."""
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    if name == MANIFEST:  # the rename of the new, complete manifest (not of a reset one) fails
        seen, real = {"n": 0}, os.replace

        def replace(a, b, **kw):
            if os.path.basename(b) == MANIFEST and read_json(a).get("complete") is True:
                seen["n"] += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(a, b, **kw)
        monkeypatch.setattr(os, "replace", replace)
    else:
        seen = _fail_on(monkeypatch, name, "replace", errno.ENOSPC)
    r = run_cli("finalize", dst + "/" if typed == "slash" else dst)
    monkeypatch.undo()
    assert seen["n"], (f"{name} was never renamed", r.output)
    assert_clean_error(r, name, os.strerror(errno.ENOSPC), code=4)
    assert_not_complete(dst)
    assert not temporaries(dst), temporaries(dst)
    assert run_cli("finalize", dst).exit_code == 0
    same_output(dst, converted.dst)


def _eio(*a, **kw):
    raise OSError(errno.EIO, os.strerror(errno.EIO), a[0] if a else None)


def _partial_unlink(monkeypatch, src, dst, plan):
    """A killed run's .partial that cannot be removed (no clean-up: as when another run uses DST)."""
    partial = os.path.join(dst, plan.shards[0].name + ".partial")
    convert(src, dst, Options(shard_spec="2"), plan=plan)  # DST holds our state
    monkeypatch.setattr(run_dst, "_clean_temporaries", lambda *a: None)
    real = os.unlink
    monkeypatch.setattr(os, "unlink", lambda p, *a, **kw: _eio(p) if os.fspath(p) == partial else real(p, *a, **kw))
    return partial, lambda: open(partial, "wb").close()


def _record_fingerprint(monkeypatch, src, dst, plan):
    """EIO reading back a finished shard for its record: a directory's descriptor fails every read."""
    shard = os.path.join(dst, plan.shards[0].name)
    real = manifest_mod.open_regular
    monkeypatch.setattr(manifest_mod, "open_regular",
                        lambda p, *a: os.open(src, os.O_RDONLY) if p == shard else real(p, *a))
    return shard, lambda: None


def _side_file_stat(monkeypatch, src, dst, plan):
    """EIO looking at a side file in the free-space preflight (the plan was read before)."""
    side = os.path.join(src, "tokenizer_config.json")
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **kw: _eio(p) if os.fspath(p) == side else real(p, *a, **kw))
    return side, lambda: None


@pytest.mark.parametrize("setup", [_partial_unlink, _record_fingerprint, _side_file_stat],
                         ids=lambda f: f.__name__.strip("_"))
def test_coordinator_os_errors_exit_4_naming_the_file(src_copy, tmp_path, monkeypatch, setup):
    """An OSError in the coordinator's own file handling (removing a .partial, fingerprinting a
    finished shard, sizing a side file): OutputError (exit 4) naming that file, not a traceback."""
    from converter.errors import ConvertError

    dst = str(tmp_path / "dst")
    plan = build_plan(src_copy)
    path, before = setup(monkeypatch, src_copy, dst, plan)
    before()
    with pytest.raises(ConvertError) as e:
        convert(src_copy, dst, Options(), plan=plan)
    monkeypatch.undo()
    assert e.value.exit_code == 4 and path in str(e.value) and "\n" not in str(e.value), repr(e.value)
    assert_not_complete(dst)


# ---------------------------------------- T16: the manifest's rename is made durable

def test_t16_dst_folder_is_synced_after_the_manifest_rename(converted, tmp_path, monkeypatch):
    dst = copy_dst(converted, tmp_path)
    events: list[tuple[str, str]] = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(a, b, **kw):
        events.append(("rename", os.path.abspath(b)))
        return real_replace(a, b, **kw)

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    assert run_finalize.finalize(dst).complete
    last = max(i for i, e in enumerate(events) if e == ("rename", os.path.join(dst, MANIFEST)))
    assert ("fsync", os.path.realpath(dst)) in events[last + 1:], events[last:]


# ---------------------------------------- D12, R17, T4, T5: killed runs' temporaries are cleaned up, and nothing else

def test_d12_killed_runs_temporaries_are_cleaned(fixture_src, converted, tmp_path):
    """Temporaries a killed run left (``*.tmpPID`` in DST and its state folder, a ``.partial``)
    are removed by the next run that finds no other run using DST; upload never sees them."""
    dst = str(tmp_path / "dst")
    assert convert_cli(fixture_src, dst, "--shards", "1").exit_code == 0
    left = [os.path.join(dst, "config.json.tmp4242"), os.path.join(dst, STATE_DIR, "x.done.json.tmp4242"),
            os.path.join(dst, shard_names(fixture_src)[2] + ".partial")]
    for p in left:
        with open(p, "wb") as f:
            f.write(b"left by a killed run")
    assert convert_cli(fixture_src, dst).exit_code == 0
    assert not temporaries(dst)
    same_output(dst, converted.dst)


_KILLED_FINALIZE = """
import os, signal, sys
from converter.run.finalize import finalize
real = os.replace
def replace(a, b, *k, **kw):  # SIGKILL inside finalize's commit, before the first rename
    if os.path.basename(b) == "tokenizer_config.json":
        os.kill(os.getpid(), signal.SIGKILL)
    return real(a, b, *k, **kw)
os.replace = replace
finalize(sys.argv[1])
"""


def test_r17_the_completing_finalize_removes_a_killed_finalizes_temporaries(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    os.unlink(os.path.join(dst, "tokenizer_config.json"))  # so that the killed finalize stages a side file too
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-c", _KILLED_FINALIZE, dst], env=env, capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    left = temporaries(dst)
    assert any(t.startswith("tokenizer_config.json.tmp") for t in left), left
    assert any(t.startswith(MANIFEST + ".tmp") for t in left), left
    r = run_cli("finalize", dst)
    assert r.exit_code == 0, r.output
    assert temporaries(dst) == []
    assert cli_verify(dst, converted.src).exit_code == 0


def test_t4_rerun_keeps_user_tmp_files(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    shard = min(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    users = ["notes/eval.tmp", "notes/run.partial", "eval.tmp7", "notes/config.json.tmp12"]
    ours = [f"{shard}.partial", f"{STATE_DIR}/run.json.tmp4242", f"{STATE_DIR}/{shard}.done.json.tmp9"]
    os.makedirs(os.path.join(dst, "notes"))
    for rel in users + ours:
        with open(os.path.join(dst, rel), "w") as f:
            f.write("x")
    convert(converted.src, dst, Options())
    assert complete(dst)
    for rel in users:
        assert os.path.exists(os.path.join(dst, rel)), f"the user's {rel} was deleted"
    for rel in ours:
        assert not os.path.exists(os.path.join(dst, rel)), f"a killed run's {rel} was left"


def test_t4_names_the_manifest_records_never_lead_the_clean_up_outside_dst(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.json.tmp5").write_text("theirs")
    (outside / "linked.json.tmp5").write_text("theirs")
    os.symlink(outside, os.path.join(dst, "link"))
    path = os.path.join(dst, MANIFEST)
    m = read_json(path)
    m["files"].update({"../outside/notes.json": m["files"]["config.json"], "link/linked.json": m["files"]["config.json"]})
    with open(path, "w") as f:
        json.dump(m, f)
    convert(converted.src, dst, Options())
    assert sorted(os.listdir(outside)) == ["linked.json.tmp5", "notes.json.tmp5"]


def test_t5_make_fixture_refuses_a_non_empty_dir(src_copy, tmp_path):
    before = tree_hash(src_copy)
    r = run_cli("make-fixture", src_copy, "--layers", 2, "--experts", 2, "--shards", 2)
    assert_clean_error(r, src_copy, "not empty", code=4)
    assert tree_hash(src_copy) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("make-fixture", empty, "--layers", 2, "--experts", 2, "--shards", 2)
    assert r.exit_code == 0, r.output  # an existing empty directory is fine


# ---------------------------------------- D12, issue 33: the free-space preflight counts what the run writes

def test_d12_space_preflight_counts_side_files(src_copy, tmp_path, monkeypatch):
    """A large side file counts in the free-space preflight: refused before any shard is written."""
    with open(os.path.join(src_copy, "big.bin"), "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GB to copy, no space taken here
    dst = str(tmp_path / "dst")
    shards = sum(s.bytes_out for s in build_plan(src_copy).shards)
    free = shards + (3 << 29)  # the shards fit with 1.5 GiB to spare, the side file does not
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: type("U", (), {"free": free})())
    err = assert_clean_error(convert_cli(src_copy, dst, "--shards", "1"), dst, "GB free", code=4)
    assert "needs 3.2 GB" in err, err
    assert not shard_names(dst)


def test_small_job_fits_a_small_file_system(fixture_src, tmp_path, monkeypatch):
    """The margin is proportional: a job of a few MB converts with 64 MB free, and a refusal
    prints figures that are not rounded to 0.0."""
    dst = str(tmp_path / "dst")
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: type("U", (), {"free": 64 << 20})())
    assert convert_cli(fixture_src, dst).exit_code == 0
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: type("U", (), {"free": 4096})())
    dst2 = str(tmp_path / "dst2")
    err = assert_clean_error(convert_cli(fixture_src, dst2), "GB free", code=4)
    need = float(re.search(r"needs ([0-9.]+) GB", err).group(1))
    want = sum(s.bytes_out for s in build_plan(fixture_src).shards) + sum(
        os.path.getsize(os.path.join(fixture_src, f)) for f in os.listdir(fixture_src)
        if not f.endswith((".safetensors", INDEX)) and f != "config.json")
    assert need > 0 and abs(need * 1e9 - want) / want < 0.05, (need, want)
    assert "has 0.0000041 GB free" in err, err


@pytest.mark.parametrize("changed", [0, 1])
def test_rerun_copies_only_the_side_files_the_preflight_counted(src_copy, tmp_path, monkeypatch, changed):
    """Rerunning a complete DST copies exactly the side files ``bytes_needed`` counts (none, or
    the one changed in SRC since), so a preflight that passes on a nearly full disk holds."""
    dst = str(tmp_path / "dst")
    assert convert(src_copy, dst, Options()).complete
    plan = build_plan(src_copy)
    assert plan.other_files and space.bytes_needed(plan, dst, []) == 0
    edited = os.path.join(src_copy, "tokenizer_config.json")
    if changed:
        with open(edited, "a") as f:
            f.write("\n")
        plan = build_plan(src_copy)
    copied, real = [], run_finalize.stage_copy
    monkeypatch.setattr(run_finalize, "stage_copy", lambda a, b: copied.append(a) or real(a, b))
    need = space.bytes_needed(plan, dst, [])
    assert convert(src_copy, dst, Options()).complete
    assert copied == [edited] * changed
    assert need == sum(os.path.getsize(p) for p in copied)
    with open(edited, "rb") as a, open(os.path.join(dst, "tokenizer_config.json"), "rb") as b:
        assert a.read() == b.read()


def test_issue33_dry_run_refuses_a_dst_without_room(fixture_src, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - (3 << 20), 3 << 20))
    dst = tmp_path / "dst"
    dry = run_cli("mxfp4-to-int4", fixture_src, "-o", dst, "--dry-run", *CPU)
    real = run_cli("mxfp4-to-int4", fixture_src, "-o", dst, *CPU)
    err = assert_clean_error(real, "needs", "free", code=4)
    assert assert_clean_error(dry, "needs", "free", code=4) == err


def test_issue33_dry_run_overwrite_counts_what_the_wipe_frees(converted, tmp_path, monkeypatch):
    dst = copy_dst(converted, tmp_path)
    held = space.bytes_under(dst)
    need = space.bytes_needed(Options().plan(converted.src), dst,
                                 Options().plan(converted.src).shards, emptied=True)
    usage = namedtuple("usage", "total used free")
    free = need + space.space_margin(need) - held + (1 << 20)  # fits only once DST is emptied
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 30, free))
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, "--scale-rule", "vllm-gfx942", "--overwrite",
                "--dry-run", *CPU)
    assert r.exit_code == 0 and "replace it" in r.stdout, r.output


def test_issue33_dry_run_json_still_parses(fixture_src, tmp_path):
    """A guard: the dry run's JSON still parses (the space check added no output)."""
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--dry-run", "--devices", "cpu",
                "--progress", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["dst_action"] == "create it", r.output
