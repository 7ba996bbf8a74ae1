"""The adversarial pass's defects about DST, the coordinator, paths and upload (docs/reliability.md).

One test per defect, named for its ID in docs/reliability.md, table-driven where the
defect has several shapes; each failed on main 98573b5. Conversions run in-process (the
worker runs inline: torch is imported here) unless the test is about processes: the runs
started at once are real processes, released together by one barrier (a FIFO they all open
for reading: the kernel lets every one of them go when the test opens it for writing).
"""
from __future__ import annotations

import errno
import filecmp
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import (INDEX, MANIFEST, REPORT, TABLE, assert_clean_error, assert_not_complete, chunked_sha256,
                      read_json, rewrite_shard, run_cli, shard_names, tree_hash, write_json)

from converter.state import records as manifest_mod
from converter import pipeline
from converter.errors import BadInput
from converter.fixture import FixtureSpec, make_fixture
from converter.pipeline import Options, convert

REPO = Path(__file__).resolve().parents[1]
STATE = ".k3convert"
TEMPORARY = re.compile(r"\.tmp\d+$|\.partial$")
CPU = ("--devices", "cpu", "--progress", "none")


# ------------------------------------------------------------------------------ helpers

def temporaries(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if TEMPORARY.search(f))


def same_output(dst: str, ref: str) -> None:
    """DST holds the reference conversion: every shard, index and config byte for byte, complete."""
    assert shard_names(dst) == shard_names(ref)
    for f in shard_names(ref) + [INDEX, "config.json"]:
        assert filecmp.cmp(os.path.join(dst, f), os.path.join(ref, f), shallow=False), f
    m = read_json(os.path.join(dst, MANIFEST))
    assert m["complete"] is True and sorted(m["shards"]) == shard_names(ref)
    assert not temporaries(dst)


def convert_cli(src: str, dst: str, *extra: str):
    return run_cli("mxfp4-to-int4", src, "-o", dst, *CPU, *extra)


