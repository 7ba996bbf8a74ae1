"""Defects of the fourth adversarial pass (issue 32, T4-T14 and T16; issue 33's dry-run space check):
each test failed on main 5870246. docs/reliability.md ("Pass 4") maps each to its mechanism.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import namedtuple

import pytest

from converter import pipeline, workers
from converter.errors import BadInput
from converter.state.files import MANIFEST, STATE_DIR
from converter.state.locks import reading
from converter.pipeline import Options, convert, finalize, select_shards

from conftest import SPEC, assert_clean_error, read_json, run_cli, tree_hash

CPU = ("--devices", "cpu", "--progress", "none")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_dst(converted, tmp_path, name: str = "dst", **kw) -> str:
    """A copy of the session's conversion (mtimes kept, so its shard records still hold)."""
    dst = str(tmp_path / name)
    shutil.copytree(converted.dst, dst, **kw)
    return dst


def complete(dst: str) -> bool:
    return (read_json(os.path.join(dst, MANIFEST)) or {}).get("complete") is True


def verified(dst: str, src: str) -> None:
    r = run_cli("verify", dst, "--source", src)
    assert r.exit_code == 0, r.output


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """The command line in its own process (its real standard streams)."""
    return subprocess.run([sys.executable, "-m", "converter", *args], cwd=REPO, env={**os.environ, **(env or {})},
                          timeout=300, check=False, **kw)


def one_error_line(stderr: str, *needles: str) -> str:
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert "Traceback" not in stderr, stderr
    errors = [x for x in lines if x.startswith("k3convert: error:")]
    assert len(errors) == 1, stderr
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


# ---------------------------------------------------------------- T4: a rerun deletes only its own temporaries

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


# ---------------------------------------------------------------- T5: make-fixture over a checkpoint

def test_t5_make_fixture_refuses_a_non_empty_dir(src_copy, tmp_path):
    before = tree_hash(src_copy)
    r = run_cli("make-fixture", src_copy, "--layers", 2, "--experts", 2, "--shards", 2)
    assert_clean_error(r, src_copy, "not empty", code=4)
    assert tree_hash(src_copy) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("make-fixture", empty, "--layers", 2, "--experts", 2, "--shards", 2)
    assert r.exit_code == 0, r.output  # an existing empty directory is fine


# ---------------------------------------------------------------- T6, T8: selections

def test_t6_job_file_shards_with_part_that_select_nothing_are_refused(fixture_src, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'src = "{fixture_src}"\nshards = "1"\n')
    dst = tmp_path / "dst"
    r = run_cli("mxfp4-to-int4", "--config", job, "-o", dst, "--part", "2/3", *CPU)
    assert_clean_error(r, "--shards 1 with --part 2/3 selects no shard", code=2)
    assert not dst.exists()
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", dst, "--part", f"{SPEC.shards + 1}/{SPEC.shards + 1}", *CPU)
    assert_clean_error(r, "selects no shard", f"use at most {SPEC.shards} parts", code=2)
    assert not dst.exists()


def test_t8_an_open_range_is_refused_not_cut_to_its_start(fixture_src, tmp_path):
    with pytest.raises(BadInput, match="has no end: write 2-3"):
        select_shards(["a", "b", "c"], "2-")
    assert select_shards(["a", "b", "c"], "2-3") == ["b", "c"]
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--shards", "2-", *CPU)
    assert_clean_error(r, "'2-' has no end", code=2)
    assert not (tmp_path / "dst").exists()


# ---------------------------------------------------------------- T11: counts are ASCII digits, bounded

@pytest.mark.parametrize("value", ["1_0", "٢", "+2", "99999999999999999999", "100000", "9" * 5000])
def test_t11_workers_accept_only_ascii_digits_and_what_fits(fixture_src, tmp_path, value):
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--dry-run", "--workers", value, *CPU)
    assert_clean_error(r, "--workers", code=2)


def test_t11_workers_from_the_environment_are_ascii_digits(fixture_src, tmp_path, monkeypatch):
    monkeypatch.setenv("K3CONVERT_WORKERS", "1_0")
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--dry-run", *CPU)
    assert_clean_error(r, "K3CONVERT_WORKERS='1_0'", code=2)


def test_t11_more_workers_than_cores_is_said(fixture_src, tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "cpus", lambda: 2)
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--dry-run", "--workers", "3", *CPU)
    assert r.exit_code == 0, r.output
    assert "cpu: 3 worker(s)" in r.stdout and "more workers than the 2 core(s)" in r.stdout


