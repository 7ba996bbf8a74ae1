"""What a DST is a conversion of, and who may use it: runs started at once, job-array parts,
``--overwrite``, the run records, a source that changed since, DST and SRC kept apart.

Each test is named for its defect in docs/reliability.md (D18, D19, R1-R3, S1-S3, S13, S15, T7, T9,
T12, T13), which describes the mechanism that fixed it; each failed before its fix. The runs started
at once (D19) are real processes released together by one barrier (a FIFO they all open for reading:
the kernel lets every one of them go when the test opens it for writing); other conversions run
in-process.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from dst_helpers import CPU, REPO, complete, convert_cli, copy_dst, dry_run, profile_copy, same_output, verified
from loop_mounts import two_mounts  # noqa: F401 (a fixture)

from converter.fixture import FixtureSpec, make_fixture
from converter.run import finalize as run_finalize
from converter.run.options import Options
from converter.run.pipeline import convert
from converter.state import records as manifest_mod
from converter.state.files import STATE_DIR
from converter.state.locks import reading
from tests.conftest import MANIFEST, assert_clean_error, assert_not_complete, read_json, run_cli, tree_hash


def manifest(dst: str) -> dict:
    return manifest_mod.read_json(os.path.join(dst, MANIFEST)) or {}


def run_json(dst: str) -> dict:
    return manifest_mod.read_json(os.path.join(dst, ".k3convert", "run.json")) or {}


def convert_part(src: str, dst: str, part: str, *more: str):
    return run_cli("mxfp4-to-int4", src, "-o", dst, "--part", part, "--progress", "none", "--devices", "cpu", *more)


@pytest.fixture(scope="module")
def other_src(tmp_path_factory):
    """A second source with the same structure and other weights (seed 1), and its conversion."""
    from tests.conftest import SPEC
    root = tmp_path_factory.mktemp("other")
    src, ref = str(root / "src"), str(root / "ref")
    make_fixture(src, FixtureSpec(**{**SPEC.__dict__, "seed": 1}))
    convert(src, ref, Options())
    return src, ref


# ---------------------------------------- D19: runs started at once never mix

_LAUNCHER = r'''
import contextlib, io, json, os, sys
import torch  # imported before the barrier: each run converts in its own process, at once
from converter.cli import main

work, rounds = sys.argv[1], int(sys.argv[2])
me = sys.argv[3]
for r in range(rounds):
    args = json.load(open(os.path.join(work, f"args-{r}-{me}.json")))
    open(os.path.join(work, f"ready-{r}-{me}"), "w").close()
    open(os.path.join(work, f"go-{r}")).close()  # the barrier: returns when the test opens it for writing
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args, standalone_mode=True)
            rc = 0
        except SystemExit as e:
            rc = e.code or 0
    with open(os.path.join(work, f"rc-{r}-{me}.tmp"), "w") as f:
        json.dump({"rc": rc, "stderr": err.getvalue(), "pid": os.getpid()}, f)
    os.replace(os.path.join(work, f"rc-{r}-{me}.tmp"), os.path.join(work, f"rc-{r}-{me}.json"))
'''


def started_at_once(work: str, runs: list[list[list[str]]]) -> list[list[dict]]:
    """``runs[r][i]``: the CLI arguments of process i in round r. Every process is started
    first; each round, all wait at one barrier and are released by one open. Returns each
    round's results (exit code, stderr, pid), by process."""
    os.makedirs(work)
    n, rounds = len(runs[0]), len(runs)
    launcher = os.path.join(work, "launch.py")
    with open(launcher, "w") as f:
        f.write(_LAUNCHER)
    for r, args in enumerate(runs):
        os.mkfifo(os.path.join(work, f"go-{r}"))
        for i, a in enumerate(args):
            with open(os.path.join(work, f"args-{r}-{i}.json"), "w") as f:
                json.dump(a, f)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, launcher, work, str(rounds), str(i)], cwd=REPO, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for i in range(n)]
    results = []
    try:
        for r in range(rounds):
            deadline = time.monotonic() + 300
            while not all(os.path.exists(os.path.join(work, f"ready-{r}-{i}")) for i in range(n)):
                for p in procs:
                    if p.poll() is not None:
                        raise AssertionError(p.stderr.read().decode())
                assert time.monotonic() < deadline, "the runs did not reach the barrier"
                time.sleep(0.01)
            time.sleep(0.2)  # each is now blocked opening the FIFO
            with open(os.path.join(work, f"go-{r}"), "w"):
                pass  # every reader's open returns now, together
            while not all(os.path.exists(os.path.join(work, f"rc-{r}-{i}.json")) for i in range(n)):
                for i, p in enumerate(procs):  # one that has finished its last round may have exited
                    if p.poll() is not None and not os.path.exists(os.path.join(work, f"rc-{r}-{i}.json")):
                        raise AssertionError(p.stderr.read().decode())
                assert time.monotonic() < deadline, "the runs did not finish"
                time.sleep(0.02)
            results.append([read_json(os.path.join(work, f"rc-{r}-{i}.json")) for i in range(n)])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return results