def in_thread(fn, timeout: float, release=lambda: None):
    """``fn()`` on a thread; if it is still running after ``timeout`` s, ``release()`` (e.g.
    open a FIFO's other end) lets it go, and the test fails: it would have hung."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        release()
        t.join(30)
        pytest.fail(f"still running after {timeout} s: it would wait for ever")
    return out["r"]


def release_fifo(path: str):
    def go():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    return go


@pytest.fixture(scope="module")
def other_src(tmp_path_factory):
    """A second source with the same structure and other weights (seed 1), and its conversion."""
    from conftest import SPEC
    root = tmp_path_factory.mktemp("other")
    src, ref = str(root / "src"), str(root / "ref")
    make_fixture(src, FixtureSpec(**{**SPEC.__dict__, "seed": 1}))
    convert(src, ref, Options())
    return src, ref


# ------------------------------------------------------------------------------ D19: runs at once

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
        ident = read_json(os.path.join(dst, STATE, "run.json"))
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
            for rec in os.listdir(os.path.join(dst, STATE)):
                if rec.endswith(".figures.jsonl.zst"):
                    rows = manifest_mod.read_rows(os.path.join(dst, STATE, rec))
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


# ------------------------------------------------------------------------------ D18: containment by inode

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


# ------------------------------------------------------------------------------ D12, D16, D21: the coordinator's writes

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


def test_d12_killed_runs_temporaries_are_cleaned(fixture_src, converted, tmp_path):
    """Temporaries a killed run left (``*.tmpPID`` in DST and its state folder, a ``.partial``)
    are removed by the next run that finds no other run using DST; upload never sees them."""
    dst = str(tmp_path / "dst")
    assert convert_cli(fixture_src, dst, "--shards", "1").exit_code == 0
    left = [os.path.join(dst, "config.json.tmp4242"), os.path.join(dst, STATE, "x.done.json.tmp4242"),
            os.path.join(dst, shard_names(fixture_src)[2] + ".partial")]
    for p in left:
        with open(p, "wb") as f:
            f.write(b"left by a killed run")
    assert convert_cli(fixture_src, dst).exit_code == 0
    assert not temporaries(dst)
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


def test_d12_space_preflight_counts_side_files(src_copy, tmp_path, monkeypatch):
    """A large side file counts in the free-space preflight: refused before any shard is written."""
    with open(os.path.join(src_copy, "big.bin"), "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GB to copy, no space taken here
    dst = str(tmp_path / "dst")
    shards = sum(s.bytes_out for s in pipeline.build_plan(src_copy).shards)
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
    want = sum(s.bytes_out for s in pipeline.build_plan(fixture_src).shards) + sum(
        os.path.getsize(os.path.join(fixture_src, f)) for f in os.listdir(fixture_src)
        if not f.endswith((".safetensors", INDEX)) and f != "config.json")
    assert need > 0 and abs(need * 1e9 - want) / want < 0.05, (need, want)
    assert "has 0.0000041 GB free" in err, err


# ------------------------------------------------------------------------------ D13, D9, D10: names and listings

def _rename_shard(src: str, old: str, new: str) -> None:
    os.rename(os.path.join(src, old), os.path.join(src, new))
    index = read_json(os.path.join(src, INDEX))
    index["weight_map"] = {t: (new if s == old else s) for t, s in index["weight_map"].items()}
    write_json(os.path.join(src, INDEX), index)


@pytest.mark.parametrize("name", [REPORT, MANIFEST, TABLE, "k3convert_x.safetensors", "README.md",
                                  "README.source.md", "model-2.safetensors.partial", "model-2.tmp77"])
def test_d13_shard_named_like_our_files_refused(src_copy, tmp_path, name):
    """A shard named like a file DST writes itself is refused at plan time, one line naming it."""
    _rename_shard(src_copy, shard_names(src_copy)[1], name)
    dst = str(tmp_path / "dst")
    assert_clean_error(convert_cli(src_copy, dst), repr(name), "k3convert writes a file of that name", code=2)
    assert not os.path.exists(dst)


def test_d9_unlisted_tensor_or_shard_refused(src_copy, tmp_path):
    """A tensor in a shard that the index does not list, and a .safetensors file the index
    does not name, are refused (one line each, naming shard and tensor), never converted or
    copied unconverted."""
    import torch

    first = shard_names(src_copy)[1]
    shutil.copy(os.path.join(src_copy, first), os.path.join(src_copy, "extra-00001.safetensors"))
    rewrite_shard(os.path.join(src_copy, first), lambda t: t.__setitem__("stray.weight", torch.zeros(4, 4)))
    dst = str(tmp_path / "dst")
    r = convert_cli(src_copy, dst)
    err = assert_clean_error(r, code=2, one_line=False)
    lines = err.splitlines()
    assert any(os.path.join(src_copy, first) in x and "tensor stray.weight" in x and "not in" in x for x in lines), err
    assert any("extra-00001.safetensors" in x and "does not name" in x for x in lines), err
    assert not os.path.exists(dst)


@pytest.mark.parametrize("length,code", [(238, 0), (247, 0), (248, 2), (255, 2)])
def test_d10_long_shard_names(src_copy, tmp_path, length, code):
    """Legal long shard names: up to 247 bytes they convert (their state files are named by a
    hash) and verify; longer ones, whose NAME.partial cannot exist, are refused in one line."""
    name = "m" * (length - len(".safetensors")) + ".safetensors"
    _rename_shard(src_copy, shard_names(src_copy)[1], name)
    dst = str(tmp_path / "dst")
    r = convert_cli(src_copy, dst)
    if code:
        assert_clean_error(r, "247", "rename the shard", code=2)
        return
    assert r.exit_code == 0, r.output
    assert os.path.exists(os.path.join(dst, name))
    assert all(len(f.encode()) <= 255 for f in os.listdir(os.path.join(dst, STATE)))
    assert run_cli("verify", dst).exit_code == 0


# ------------------------------------------------------------------------------ D11, D28: only regular files

def _mknull(path: str) -> None:
    try:
        os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null: reads give EOF at once
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD)")


@pytest.mark.parametrize("what", ["shard", "index", "config", "side-file"])
@pytest.mark.parametrize("kind", ["fifo", "chardev"])
def test_d11_fifo_or_device_refused_never_waited_on(src_copy, tmp_path, what, kind):
    """A FIFO or a character device in the place of a shard, the index, the config or a side
    file is refused at plan time (exit 2, naming it and what it is), never opened."""
    rel = {"shard": shard_names(src_copy)[1], "index": INDEX, "config": "config.json",
           "side-file": "tokenizer_config.json"}[what]
    path = os.path.join(src_copy, rel)
    os.unlink(path)
    os.mkfifo(path) if kind == "fifo" else _mknull(path)
    dst = str(tmp_path / "dst")
    r = in_thread(lambda: convert_cli(src_copy, dst), 120, release_fifo(path))
    assert_clean_error(r, path, "FIFO" if kind == "fifo" else "character device", code=2)
    assert_not_complete(dst)


def test_d11_verify_does_not_hang_on_a_fifo_shard(converted, tmp_path):
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    shard = os.path.join(dst, shard_names(dst)[1])
    os.unlink(shard)
    os.mkfifo(shard)
    r = in_thread(lambda: run_cli("verify", dst), 120, release_fifo(shard))
    assert r.exit_code == 5, r.output
    assert "FIFO" in r.output and os.path.basename(shard) in r.output


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
def test_d28_inspect_names_what_the_path_is(tmp_path, kind):
    path = str(tmp_path / "thing")
    os.mkfifo(path) if kind == "fifo" else _mknull(path)
    r = in_thread(lambda: run_cli("inspect", path), 60, release_fifo(path))
    assert_clean_error(r, path, "FIFO (named pipe)" if kind == "fifo" else "character device", code=2)


# ------------------------------------------------------------------------------ D17: read errors

def test_d17_source_read_error_names_the_source(fixture_src, tmp_path, monkeypatch):
    """EIO while reading a source shard: exit 4, the SRC file (and tensor) named, not DST's."""
    shard = os.path.join(fixture_src, shard_names(fixture_src)[1])
    real = os.preadv

    def preadv(fd, bufs, offset, *a):
        if os.readlink(f"/proc/self/fd/{fd}") == shard:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset, *a)
    monkeypatch.setattr(os, "preadv", preadv)
    dst = str(tmp_path / "dst")
    err = assert_clean_error(convert_cli(fixture_src, dst), f"file {shard}", os.strerror(errno.EIO), code=4)
    assert os.path.join(dst, os.path.basename(shard)) not in err and "tensor " in err
    assert_not_complete(dst)