def test_t11_other_counts_refuse_int_syntax(monkeypatch):
    for spec, part in (("١", None), ("1_0", None), (None, "1/٢"), (None, "1_0/2")):
        with pytest.raises(BadInput):
            select_shards(["a", "b", "c"], spec, part)
    with pytest.raises(BadInput, match="not cpu or cuda:N"):
        pipeline.plan_workers(Options(devices=["cuda:²"]))  # "²".isdigit() is True, int("²") a ValueError
    monkeypatch.setenv("NUMBA_NUM_THREADS", "²")
    assert workers.cpu_workers(1).workers == 1
    monkeypatch.setenv("K3CONVERT_IO_THREADS", "٢,2")
    with pytest.raises(BadInput, match="K3CONVERT_IO_THREADS"):
        workers.io_threads()


# ---------------------------------------------------------------- T16: the manifest's rename is made durable

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
    assert finalize(dst).complete
    last = max(i for i, e in enumerate(events) if e == ("rename", os.path.join(dst, MANIFEST)))
    assert ("fsync", os.path.realpath(dst)) in events[last + 1:], events[last:]


# ---------------------------------------------------------------- T13: a corrupt record, advice that works

def _truncate(path: str) -> None:
    with open(path, "rb+") as f:
        f.truncate(max(1, os.path.getsize(path) // 2))


def test_t13_a_truncated_run_record_is_replaced_by_overwrite(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    _truncate(os.path.join(dst, STATE_DIR, "run.json"))
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, *CPU)
    err = assert_clean_error(r, "run.json is corrupt", "--overwrite", code=4)
    assert "holds no k3convert state" not in err
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, "--dry-run", "--overwrite", *CPU)
    assert r.exit_code == 0 and "replace it (--overwrite)" in r.stdout, r.output
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, "--overwrite", *CPU)
    assert r.exit_code == 0, r.output
    assert complete(dst)
    verified(dst, converted.src)


def test_t13_a_removed_run_record_is_replaced_by_overwrite(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    os.unlink(os.path.join(dst, STATE_DIR, "run.json"))
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, *CPU)
    err = assert_clean_error(r, "no run record", "--overwrite", code=4)
    assert "holds no k3convert state" not in err
    r = run_cli("finalize", dst)
    assert_clean_error(r, "no run record", "--overwrite", code=4)
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, "--overwrite", *CPU)
    assert r.exit_code == 0, r.output
    assert complete(dst)


@pytest.mark.parametrize("overwrite", [(), ("--overwrite",)])
def test_t13_a_corrupt_shard_record_is_converted_again(converted, tmp_path, overwrite):
    dst = copy_dst(converted, tmp_path)
    shard = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))[1]
    _truncate(os.path.join(dst, STATE_DIR, f"{shard}.done.json"))
    _truncate(os.path.join(dst, MANIFEST))
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, *overwrite, *CPU)
    assert r.exit_code == 0, r.output
    assert "complete" in r.stdout and complete(dst)
    assert read_json(os.path.join(dst, STATE_DIR, f"{shard}.done.json"))["shard"] == shard
    verified(dst, converted.src)


# ---------------------------------------------------------------- T12: our output, copied without its state

def test_t12_a_copy_without_state_is_ours_and_overwrite_replaces_it(converted, tmp_path):
    dst = copy_dst(converted, tmp_path, ignore=shutil.ignore_patterns(STATE_DIR))
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, *CPU)
    err = assert_clean_error(r, f"without its {STATE_DIR} state folder", "--overwrite", code=4)
    assert "holds no k3convert state" not in err
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, "--overwrite", *CPU)
    assert r.exit_code == 0, r.output
    assert complete(dst)
    verified(dst, converted.src)
    foreign = tmp_path / "foreign"   # a folder that holds nothing of ours is still refused, with --overwrite too
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine")
    r = run_cli("mxfp4-to-int4", converted.src, "-o", foreign, "--overwrite", *CPU)
    assert_clean_error(r, "holds no k3convert state", code=4)
    assert (foreign / "thesis.tex").read_text() == "mine"


# ---------------------------------------------------------------- T7, issue 33: the dry run takes the run's decision

def test_t7_dry_run_overwrite_is_refused_while_an_upload_reads_dst(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    other = ("--scale-rule", "vllm-gfx942")
    with reading(dst):   # what upload holds from its verify to its last byte
        dry = run_cli("mxfp4-to-int4", converted.src, "-o", dst, *other, "--overwrite", "--dry-run", *CPU)
        real = run_cli("mxfp4-to-int4", converted.src, "-o", dst, *other, "--overwrite", *CPU)
        err = assert_clean_error(real, "upload", code=4)
        assert assert_clean_error(dry, code=4) == err
        dry = run_cli("mxfp4-to-int4", converted.src, "-o", dst, "--dry-run", *CPU)  # a rerun finalizes too
        assert_clean_error(dry, "upload", code=4)
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, *other, "--overwrite", "--dry-run", *CPU)
    assert r.exit_code == 0 and "replace it" in r.stdout, r.output


