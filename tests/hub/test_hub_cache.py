"""A Hub source against what a shared cache, a silent or lying server and a full disk do (issue 40,
pass 5: H1-H5, H11's listed size, H13, H14, the dry run's plan). Every conversion is a real process
(``python -m converter``) against the local Hub (tests/support/hub_server.py); two runs side by side are two
processes sharing one cache, and every output is compared with the local conversion of the same files."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dst_helpers import mounted_tmpfs
from hub_runs import REPO, SHARDS, STATE, assert_same_output, blobs, cli, shard_gets
from hub_server import HubServer, SilentServer

from converter.hub.owners import VIEWS
from converter.run import fetch_wait
from tests.hub import test_hub_source

src, local_dst, hub = test_hub_source.src, test_hub_source.local_dst, test_hub_source.hub   # the fixtures
RUNS = Path("org--kimi", "runs")


def one_line(r, code: int, *said: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr)
    for s in said:
        assert s in lines[0], lines[0]
    return lines[0]


def run_folders(cache: str) -> list[str]:
    d = Path(cache, VIEWS, RUNS)
    return sorted(os.listdir(d)) if d.is_dir() else []


def wait_until(cond, p=None, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert p is None or p.poll() is None, p.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)


def finish(p, timeout: float = 300):
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


# ---------------------------------------------------------------------------- H1: one owner for every file

def test_h1_two_conversions_sharing_a_cache_equal_the_local_one(src, local_dst, tmp_path):
    """The second run starts once the first has fetched its first shard (not yet converted): on
    a0896fb it re-stubbed that shard in the one view both used, and the first wrote zeros."""
    cache = str(tmp_path / "cache")
    with HubServer(rate=1_500_000, lifetime=600) as hub_:
        hub_.add(REPO, src)
        a = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "a")], hub_, cache, wait=False)
        wait_until(lambda: hub_.bytes_sent.get(SHARDS[0], 0) >= os.path.getsize(os.path.join(src, SHARDS[0])), a)
        b = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "b"), "--ahead", "1"], hub_, cache, wait=False)
        ra, rb = finish(a), finish(b)
    assert ra.returncode == 0 and rb.returncode == 0, ra.stderr + rb.stderr
    assert_same_output(local_dst, str(tmp_path / "a"))
    assert_same_output(local_dst, str(tmp_path / "b"))
    # the last run that read a shard removed it; no run's folder is left
    lfs = {f.sha256 for f in hub_.repos[REPO]["main"].files.values() if f.lfs}
    assert not lfs & set(blobs(cache)) and run_folders(cache) == []


def test_h1_a_dry_run_during_a_conversion_changes_nothing_of_it(src, local_dst, tmp_path):
    cache, dst = str(tmp_path / "cache"), str(tmp_path / "dst")
    with HubServer(rate=1_500_000, lifetime=600) as hub_:
        hub_.add(REPO, src)
        a = cli(["mxfp4-to-int4", REPO, "-o", dst], hub_, cache, wait=False)
        wait_until(lambda: hub_.bytes_sent.get(SHARDS[0], 0) >= os.path.getsize(os.path.join(src, SHARDS[0])), a)
        dry = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "other"), "--dry-run"], hub_, cache)
        ra = finish(a)
    assert dry.returncode == 0 and ra.returncode == 0, dry.stderr + ra.stderr
    assert_same_output(local_dst, dst)


def test_h1_the_same_dst_twice_at_once_one_is_refused_in_one_line_or_both_finish(src, local_dst, tmp_path):
    cache, dst = str(tmp_path / "cache"), str(tmp_path / "dst")
    with HubServer(rate=1_500_000, lifetime=600) as hub_:
        hub_.add(REPO, src)
        a = cli(["mxfp4-to-int4", REPO, "-o", dst], hub_, cache, wait=False)
        wait_until(lambda: hub_.bytes_sent.get(SHARDS[0], 0) > 0, a)
        rb = cli(["mxfp4-to-int4", REPO, "-o", dst], hub_, cache)
        ra = finish(a)
    assert ra.returncode == 0, ra.stderr
    if rb.returncode != 0:
        one_line(rb, 4, "another k3convert run")
    assert_same_output(local_dst, dst)


def test_h1_a_killed_runs_folder_is_removed_by_the_next_run(src, tmp_path):
    cache = str(tmp_path / "cache")
    with HubServer(rate=400_000, lifetime=600) as hub_:
        hub_.add(REPO, src)
        a = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "a")], hub_, cache, wait=False)
        wait_until(lambda: hub_.bytes_sent.get(SHARDS[0], 0) > 200_000, a)
        dead = run_folders(cache)
        a.kill()
        a.wait()
        assert len(dead) == 1
        hub_.limiter.rate = None
        r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "a")], hub_, cache)
    assert r.returncode == 0, r.stderr
    assert run_folders(cache) == []


# ---------------------------------------------------------------------------- H2: the user's files stay

DOWNLOAD = ("import sys; from huggingface_hub import hf_hub_download\n"
            "for n in sys.argv[3:]: print(hf_hub_download(sys.argv[1], n, cache_dir=sys.argv[2]))")


def _download_all(hub_: HubServer, cache: str) -> dict[str, str]:
    """What ``hf download`` leaves: every file of the commit in the cache (name -> snapshot path)."""
    names = sorted(hub_.repos[REPO]["main"].files)
    r = subprocess.run([sys.executable, "-c", DOWNLOAD, REPO, cache, *names],
                       env={**os.environ, "HF_ENDPOINT": hub_.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dict(zip(names, r.stdout.split()))


def test_h2_a_conversion_keeps_what_the_user_downloaded(hub, local_dst, tmp_path):
    cache = str(tmp_path / "cache")
    mine = _download_all(hub, cache)
    before = {n: Path(p).read_bytes() for n, p in mine.items()}
    hub.requests.clear()
    r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "dst")], hub, cache, K3CONVERT_QUIET="0")
    assert r.returncode == 0, r.stderr
    assert_same_output(local_dst, str(tmp_path / "dst"))
    assert {n: Path(p).read_bytes() for n, p in mine.items()} == before   # every link and blob still there
    assert shard_gets(hub) == {}                                           # nothing fetched again
    assert "3 kept (not fetched by k3convert: yours)" in r.stderr, r.stderr


def test_h2_keep_source_hands_the_files_to_the_user(hub, tmp_path):
    """A kept file is the user's from then on: a later run without --keep-source leaves it."""
    cache = str(tmp_path / "cache")
    r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "a"), "--keep-source"], hub, cache)
    assert r.returncode == 0, r.stderr
    lfs = {f.sha256 for f in hub.repos[REPO]["main"].files.values() if f.lfs}
    assert lfs <= set(blobs(cache))
    r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "b")], hub, cache)
    assert r.returncode == 0, r.stderr
    assert lfs <= set(blobs(cache))