ROUNDS = 4


@pytest.mark.parametrize("clash", ["sources", "options", "overwrite"])
def test_d19_runs_started_at_once_never_mix(fixture_src, other_src, converted, tmp_path, clash):
    """Two runs of different conversions started at once on one DST, as in the report
    (S1 --shards 1 and S2 --shards 2,3; or one SRC with two option sets): exactly one goes
    on, the other is refused (exit 4) naming the run that holds DST; completing DST with the
    winner's command gives exactly the winner's conversion. Four rounds, fresh DST each."""
    runs, kinds = [], []
    for r in range(ROUNDS):
        dst = str(tmp_path / f"dst{r}")
        if clash == "sources":
            a = ["mxfp4-to-int4", fixture_src, "-o", dst, *CPU, "--shards", "1"]
            b = ["mxfp4-to-int4", other_src[0], "-o", dst, *CPU, "--shards", "2,3"]
        elif clash == "options":
            a = ["mxfp4-to-int4", fixture_src, "-o", dst, *CPU, "--shards", "1"]
            b = ["mxfp4-to-int4", fixture_src, "-o", dst, *CPU, "--shards", "2,3", "--sample-experts", "2"]
        if clash == "overwrite":  # the later one may replace DST, but only when the other no longer uses it
            a = ["mxfp4-to-int4", fixture_src, "-o", dst, *CPU, "--shards", "1", "--overwrite"]
            b = ["mxfp4-to-int4", other_src[0], "-o", dst, *CPU, "--shards", "2,3", "--overwrite"]
        runs.append([a, b] if r % 2 == 0 else [b, a])  # either may be started first
        kinds.append(["a", "b"] if r % 2 == 0 else ["b", "a"])
    results = started_at_once(str(tmp_path / "work"), runs)
    for r, (res, kind) in enumerate(zip(results, kinds)):
        dst = str(tmp_path / f"dst{r}")
        codes = sorted(x["rc"] for x in res)
        ident = read_json(os.path.join(dst, STATE_DIR, "run.json"))
        if clash == "overwrite":  # both may succeed one after the other; DST is then the last one's
            assert codes in ([0, 0], [0, 4]), (r, res)
            won = next(i for i, x in enumerate(res) if x["pid"] == ident["created_by"]["pid"])
            assert res[won]["rc"] == 0, res
            for x in res:
                if x["rc"]:
                    assert "another k3convert run is using" in x["stderr"] and "pid" in x["stderr"], x
            args = [x for x in runs[r][won] if x not in ("--shards", "1", "2,3")]
            assert run_cli(*args).exit_code == 0
            same_output(dst, converted.dst if kind[won] == "a" else other_src[1])
            continue
        assert codes == [0, 4], (r, res)
        won = next(i for i, x in enumerate(res) if x["rc"] == 0)
        lost = res[1 - won]
        err = lost["stderr"].strip()
        assert err.startswith("k3convert: error: ") and "\n" not in err, err
        assert "holds a different conversion" in err and f"pid {res[won]['pid']}" in err, err
        assert ident["created_by"]["pid"] == res[won]["pid"]
        assert_not_complete(dst)
        # the winner's full command completes DST: it must then be exactly the winner's conversion
        winner = runs[r][won]
        args = [x for x in winner if x not in ("--shards", "1", "2,3")]
        done = run_cli(*args)
        assert done.exit_code == 0, done.output
        if clash == "sources":
            same_output(dst, converted.dst if kind[won] == "a" else other_src[1])
        else:
            same_output(dst, converted.dst)  # sampling changes figures, not bytes: check what was recorded
            want = 4 if kind[won] == "a" else 2
            assert read_json(os.path.join(dst, MANIFEST))["options"]["sample_experts"] == want
            for rec in os.listdir(os.path.join(dst, STATE_DIR)):
                if rec.endswith(".figures.jsonl.zst"):
                    rows = manifest_mod.read_rows(os.path.join(dst, STATE_DIR, rec))
                    sampled = {r["name"].split(".experts.")[1].split(".")[0] for r in rows
                               if r["out_rel"] is not None and ".experts." in r["name"]}
                    assert len(sampled) <= want, (rec, sampled)
        assert run_cli("verify", dst).exit_code == 0