# ------------------------------------------------------------------------------ D20: figures independent of workers

def test_d20_figures_do_not_depend_on_workers_or_threads(fixture_src, tmp_path):
    """--workers 1 and 2 (worker processes with 2 and 1 compute threads on this machine's
    cores, NUMBA_NUM_THREADS fixed at 2): report and tensor table byte-identical."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "NUMBA_NUM_THREADS": "2"}
    outs = []
    for workers in ("1", "2"):
        dst = str(tmp_path / f"w{workers}")
        r = subprocess.run([sys.executable, "-m", "converter", "mxfp4-to-int4", fixture_src, "-o", dst, *CPU,
                            "--workers", workers], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        outs.append(dst)
    for f in (REPORT, TABLE):
        assert filecmp.cmp(os.path.join(outs[0], f), os.path.join(outs[1], f), shallow=False), f


def test_d20_output_error_is_exact_for_any_thread_count():
    """The CPU kernel's output error of one matrix with 1 and 2 numba threads: equal, and
    equal to the exactly summed figure."""
    import math

    import numba
    import torch

    from converter.quant.cpu_kernel import output_error, requantize
    from converter.validate import probe

    gen = torch.Generator().manual_seed(3)
    rows, cols = 4096, 64
    packed = torch.randint(0, 256, (rows * cols // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 130, (rows * cols // 32,), dtype=torch.uint8, generator=gen)
    res = requantize(packed, scales)
    got = []
    for n in (1, 2):
        numba.set_num_threads(n)
        got.append(output_error(packed, scales, res.packed, res.scales, cols, probe(cols)))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert got[0] == got[1] and math.isfinite(got[0]) and got[0] > 0


# ------------------------------------------------------------------------------ D22, D23: options

@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.5"])
def test_d22_bad_threshold_refused(fixture_src, tmp_path, value):
    dst = str(tmp_path / "dst")
    assert_clean_error(convert_cli(fixture_src, dst, "--max-rel-rmse", value), "--max-rel-rmse", code=2)
    assert not os.path.exists(dst)


def test_d23_cuda_device_without_gpu_support(fixture_src, tmp_path, monkeypatch):
    """--devices cuda:0 where no GPU is visible, and where one is but torch has no CUDA: exit 2,
    one line, nothing written."""
    import torch

    dst = str(tmp_path / "dst")
    if pipeline.gpu_count() == 0:
        assert_clean_error(run_cli("mxfp4-to-int4", fixture_src, "-o", dst, "--devices", "cuda:0"),
                           "--devices", "cuda:0", code=2)
        assert not os.path.exists(dst)
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the CPU-only case cannot be shown here")
    monkeypatch.setattr(pipeline, "gpu_count", lambda: 1)  # a GPU is there, this torch cannot use it
    with pytest.raises(BadInput) as e:
        convert(fixture_src, dst, Options(devices=["cuda:0"], workers_per_gpu=1, inline=True))
    assert "cuda:0" in str(e.value) and "no CUDA or ROCm support" in str(e.value) and "\n" not in str(e.value)
    assert not shard_names(dst)
    assert_not_complete(dst)


# ------------------------------------------------------------------------------ D6, D14, D27: upload

from hub_standin import RecordingApi as _Api  # noqa: E402 (records what upload sends; no network)


def test_d6_card_states_the_configs_activation(converted, tmp_path):
    from converter.hub import model_card

    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    card = model_card(dst)
    assert "SiTU" in card and "activation_situ_beta" in card
    m = read_json(os.path.join(dst, MANIFEST))
    m["activation"] = {"hidden_act": "silu"}
    write_json(os.path.join(dst, MANIFEST), m)
    card = model_card(dst)
    assert "SiTU" not in card and "situ" not in card.lower().replace("situation", "")
    assert "`hidden_act: silu`" in card and "Expert activation: silu" in card


def test_d14_source_readme_is_never_published_as_ours(src_copy, tmp_path):
    """SRC's README.md (the MXFP4 model's card) is kept as README.source.md; upload writes and
    sends our card as README.md. A DST made before, holding the source's card as README.md,
    gets our card too, the source's moved aside."""
    from converter.hub import upload

    theirs = "---\nlicense: other\n---\n# Kimi K3 (MXFP4)\n"
    with open(os.path.join(src_copy, "README.md"), "w") as f:
        f.write(theirs)
    dst = str(tmp_path / "dst")
    assert convert_cli(src_copy, dst).exit_code == 0
    assert not os.path.exists(os.path.join(dst, "README.md"))
    with open(os.path.join(dst, "README.source.md")) as f:
        assert f.read() == theirs
    for case in ("converted now", "converted before"):
        if case == "converted before":
            os.replace(os.path.join(dst, "README.source.md"), os.path.join(dst, "README.md"))
            shutil.copy(os.path.join(src_copy, "README.md"), os.path.join(dst, "README.md"))
        api = _Api()
        res = upload(dst, "someone/k3-int4", api=api)
        assert res.readme == "written", case
        with open(os.path.join(dst, "README.md")) as f:
            card = f.read()
        assert card != theirs and "int4" in card and "README.source.md" in card, case
        with open(os.path.join(dst, "README.source.md")) as f:
            assert f.read() == theirs
        assert api.committed["README.md"] == card.encode()
        os.unlink(os.path.join(dst, "README.md"))