def test_t7_dry_run_overwrite_is_refused_while_another_run_uses_dst(converted, tmp_path):
    dst = copy_dst(converted, tmp_path)
    with open(os.path.join(dst, STATE_DIR, "run.lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_SH)   # a job-array part of the recorded conversion is running
        dry = run_cli("mxfp4-to-int4", converted.src, "-o", dst, "--scale-rule", "vllm-gfx942", "--overwrite",
                      "--dry-run", *CPU)
        assert_clean_error(dry, "another k3convert run is using", code=4)


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
    held = pipeline._bytes_under(dst)
    need = pipeline.bytes_needed(pipeline.Options().plan(converted.src), dst,
                                 pipeline.Options().plan(converted.src).shards, emptied=True)
    usage = namedtuple("usage", "total used free")
    free = need + pipeline.space_margin(need) - held + (1 << 20)  # fits only once DST is emptied
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 30, free))
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, "--scale-rule", "vllm-gfx942", "--overwrite",
                "--dry-run", *CPU)
    assert r.exit_code == 0 and "replace it" in r.stdout, r.output


# ---------------------------------------------------------------- T14: demo where TMPDIR cannot take it

def test_t14_demo_without_a_usable_tmpdir_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    r = run_cli("demo")
    assert_clean_error(r, "temporary directory", code=4)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only), unmounted afterwards."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def test_t14_demo_with_a_full_tmpdir_exits_4_in_one_line(small_tmpfs, monkeypatch):
    with open(os.path.join(small_tmpfs, "fill"), "wb") as f:
        f.write(b"\0" * (800 << 10))   # room for the folder, not for the fixture
    monkeypatch.setattr(tempfile, "tempdir", small_tmpfs)
    r = run_cli("demo")
    assert r.exit_code == 4 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert one_error_line(r.stderr, "No space left on device") == r.stderr.strip().splitlines()[-1]
    assert os.listdir(small_tmpfs) == ["fill"]   # the demo's folder is removed


# ---------------------------------------------------------------- T10: output that cannot be written

def test_t10_inspect_json_to_a_full_device_is_one_line(converted):
    with open("/dev/full", "w") as full:
        r = cli("inspect", "--json", converted.dst, stdout=full, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 4, r.stderr
    one_error_line(r.stderr, "could not be written", "No space left on device")


def test_t10_verify_into_a_closed_pipe_says_so(converted):
    read, write = os.pipe()
    os.close(read)   # `| head -0`: the reader is gone before the first line
    try:
        r = cli("verify", converted.dst, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert r.returncode == 4, r.stderr
    one_error_line(r.stderr, "could not be written", "Broken pipe")


def test_t10_a_finished_conversion_is_not_failed_for_its_log(fixture_src, tmp_path):
    dst = str(tmp_path / "dst")
    with open("/dev/full", "w") as full:
        r = cli("mxfp4-to-int4", fixture_src, "-o", dst, "--devices", "cpu", stdout=full, stderr=full)
    assert r.returncode == 0
    assert complete(dst)
    verified(dst, fixture_src)


# ---------------------------------------------------------------- T9: per-node copies of SRC, mtimes later

def test_t9_a_copy_of_src_with_later_mtimes_continues_by_content(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--part", "1/3", *CPU)
    assert r.exit_code == 0, r.output
    for name in os.listdir(src_copy):   # node 2's own copy at the same path: same bytes, new inodes, an hour later
        path = os.path.join(src_copy, name)
        shutil.copyfile(path, path + ".new")
        os.replace(path + ".new", path)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 3600 * 10**9))
    for part in ("2/3", "3/3"):
        r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--part", part, *CPU)
        assert r.exit_code == 0, r.output
    assert complete(dst)
    verified(dst, src_copy)
    shard = min(f for f in os.listdir(src_copy) if f.endswith(".safetensors"))
    path = os.path.join(src_copy, shard)
    with open(path, "r+b") as f:   # now a content change: refused, as before
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, *CPU)
    assert_clean_error(r, "source files changed", code=4)


def test_issue33_dry_run_json_still_parses(fixture_src, tmp_path):
    """A guard: the dry run's JSON still parses (the space check added no output)."""
    r = run_cli("mxfp4-to-int4", fixture_src, "-o", tmp_path / "dst", "--dry-run", "--devices", "cpu",
                "--progress", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["dst_action"] == "create it", r.output