# ---------------------------------------------------------------------------- H3: the plan is the file's

def _swapped_header(path: str, out: str) -> None:
    """``path`` with expert 0's w1 and w3 of layer 1 exchanged in its header (same length, same data)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = f.read(n)
        rest = f.read()
    h = json.loads(header)
    m = "language_model.model.layers.1.block_sparse_moe.experts.0"
    for suffix in ("weight_packed", "weight_scale"):
        a, b = f"{m}.w1.{suffix}", f"{m}.w3.{suffix}"
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    new = json.dumps(h, separators=(",", ":")).encode()
    assert len(new) <= n
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", n) + new + b" " * (n - len(new)) + rest)


def test_h3_a_range_answered_differently_from_the_file_stops_the_run(hub, src, tmp_path):
    lie = str(tmp_path / "lie.safetensors")
    _swapped_header(os.path.join(src, SHARDS[0]), lie)
    assert os.path.getsize(lie) == os.path.getsize(os.path.join(src, SHARDS[0]))
    hub.range_from[SHARDS[0]] = lie
    dst = str(tmp_path / "dst")
    r = cli(["mxfp4-to-int4", REPO, "-o", dst], hub, str(tmp_path / "cache"))
    one_line(r, 2, SHARDS[0], "header differs from the one the plan was read from")
    assert not os.path.exists(os.path.join(dst, SHARDS[0]))
    assert not os.path.exists(os.path.join(dst, "k3convert_manifest.json")) or \
        not json.loads(Path(dst, "k3convert_manifest.json").read_text())["complete"]


# ---------------------------------------------------------------------------- H4: every request times out

def test_h4_a_silent_hub_is_one_line_within_the_timeout(tmp_path):
    with SilentServer() as silent:
        t = time.monotonic()
        r = cli(["inspect", REPO], None, str(tmp_path / "cache"), HF_ENDPOINT=silent.url, HF_HUB_ETAG_TIMEOUT="2",
                timeout=90)
    one_line(r, 4, "did not answer within 2 s (HF_HUB_ETAG_TIMEOUT)", REPO)
    assert time.monotonic() - t < 60


def test_h4_a_silent_header_range_is_one_line_within_the_timeout(hub, tmp_path):
    hub.silent_ranges.add(SHARDS[1])
    r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "dst"), "--dry-run"], hub, str(tmp_path / "cache"),
            HF_HUB_DOWNLOAD_TIMEOUT="2", timeout=90)
    one_line(r, 4, SHARDS[1], "did not answer within", "2 s (HF_HUB_DOWNLOAD_TIMEOUT)")


# ---------------------------------------------------------------------------- H5: a full cache disk

@pytest.fixture
def tmpfs(tmp_path):
    """A 16 MiB tmpfs (root only), unmounted afterwards."""
    with mounted_tmpfs(str(tmp_path / "tmpfs"), "16m") as mnt:
        yield mnt


def _fill(folder: str) -> None:
    with open(os.path.join(folder, "fill"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def test_h5_the_cache_disk_filling_mid_download_is_one_line_naming_it(src, tmpfs, tmp_path):
    cache = os.path.join(tmpfs, "cache")
    with HubServer(rate=300_000, lifetime=600) as hub_:
        hub_.add(REPO, src)
        p = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "dst")], hub_, cache, wait=False, small_chunks=True)
        wait_until(lambda: hub_.bytes_sent.get(SHARDS[0], 0) > 100_000, p)
        _fill(tmpfs)   # the run's preflight saw room; another program takes it
        try:
            r = finish(p, timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail("the run hung on a full cache disk")
    one_line(r, 4, f"file {cache}", "no space left on the disk holding it")
    assert "cannot reach the Hub" not in r.stderr


def test_h5_a_fetcher_that_stops_without_writing_its_error_never_reads_as_no_error_yet(tmp_path):
    """The error file could not be written (a full disk): the fetcher's lock, let go, says it."""
    shard = str(tmp_path / "view" / "model.safetensors")
    os.makedirs(os.path.dirname(shard))
    pending = fetch_wait.Pending(os.path.dirname(shard))
    pending.mark(shard)
    pending.done()   # stopped, its error unwritten
    t = time.monotonic()
    with pytest.raises(Exception, match="download stopped and the reason could not be written"):
        fetch_wait.wait([shard])
    assert time.monotonic() - t < 5