def test_d27_upload_refuses_folder_symlinks(converted, tmp_path):
    from converter.errors import VerifyFailed
    from converter.hub import upload

    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the Hub")
    os.symlink(outside, os.path.join(dst, "extra"))
    with pytest.raises(VerifyFailed) as e:
        upload(dst, "someone/k3-int4", dry_run=True)
    assert "extra is a symlink" in str(e.value)


# ------------------------------------------------------------------------------ review of this round's fixes

def test_finalize_reads_the_identity_under_its_locks(converted, other_src, tmp_path, monkeypatch):
    """A standalone ``finalize`` waiting for its locks while an --overwrite run replaces DST's
    source: once it gets them it describes the source DST now holds, never the one it read
    before (no manifest naming one source over the other's shards). manifest.lock survives
    the wipe, so the waiting finalize and the overwrite run lock the same file."""
    import fcntl

    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    lock = os.path.join(dst, STATE, "manifest.lock")
    real, fired = fcntl.flock, {}

    def flock(f, how):  # the finalize's first lock: the --overwrite run gets in just before it
        if not fired and how == fcntl.LOCK_SH and os.readlink(f"/proc/self/fd/{f.fileno()}").endswith("run.lock"):
            fired["inode"] = os.stat(lock).st_ino if os.path.exists(lock) else None
            assert convert(other_src[0], dst, Options(overwrite=True)).complete
        return real(f, how)
    monkeypatch.setattr(fcntl, "flock", flock)
    summary = pipeline.finalize(dst)
    monkeypatch.undo()
    assert fired and summary.complete
    m = read_json(os.path.join(dst, MANIFEST))
    assert m["source"]["path"] == other_src[0], m["source"]["path"]
    assert read_json(os.path.join(dst, STATE, "run.json"))["source"] == other_src[0]
    same_output(dst, other_src[1])
    assert fired["inode"] is None or os.stat(lock).st_ino == fired["inode"]  # never deleted