def test_d19_job_array_started_at_once_cooperates(fixture_src, converted, tmp_path):
    """A job array (--part i/3) started at once, twice: all parts succeed, and DST is the
    single run's conversion, completed once."""
    runs = [[["mxfp4-to-int4", fixture_src, "-o", str(tmp_path / f"dst{r}"), *CPU, "--part", f"{i}/3"]
             for i in (1, 2, 3)] for r in range(2)]
    for r, res in enumerate(started_at_once(str(tmp_path / "work"), runs)):
        assert [x["rc"] for x in res] == [0, 0, 0], res
        same_output(str(tmp_path / f"dst{r}"), converted.dst)


# ---------------------------------------- D18: DST and SRC never contain each other, by inode

def _unshare() -> list[str] | None:
    """A private mount namespace for a bind mount that vanishes with the process: root needs
    ``unshare -m``, anyone else ``unshare -rm`` (where user namespaces are allowed)."""
    cmd = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    try:
        ok = subprocess.run([*cmd, "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return None
    return cmd if ok else None


@pytest.mark.parametrize("case", ["dst-in-src-by-bind-mount", "src-in-dst-by-bind-mount",
                                  "dst-in-src-by-symlinked-parent", "dst-in-src-by-dotdot"])
def test_d18_dst_inside_src_by_alias_refused(src_copy, tmp_path, case):
    """DST inside SRC (or SRC inside DST) under another name is refused (exit 4) and SRC is
    untouched. The bind mounts run in a private mount namespace (root, or a user namespace);
    the alias cases without a mount need no privilege."""
    src = src_copy
    before = tree_hash(src)
    alias = str(tmp_path / "alias")
    if case.endswith("bind-mount"):
        ns = _unshare()
        if ns is None:
            pytest.skip("no mount namespace here (needs root or unprivileged user namespaces)")
        if case == "dst-in-src-by-bind-mount":
            os.mkdir(alias)
            target, s, d = src, src, os.path.join(alias, "int4")
        else:  # SRC lies inside DST's folder, which is reached through a bind mount of it
            outer = str(tmp_path / "outer")
            os.mkdir(outer)
            shutil.move(src, os.path.join(outer, "src"))
            src = os.path.join(outer, "src")
            os.mkdir(alias)
            target, s, d = outer, src, alias
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        script = ('mount --bind "$1" "$2" && exec "$3" -m converter mxfp4-to-int4 "$4" -o "$5" '
                  "--devices cpu --progress none")
        r = subprocess.run([*ns, "sh", "-c", script, "sh", target, alias, sys.executable, s, d],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert r.returncode == 4, (r.returncode, r.stderr)
        assert "must not contain each other" in r.stderr and "Traceback" not in r.stderr, r.stderr
    else:
        if case == "dst-in-src-by-symlinked-parent":
            os.symlink(src, alias)
            d = os.path.join(alias, "int4")
        else:
            d = os.path.join(str(tmp_path), "elsewhere", "..", os.path.basename(src), "int4")
            os.mkdir(os.path.join(str(tmp_path), "elsewhere"))
        assert_clean_error(convert_cli(src, d), "must not contain each other", code=4)
    assert tree_hash(src) == before


def test_d18_containment_compares_devices_and_inodes(tmp_path):
    """safepath.contains on a hard-to-alias pair: a folder reached by two unrelated paths
    (a symlink whose text shares no prefix with the real path), and a sibling with a common prefix."""
    from converter.safepath import contains

    real = tmp_path / "a" / "b"
    real.mkdir(parents=True)
    (tmp_path / "x").mkdir()
    os.symlink(real, tmp_path / "x" / "link")
    (tmp_path / "a" / "bb").mkdir()
    assert contains(str(real), str(tmp_path / "x" / "link" / "new" / "int4"))
    assert contains(str(tmp_path / "x" / "link"), str(real / "int4"))
    assert not contains(str(real), str(tmp_path / "a" / "bb" / "int4"))  # "a/b" is a prefix of "a/bb"
    assert not contains(str(real / "int4"), str(real))


# ---------------------------------------- R1, S3: the threshold, every option and the profile are part of the run

def test_r1_finalize_judges_with_the_recorded_threshold(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--max-rel-rmse", "0.01", "--progress", "none")
    assert r.exit_code == 3, r.output
    r = run_cli("finalize", dst)
    assert r.exit_code == 3, r.output
    assert manifest(dst).get("complete") is not True and manifest(dst).get("status") == "failed-validation"


def test_r1_a_part_with_another_threshold_is_refused_naming_both_values(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--max-rel-rmse", "0.01", "--part", "1/3", "--progress", "none")
    assert r.exit_code == 3, r.output
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--part", "2/3", "--progress", "none")
    assert_clean_error(r, "--max-rel-rmse 0.01 (recorded) vs 0.15", dst, code=4)


def test_identity_records_every_option_that_changes_dst(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--shards", "1", "--sample-experts", "2", "--progress", "none")
    assert r.exit_code == 0, r.output
    run = json.load(open(os.path.join(dst, ".k3convert", "run.json")))
    assert set(run["options"]) >= {"version", "sample_experts", "profile", "drop_activation_quant",
                                   "scale_rule", "max_rel_rmse"}
    # the identity is what the files hold, never where they sit (S1): no device, inode or ctime;
    # those are hints for re-reading the content, kept apart and never compared
    assert not {"dev", "inode", "ctime_ns"} & set(next(iter(run["shards"].values())))
    assert set(next(iter(run["hints"].values()))) == {"inode", "ctime_ns"}
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none")
    assert_clean_error(r, "--sample-experts 2 (recorded) vs 4", code=4)


def test_s3_a_relative_profile_is_the_profile_not_the_path(src_copy, tmp_path, monkeypatch):
    dst = str(tmp_path / "dst")
    here, there = tmp_path / "jobs", tmp_path / "elsewhere"
    profile_copy(here)
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
    profile_copy(tmp_path / "a")
    profile_copy(tmp_path / "b", name="kimi-k3-edited")
    r = convert_part(src_copy, dst, "1/2", "--profile", "a/k3.toml")
    assert r.exit_code == 0, r.output
    r = convert_part(src_copy, dst, "2/2", "--profile", "b/k3.toml")
    assert_clean_error(r, "other options: --profile", "kimi-k3-edited", code=4)


@pytest.mark.parametrize("after", ["moved", "removed", "edited"])
def test_round4_a_profile_file_moved_between_parts_is_the_recorded_profile(src_copy, tmp_path, monkeypatch, after):
    """Round 4: a profile file moved between job parts (same content: the parts agree) made a standalone
    `finalize` and `verify --source` look for the path the first part recorded: exit 2. Decided: the run
    records the profile's text with its SHA-256, and rebuilds it from that (docs/decisions.md): the file
    may move, go, or change afterwards without changing what DST was converted with."""
    dst = str(tmp_path / "dst")
    monkeypatch.chdir(tmp_path)
    first = profile_copy(tmp_path / "a", name="kimi-k3-mine")   # not a bundled name: only the file says it
    r = convert_part(src_copy, dst, "1/2", "--profile", first)
    assert r.exit_code == 0, r.output
    os.makedirs(tmp_path / "b")
    second = str(tmp_path / "b" / "k3.toml")
    os.rename(first, second)
    r = convert_part(src_copy, dst, "2/2", "--profile", second)
    assert r.exit_code == 0, r.output
    if after == "removed":
        os.remove(second)
    elif after == "edited":
        with open(second, "a") as f:
            f.write("\n# edited after the run\n")
    r = run_cli("finalize", dst)
    assert r.exit_code == 0, r.output
    assert manifest(dst).get("complete") is True
    assert manifest(dst)["source"]["profile"]["name"] == "kimi-k3-mine"
    verified(dst, src_copy)


# ---------------------------------------- R2, R3, S1, S2, T9, S15: the source, by content, since the run began

def test_r2_in_place_edit_with_size_and_mtime_restored_is_refused(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--shards", "1", "--progress", "none")
    assert r.exit_code == 0, r.output
    shard = sorted(f for f in os.listdir(src_copy) if f.endswith(".safetensors"))[0]
    path = os.path.join(src_copy, shard)
    st = os.stat(path)
    with open(path, "r+b") as f:                    # flip one byte in the middle, keep the size
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--progress", "none")
    assert_clean_error(r, f"source files changed: {shard} changed", code=4)


def test_r3_finalize_refuses_a_changed_source(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--shards", "1", "--progress", "none")
    assert r.exit_code == 0, r.output
    shard = sorted(f for f in os.listdir(src_copy) if f.endswith(".safetensors"))[-1]
    path = os.path.join(src_copy, shard)
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 1   # another last MiB (the same bytes with another mtime are the same source: issue 32 T9)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)
    r = run_cli("finalize", dst)
    assert_clean_error(r, f"no longer matches (source files changed: {shard} changed)", dst, code=4)
    assert manifest(dst).get("complete") is not True


def test_r3_finalize_of_an_unchanged_source_completes(src_copy, tmp_path):
    dst = str(tmp_path / "dst")
    for part in ("1/2", "2/2"):
        r = run_cli("mxfp4-to-int4", src_copy, "-o", dst, "--part", part, "--progress", "none")
        assert r.exit_code == 0, r.output
    r = run_cli("finalize", dst)
    assert r.exit_code == 0, r.output
    assert manifest(dst).get("complete") is True


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


# ---------------------------------------- S13, T7: the dry run decides as the run does

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
    info = dry_run(src_copy, "-o", dst, "--overwrite")
    assert info["dst_action"].startswith("replace it (--overwrite)")
    assert (info["shards_done"], info["shards_todo"]) == (0, info["shards"])
    info = dry_run(src_copy, "-o", dst, "--sample-experts", "2")
    assert info["dst_action"] == "continue the conversion it holds" and info["shards_todo"] == 0


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


# ---------------------------------------- T12, T13: run records, missing or corrupt, and DST copied without them

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


def test_round4_verify_of_a_truncated_manifest_fails_with_advice_for_verify(converted, tmp_path):
    """Round 4: `verify` of a truncated manifest said "remove it, or run with --overwrite" (the converter's
    option, which throws the shards away) and exited 2 (bad input). A damaged manifest is a DST that fails
    verification, exit 5 as for any other damaged file; the advice, a rerun of the conversion, works."""
    dst = copy_dst(converted, tmp_path)
    _truncate(os.path.join(dst, MANIFEST))
    for args in ([], ["--json"]):
        r = run_cli("verify", dst, *args)
        assert r.exit_code == 5, r.output
    err = assert_clean_error(run_cli("verify", dst), "k3convert_manifest.json: is not valid JSON (truncated or corrupt)",
                             "run the conversion again", code=5)
    assert "--overwrite" not in err and "remove it" not in err, err
    r = run_cli("mxfp4-to-int4", converted.src, "-o", dst, *CPU)
    assert r.exit_code == 0, r.output
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


# ---------------------------------------- finalize reads the identity under its locks

def test_finalize_reads_the_identity_under_its_locks(converted, other_src, tmp_path, monkeypatch):
    """A standalone ``finalize`` waiting for its locks while an --overwrite run replaces DST's
    source: once it gets them it describes the source DST now holds, never the one it read
    before (no manifest naming one source over the other's shards). manifest.lock survives
    the wipe, so the waiting finalize and the overwrite run lock the same file."""
    import fcntl

    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    lock = os.path.join(dst, STATE_DIR, "manifest.lock")
    real, fired = fcntl.flock, {}

    def flock(f, how):  # the finalize's first lock: the --overwrite run gets in just before it
        if not fired and how == fcntl.LOCK_SH and os.readlink(f"/proc/self/fd/{f.fileno()}").endswith("run.lock"):
            fired["inode"] = os.stat(lock).st_ino if os.path.exists(lock) else None
            assert convert(other_src[0], dst, Options(overwrite=True)).complete
        return real(f, how)
    monkeypatch.setattr(fcntl, "flock", flock)
    summary = run_finalize.finalize(dst)
    monkeypatch.undo()
    assert fired and summary.complete
    m = read_json(os.path.join(dst, MANIFEST))
    assert m["source"]["path"] == other_src[0], m["source"]["path"]
    assert read_json(os.path.join(dst, STATE_DIR, "run.json"))["source"] == other_src[0]
    same_output(dst, other_src[1])
    assert fired["inode"] is None or os.stat(lock).st_ino == fired["inode"]  # never deleted