# ---------------------------------------------------------------------------- H11: an absurd listed size

def test_h11_a_listed_size_of_4_eib_is_one_line(hub, tmp_path):
    hub.listed_size[SHARDS[1]] = 4 << 60
    r = cli(["inspect", REPO], hub, str(tmp_path / "cache"))
    one_line(r, 2, SHARDS[1], "more than any file this tool reads")


# ---------------------------------------------------------------------------- H13, H14: caches

def test_h13_verify_source_reads_the_given_cache(hub, tmp_path):
    cache = str(tmp_path / "big")
    r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "dst"), "--keep-source", "--cache-dir", cache], hub,
            str(tmp_path / "default"))
    assert r.returncode == 0, r.stderr
    before = len(hub.requests)
    commit = hub.repos[REPO]["main"].sha
    r = cli(["verify", str(tmp_path / "dst"), "--source", f"{REPO}@{commit}", "--cache-dir", cache], hub,
            str(tmp_path / "default"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS  source" in r.stdout
    assert not [p for m, p, g in hub.requests[before:] if m == "GET" and p.endswith(".safetensors")]
    assert not os.path.exists(tmp_path / "default" / "models--org--kimi")


def test_h14_job_parts_with_different_cache_dirs_are_one_conversion(hub, local_dst, tmp_path):
    dst = str(tmp_path / "dst")
    r = cli(["mxfp4-to-int4", REPO, "-o", dst, "--part", "1/2", "--cache-dir", str(tmp_path / "c1")], hub)
    assert r.returncode == 0, r.stderr
    r = cli(["mxfp4-to-int4", REPO, "-o", dst, "--part", "2/2", "--cache-dir", str(tmp_path / "c2")], hub)
    assert r.returncode == 0, r.stderr
    assert_same_output(local_dst, dst)
    run = json.loads(Path(dst, STATE, "run.json").read_text())
    assert run["source"] == f"{REPO}@{hub.repos[REPO]['main'].sha}"


def test_finalize_of_an_unfinished_hub_dst_names_the_command_that_finishes_it(hub, tmp_path):
    dst = str(tmp_path / "dst")
    r = cli(["mxfp4-to-int4", REPO, "-o", dst, "--part", "1/2"], hub, str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    r = cli(["finalize", dst], hub, str(tmp_path / "cache"))
    one_line(r, 4, f"k3convert mxfp4-to-int4 {REPO}@{hub.repos[REPO]['main'].sha} -o {dst}")


# ---------------------------------------------------------------------------- the dry run's plan

@pytest.mark.parametrize("where", ["local", "hub"])
def test_dry_run_without_room_shows_the_plan_then_the_refusal(where, hub, src, tmpfs):
    _fill(tmpfs)
    arg = src if where == "local" else REPO
    r = cli(["mxfp4-to-int4", arg, "-o", os.path.join(tmpfs, "dst"), "--dry-run"], hub,
            os.path.join(os.path.dirname(tmpfs), "cache"))
    one_line(r, 4, "needs", "free")
    for key in ("shards_todo", "experts", "workers", "bytes_out"):
        assert f"{key}:" in r.stdout, r.stdout


# ---------------------------------------------------------------------------- a hostile listed SHA-256

HOSTILE = "../../../../victim"   # from the views' fetched/ folder and the blobs folder: up to tmp_path


def test_a_listed_sha256_that_is_a_path_is_one_line_and_touches_nothing_outside_the_cache(hub, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("the user's")
    hub.listed_sha256[SHARDS[0]] = HOSTILE
    cache, dst = str(tmp_path / "cache"), str(tmp_path / "dst")
    r = cli(["mxfp4-to-int4", REPO, "-o", dst], hub, cache)
    one_line(r, 2, SHARDS[0], "malformed SHA-256")
    assert victim.read_text() == "the user's"
    assert set(os.listdir(tmp_path)) <= {"victim", "cache", "dst"}
    assert not os.path.exists(dst) or not os.listdir(dst)   # no output begun
    assert shard_gets(hub) == {}   # refused before any shard is fetched


@pytest.mark.parametrize("step", ["before_fetch", "release", "discard_bad"])
def test_owners_refuse_a_sha256_that_is_a_path(step, tmp_path):
    from converter.errors import BadInput
    from converter.hub.owners import RunSpace
    victim = tmp_path / "victim"
    victim.write_text("the user's")
    space = RunSpace(str(tmp_path / "cache"), "org/kimi")
    try:
        call = {"before_fetch": lambda: space.before_fetch(HOSTILE, 10),
                "release": lambda: space.release(HOSTILE, [], keep=False),
                "discard_bad": lambda: space.discard_bad(HOSTILE, [])}[step]
        with pytest.raises(BadInput, match="malformed SHA-256"):
            call()
    finally:
        space.close()
    assert victim.read_text() == "the user's"
    assert sorted(os.listdir(tmp_path)) == ["cache", "victim"]


def test_a_full_disk_when_rewriting_needs_json_still_removes_the_blob(tmp_path, monkeypatch):
    import errno

    from converter.hub.owners import Fate, RunSpace
    space = RunSpace(str(tmp_path / "cache"), "org/kimi")
    sha = "ab" * 32
    try:
        space.claim({sha})
        assert space.before_fetch(sha, 3) is False      # marked k3convert's
        os.makedirs(space.blobs, exist_ok=True)
        Path(space.blobs, sha).write_bytes(b"abc")

        def full(*a):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(space, "_write_needs", full)
        assert space.release(sha, [], keep=False) is Fate.REMOVED
        assert not os.path.exists(os.path.join(space.blobs, sha))
    finally:
        space.close()