JSON_FIFOS = [  # (command, where the FIFO is, the file): each JSON file these commands read
    ("verify", "dst", MANIFEST), ("verify", "dst", INDEX), ("verify", "dst", "config.json"),
    ("inspect", "dst", MANIFEST), ("inspect", "dst", INDEX), ("inspect", "dst", "config.json"),
    ("verify --source", "src", INDEX),
]


@pytest.mark.parametrize("cmd,where,name", JSON_FIFOS, ids=[f"{c}-{w}-{n}" for c, w, n in JSON_FIFOS])
def test_json_reader_refuses_a_fifo(converted, src_copy, tmp_path, cmd, where, name):
    """A FIFO in the place of a JSON file that verify or inspect reads: a non-zero exit at once,
    naming the file or saying it is a FIFO (the JSON reader never opens one for blocking reads)."""
    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    path = os.path.join(dst if where == "dst" else src_copy, name)
    os.unlink(path)
    os.mkfifo(path)
    args = {"verify": ["verify", dst], "inspect": ["inspect", dst],
            "verify --source": ["verify", dst, "--source", src_copy]}[cmd]
    r = in_thread(lambda: run_cli(*args), 10, release_fifo(path))
    assert r.exception is None or isinstance(r.exception, SystemExit), (r.exception, r.output)
    if (cmd, name) == ("inspect", MANIFEST):  # inspect describes an unreadable manifest as such
        assert r.exit_code == 0 and "k3convert int4 output" in r.output, r.output
    else:
        assert r.exit_code != 0, r.output
        assert "FIFO" in r.output or name in r.output, r.output  # verify words it its own way (verify.dst.read_obj)


def test_json_reader_missing_file_is_still_absent(tmp_path):
    from converter.formats import json_input

    with pytest.raises(FileNotFoundError):
        json_input.load_file(str(tmp_path / "none.json"))
    assert manifest_mod.read_json(str(tmp_path / "none.json")) is None


