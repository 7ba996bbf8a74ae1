"""Defects of the third adversarial pass (the third pass of docs/reliability.md, main 74b0137) about
the identity of a source (S1-S3), options and job files (S10-S13) and a side file gone from SRC
(S15): each test failed on 74b0137. docs/reliability.md maps each to its mechanism.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from converter.state.files import MANIFEST
from converter.state.records import read_json
from converter.profiles import bundled_dir

from conftest import assert_clean_error, run_cli
from loop_mounts import two_mounts  # noqa: F401 (a fixture)


def manifest(dst: str) -> dict:
    return read_json(os.path.join(dst, MANIFEST)) or {}


def run_json(dst: str) -> dict:
    return read_json(os.path.join(dst, ".k3convert", "run.json")) or {}


def convert_part(src: str, dst: str, part: str, *more: str):
    return run_cli("mxfp4-to-int4", src, "-o", dst, "--part", part, "--progress", "none", "--devices", "cpu", *more)


def verified(dst: str, src: str) -> None:
    r = run_cli("verify", dst, "--source", src)
    assert r.exit_code == 0, r.output


# ---------------------------------------------------------------- S1: another device number, the same files

def test_s1_parts_through_another_device_continue(two_mounts, fixture_src, tmp_path):
    mnt, remount = two_mounts
    src, dst = os.path.join(mnt, "src"), str(tmp_path / "dst")
    shutil.copytree(fixture_src, src)
    os.sync()
    r = convert_part(src, dst, "1/3")
    assert r.exit_code == 0, r.output
    dev = os.stat(os.path.join(src, "config.json")).st_dev
    remount()
    assert os.stat(os.path.join(src, "config.json")).st_dev != dev  # another device number, the same files
    for part in ("2/3", "3/3"):
        r = convert_part(src, dst, part)
        assert r.exit_code == 0, r.output
    assert manifest(dst).get("complete") is True
    verified(dst, src)


# ---------------------------------------------------------------- S2: cp -al moves every ctime

def test_s2_a_hard_link_backup_does_not_refuse_the_next_part(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = convert_part(src_copy, dst, "1/3")
    assert r.exit_code == 0, r.output
    ctime = os.stat(os.path.join(src_copy, "config.json")).st_ctime_ns
    subprocess.run(["cp", "-al", src_copy, str(tmp_path / "backup")], check=True)
    assert os.stat(os.path.join(src_copy, "config.json")).st_ctime_ns != ctime  # the link count moved it
    r = convert_part(src_copy, dst, "2/3")
    assert r.exit_code == 0, r.output
    # the content was re-read once and matched: the hints now are the files' own
    hints = run_json(dst)["hints"]
    for name, h in hints.items():
        st = os.stat(os.path.join(src_copy, name))
        assert h == {"inode": st.st_ino, "ctime_ns": st.st_ctime_ns}
    r = run_cli("finalize", dst)
    assert r.exit_code == 4, r.output  # part 3 not yet done: partial, not refused
    r = convert_part(src_copy, dst, "3/3")
    assert r.exit_code == 0, r.output
    assert manifest(dst).get("complete") is True
    verified(dst, src_copy)


# ---------------------------------------------------------------- S3: a relative --profile from elsewhere

def _profile_copy(folder, name: str | None = None, **edits: str) -> str:
    """configs/profiles/kimi-k3.toml copied into ``folder`` (as k3.toml), optionally renamed."""
    os.makedirs(folder, exist_ok=True)
    text = open(os.path.join(bundled_dir(), "kimi-k3.toml")).read()
    if name:
        assert 'name = "kimi-k3"' in text
        text = text.replace('name = "kimi-k3"', f'name = "{name}"')
    path = os.path.join(folder, "k3.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def test_s3_a_relative_profile_is_the_profile_not_the_path(src_copy, tmp_path, monkeypatch):
    dst = str(tmp_path / "dst")
    here, there = tmp_path / "jobs", tmp_path / "elsewhere"
    _profile_copy(here)
    os.makedirs(there)
    monkeypatch.chdir(here)
    r = convert_part(src_copy, dst, "1/3", "--profile", "k3.toml")
    assert r.exit_code == 0, r.output
    monkeypatch.chdir(there)
    # the same profile by another path, and by its bundled name (the same bytes)
    r = convert_part(src_copy, dst, "2/3", "--profile", os.path.relpath(here / "k3.toml"))
    assert r.exit_code == 0, r.output
    r = convert_part(src_copy, dst, "3/3", "--profile", "kimi-k3")
    assert r.exit_code == 0, r.output
    r = run_cli("finalize", dst)  # from another directory than the relative path was given in
    assert r.exit_code == 0, r.output
    assert manifest(dst).get("complete") is True
    verified(dst, src_copy)


def test_s3_another_profile_content_is_refused(src_copy, tmp_path, monkeypatch):
    dst = str(tmp_path / "dst")
    monkeypatch.chdir(tmp_path)
    _profile_copy(tmp_path / "a")
    _profile_copy(tmp_path / "b", name="kimi-k3-edited")
    r = convert_part(src_copy, dst, "1/2", "--profile", "a/k3.toml")
    assert r.exit_code == 0, r.output
    r = convert_part(src_copy, dst, "2/2", "--profile", "b/k3.toml")
    assert_clean_error(r, "other options: --profile", "kimi-k3-edited", code=4)


# ---------------------------------------------------------------- S10: a job file's profile is its own

def _dry(*args: str) -> dict:
    r = run_cli("mxfp4-to-int4", *args, "--dry-run", "--progress", "json", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_s10_job_file_profile_is_relative_to_the_job_file(src_copy, tmp_path, monkeypatch):
    jobs, cwd = tmp_path / "jobs", tmp_path / "cwd"
    _profile_copy(jobs, name="k3-of-the-job")
    _profile_copy(cwd, name="k3-of-the-cwd")
    (jobs / "job.toml").write_text(f'src = "{src_copy}"\nprofile = "k3.toml"\n')
    monkeypatch.chdir(cwd)
    info = _dry("--config", str(jobs / "job.toml"))
    assert info["profile"].startswith("k3-of-the-job ")
    # on the command line a relative file is the working directory's, as any path there
    info = _dry(src_copy, "--profile", "k3.toml")
    assert info["profile"].startswith("k3-of-the-cwd ")


# ---------------------------------------------------------------- S11: --config given twice

def test_s11_two_job_files_apply_in_order(src_copy, tmp_path):
    site, model = tmp_path / "site.toml", tmp_path / "model.toml"
    site.write_text('scale-rule = "vllm-gfx942"\nshards = "1-2"\n')
    model.write_text(f'src = "{src_copy}"\nshards = "2"\n')
    info = _dry("--config", str(site), "--config", str(model))
    assert info["scale_rule"] == "vllm-gfx942"  # the first file is not ignored
    assert info["shards"] == 1                   # the later file wins where both say
    info = _dry("--config", str(site), "--config", str(model), "--shards", "1-3")
    assert info["shards"] == 3                   # the command line wins over both


# ---------------------------------------------------------------- S12: values that select nothing or blame another

@pytest.mark.parametrize("value", ["", "abc", "0"])
def test_s12_workers_from_the_environment_is_blamed_by_name(src_copy, tmp_path, monkeypatch, value):
    monkeypatch.setenv("K3CONVERT_WORKERS", value)
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--dry-run")
    err = assert_clean_error(r, f"K3CONVERT_WORKERS={value!r}", code=2)
    assert "--workers" not in err
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--dry-run", "--workers", "1")
    assert r.exit_code == 0, r.output  # the command line wins over the environment


@pytest.mark.parametrize("value", ["2.7", "1e3", "2.0"])
def test_s12_job_file_workers_must_be_whole(src_copy, tmp_path, value):
    job = tmp_path / "job.toml"
    job.write_text(f"workers = {value}\n")
    r = run_cli("mxfp4-to-int4", src_copy, "--config", str(job), "-o", str(tmp_path / "dst"), "--dry-run")
    assert_clean_error(r, str(job), "workers", "whole number", code=2)


@pytest.mark.parametrize("args, needle", [
    (("--shards", ""), "--shards ''"),
    (("--part", ""), "--part: ''"),
    (("--shards", " "), "selects no shard"),
    (("--shards", "3-1"), "reversed"),
])
def test_s12_an_empty_or_reversed_selection_is_refused(src_copy, tmp_path, args, needle):
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--dry-run", *args)
    assert_clean_error(r, needle, code=2)
    r = run_cli("mxfp4-to-int4", src_copy, "-o", str(tmp_path / "dst"), "--progress", "none", *args)
    assert_clean_error(r, needle, code=2)
    assert not os.path.exists(tmp_path / "dst" / MANIFEST)


def test_s12_job_file_empty_shards_is_refused(src_copy, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('shards = ""\n')
    r = run_cli("mxfp4-to-int4", src_copy, "--config", str(job), "-o", str(tmp_path / "dst"), "--dry-run")
    assert_clean_error(r, "selects no shard", code=2)


# ---------------------------------------------------------------- S13: --dry-run decides as the run does

def test_s13_dry_run_against_another_conversion_says_what_the_run_does(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--sample-experts", "2", "--progress", "none")
    assert r.exit_code == 0 and manifest(dst)["complete"] is True, r.output
    dry = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--dry-run")
    real = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none")
    for r in (dry, real):  # the same refusal, word for word
        assert_clean_error(r, "holds a different conversion (other options: --sample-experts 2 (recorded) vs 4)",
                           "--overwrite", code=4)
    assert dry.stderr == real.stderr
    info = _dry(src_copy, "-o", dst, "--overwrite")
    assert info["dst_action"].startswith("replace it (--overwrite)")
    assert (info["shards_done"], info["shards_todo"]) == (0, info["shards"])
    info = _dry(src_copy, "-o", dst, "--sample-experts", "2")
    assert info["dst_action"] == "continue the conversion it holds" and info["shards_todo"] == 0


# ---------------------------------------------------------------- S15: a side file gone from SRC

def test_s15_a_side_file_removed_from_src_is_removed_from_dst(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    os.makedirs(os.path.join(src_copy, "extra"))
    with open(os.path.join(src_copy, "extra", "notes.txt"), "w") as f:
        f.write("a side file in a folder\n")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none")
    assert r.exit_code == 0 and manifest(dst)["complete"] is True, r.output
    assert {"chat_template.jinja", "extra/notes.txt"} <= set(manifest(dst)["files"])
    os.unlink(os.path.join(src_copy, "chat_template.jinja"))
    shutil.rmtree(os.path.join(src_copy, "extra"))
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none")
    assert r.exit_code == 0, r.output
    assert manifest(dst)["complete"] is True
    assert not os.path.exists(os.path.join(dst, "chat_template.jinja"))
    assert not os.path.exists(os.path.join(dst, "extra"))
    assert not {"chat_template.jinja", "extra/notes.txt"} & set(manifest(dst)["files"])
    verified(dst, src_copy)