@pytest.mark.parametrize("changed", [0, 1])
def test_rerun_copies_only_the_side_files_the_preflight_counted(src_copy, tmp_path, monkeypatch, changed):
    """Rerunning a complete DST copies exactly the side files ``bytes_needed`` counts (none, or
    the one changed in SRC since), so a preflight that passes on a nearly full disk holds."""
    dst = str(tmp_path / "dst")
    assert convert(src_copy, dst, Options()).complete
    plan = pipeline.build_plan(src_copy)
    assert plan.other_files and pipeline.bytes_needed(plan, dst, []) == 0
    edited = os.path.join(src_copy, "tokenizer_config.json")
    if changed:
        with open(edited, "a") as f:
            f.write("\n")
        plan = pipeline.build_plan(src_copy)
    copied, real = [], pipeline.stage_copy
    monkeypatch.setattr(pipeline, "stage_copy", lambda a, b: copied.append(a) or real(a, b))
    need = pipeline.bytes_needed(plan, dst, [])
    assert convert(src_copy, dst, Options()).complete
    assert copied == [edited] * changed
    assert need == sum(os.path.getsize(p) for p in copied)
    with open(edited, "rb") as a, open(os.path.join(dst, "tokenizer_config.json"), "rb") as b:
        assert a.read() == b.read()


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
    monkeypatch.setattr(pipeline, "_clean_temporaries", lambda *a: None)
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
    plan = pipeline.build_plan(src_copy)
    path, before = setup(monkeypatch, src_copy, dst, plan)
    before()
    with pytest.raises(ConvertError) as e:
        convert(src_copy, dst, Options(), plan=plan)
    monkeypatch.undo()
    assert e.value.exit_code == 4 and path in str(e.value) and "\n" not in str(e.value), repr(e.value)
    assert_not_complete(dst)


def test_upload_leaves_out_every_temporary_plan_calls_ours(converted, tmp_path):
    """A bare ``.tmp`` (older versions' temporaries) is left out like ``.tmpPID``: the listing
    and what is committed both follow plan.TEMPORARY."""
    from converter.hub import upload, upload_files
    from converter.plan import TEMPORARY as OURS

    dst = str(tmp_path / "dst")
    shutil.copytree(converted.dst, dst)
    os.makedirs(os.path.join(dst, "sub"))
    left = ["config.json.tmp", "config.json.tmp77", "sub/x.json.tmp", "a[1].tmp", "s.safetensors.partial"]
    for rel in left + ["sub/keep.tmp.json"]:
        open(os.path.join(dst, rel), "wb").close()
    m = read_json(os.path.join(dst, MANIFEST))  # a side file of that name: named by the manifest, so sent
    m["files"]["sub/keep.tmp.json"] = {"bytes": 0, "digest": chunked_sha256(os.path.join(dst, "sub/keep.tmp.json"))}
    write_json(os.path.join(dst, MANIFEST), m)
    assert all(OURS.search(p) for p in left)
    sent = [p for p, _ in upload_files(dst)]
    assert "sub/keep.tmp.json" in sent and not set(left) & set(sent), sent
    api = _Api()
    upload(dst, "someone/k3-int4", api=api)
    kept = sorted(api.committed)
    assert "sub/keep.tmp.json" in kept and not set(left) & set(kept), kept


def test_upload_never_waits_on_a_fifo_for_the_source_card(converted, tmp_path):
    """The manifest's source path is untrusted: a FIFO as its README.md is not opened for reading."""
    from converter.hub import upload

    dst, src = str(tmp_path / "dst"), str(tmp_path / "src")
    shutil.copytree(converted.dst, dst)
    os.makedirs(src)
    os.mkfifo(os.path.join(src, "README.md"))
    m = read_json(os.path.join(dst, MANIFEST))
    m["source"]["path"] = src
    write_json(os.path.join(dst, MANIFEST), m)
    with open(os.path.join(dst, "README.md"), "w") as f:
        f.write("# mine\n")
    res = in_thread(lambda: upload(dst, "someone/k3-int4", api=_Api()), 10, release_fifo(os.path.join(src, "README.md")))
    assert res.readme == "kept"
