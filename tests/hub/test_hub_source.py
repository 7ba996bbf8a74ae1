"""SRC as a Hub repo id (issue 34): parsed at the edge, looked at without fetching a shard, converted
while downloading, against a local Hub (tests/support/hub_server.py, loopback only) that huggingface_hub
reaches through HF_ENDPOINT. The conversions run as real processes (``python -m converter``), so a
kill -9 is a real one; every Hub output is compared with the local conversion of the same files."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from hub_runs import REPO, SHARDS, STATE, assert_same_output, blobs, cli, shard_gets
from hub_server import HubServer

from converter.errors import BadInput
from converter.fixture import FixtureSpec, make_fixture
from converter.hub.remote import FIRST_RANGE
from converter.hub.source import HubSource, parse_source


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("hub") / "kimi")
    make_fixture(d, FixtureSpec(layers=3, experts=4, shards=3, seed=7))
    assert sorted(n for n in os.listdir(d) if n.endswith(".safetensors")) == SHARDS
    return d


@pytest.fixture(scope="module")
def local_dst(src, tmp_path_factory) -> str:
    """The local conversion of the same files: what every Hub conversion must equal."""
    dst = str(tmp_path_factory.mktemp("local") / "out")
    r = cli(["mxfp4-to-int4", src, "-o", dst])
    assert r.returncode == 0, r.stderr
    return dst


@pytest.fixture
def hub(src):
    with HubServer(lifetime=600) as s:
        s.add(REPO, src)
        yield s


# ---------------------------------------------------------------------------- 1. the edge

def test_parse_source_local_path_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_source("org/name") == "org/name"          # a folder of that name: local
    assert parse_source("org/other") == HubSource("org/other")
    assert parse_source("moonshotai/Kimi-K3@main") == HubSource("moonshotai/Kimi-K3", "main")
    c = "a" * 40
    assert parse_source(f"o/n@{c}").pinned and not parse_source("o/n@main").pinned


@pytest.mark.parametrize("bad, said", [
    ("org/na..me", "nor a Hub repo id"), ("org/-name", "nor a Hub repo id"), ("org--x/name", "nor a Hub repo id"),
    ("a/b/c", "nor a Hub repo id"), ("org/name@", "'' is not a revision"), ("org/name@-rf", "is not a revision"),
    ("org/name@a..b", "is not a revision"), ("org/" + "n" * 97, "nor a Hub repo id"),
])
def test_bad_repo_ids_one_line(bad, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput, match=said):
        parse_source(bad)
    if bad.count("/") == 1:   # read as a repo id at the command line: one line, exit 2, nothing fetched
        r = cli(["inspect", bad], HF_ENDPOINT="http://127.0.0.1:9")
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_unknown_repo_revision_and_gated_one_line(hub, tmp_path):
    hub.gated.add("org/gated")
    hub.repos["org/gated"] = hub.repos[REPO]
    for arg, said in (("org/missing", "no such repository"), (f"{REPO}@nobranch", "no such revision"),
                      ("org/gated", "gated repository")):
        r = cli(["inspect", arg], hub, str(tmp_path / "cache"))
        assert r.returncode == 2, r.stderr
        assert said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_hub_out_of_reach_one_line(tmp_path):
    r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "dst"), "--dry-run"], HF_ENDPOINT="http://127.0.0.1:9")
    assert r.returncode == 4 and "cannot reach the Hub" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "dst")


# ---------------------------------------------------------------------------- 2. look before you fetch

def test_inspect_and_dry_run_fetch_no_shard(hub, src, local_dst, tmp_path):
    cache = str(tmp_path / "cache")
    r = cli(["inspect", REPO, "--json"], hub, cache)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    local = json.loads(cli(["inspect", src, "--json"]).stdout)
    commit = hub.repos[REPO]["main"].sha
    assert info["path"] == f"{REPO}@{commit}" and info["hub"]["commit"] == commit
    for key in ("format", "shard_count", "tensors", "quantized_modules", "dtypes", "bytes", "situ", "plan"):
        assert info[key] == local[key], key
    assert info["profile"]["name"] == local["profile"]["name"]

    r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "dst"), "--dry-run", "--progress", "json"], hub, cache)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["source"] == f"{REPO}@{commit}" and plan["shards_todo"] == 3
    assert plan["bytes_out"] == sum(os.path.getsize(os.path.join(local_dst, s)) for s in SHARDS)
    assert plan["bytes_in"] == sum(os.path.getsize(os.path.join(src, s)) for s in SHARDS)
    assert plan["staging_peak_bytes"] > 0 and not os.path.exists(tmp_path / "dst")
    # the headers were read by range requests; no shard was downloaded, nothing of one is in the cache
    assert shard_gets(hub) == {}
    ranged = [r for m, p, r in hub.requests if p.endswith(".safetensors")]
    assert ranged and all(r and not r.endswith("-") for r in ranged)
    assert sum(hub.bytes_sent.get(s, 0) for s in SHARDS) <= FIRST_RANGE * len(ranged)  # the first 100 kB at most


# ---------------------------------------------------------------------------- 3. convert while downloading

def test_convert_from_hub_equals_local(hub, local_dst, tmp_path):
    cache, dst = str(tmp_path / "cache"), str(tmp_path / "dst")
    r = cli(["mxfp4-to-int4", REPO, "-o", dst, "--ahead", "2"], hub, cache)
    assert r.returncode == 0, r.stderr
    assert_same_output(local_dst, dst)
    assert {s: len(g) for s, g in shard_gets(hub).items()} == {s: 1 for s in SHARDS}  # each fetched once
    # converted source shards are gone from the staging area (only the small files stay in the cache)
    lfs = {f.sha256 for n, f in hub.repos[REPO]["main"].files.items() if f.lfs}
    assert not lfs & set(blobs(cache))
    run = json.loads(Path(dst, STATE, "run.json").read_text())
    commit = hub.repos[REPO]["main"].sha
    assert {n: (i["hub"], i["commit"], i["sha256"]) for n, i in run["shards"].items()} == \
        {n: (REPO, commit, hub.repos[REPO]["main"].files[n].sha256) for n in SHARDS}
    # a rerun: nothing to fetch, nothing to convert
    before = len(hub.requests)
    r = cli(["mxfp4-to-int4", REPO, "-o", dst], hub, cache)
    assert r.returncode == 0, r.stderr
    assert not [p for m, p, rg in hub.requests[before:]
                if p.endswith(".safetensors") and (rg is None or rg.endswith("-"))]
    assert_same_output(local_dst, dst)


def test_refused_dst_fetches_no_shard(hub, tmp_path):
    dst = tmp_path / "someone-elses"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    r = cli(["mxfp4-to-int4", REPO, "-o", str(dst)], hub, str(tmp_path / "cache"))
    assert r.returncode == 4 and "holds no k3convert state" in r.stderr, r.stderr
    assert shard_gets(hub) == {} and sorted(os.listdir(dst)) == ["notes.txt"]


def test_keep_source_leaves_the_hf_cache_layout(hub, src, tmp_path):
    cache = str(tmp_path / "cache")
    r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "dst"), "--keep-source", "--cache-dir", cache], hub)
    assert r.returncode == 0, r.stderr
    commit = hub.repos[REPO]["main"].sha
    snap = Path(cache, "models--org--kimi", "snapshots", commit)
    for s in SHARDS:
        assert Path(snap, s).read_bytes() == Path(src, s).read_bytes()
    # verify --source ORG/NAME@COMMIT: the kept cache, nothing fetched again; each shard's SHA-256 checked
    before = len(hub.requests)
    r = cli(["verify", str(tmp_path / "dst"), "--source", f"{REPO}@{commit}"], hub, cache)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS  source" in r.stdout and "PASS  re-decode" in r.stdout
    assert not [p for m, p, g in hub.requests[before:] if m == "GET" and p.endswith(".safetensors")]
    # without the cache: re-fetched
    r = cli(["verify", str(tmp_path / "dst"), "--source", f"{REPO}@{commit}"], hub, str(tmp_path / "fresh"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len([p for m, p, g in hub.requests[before:] if m == "GET" and p.endswith(".safetensors")]) == 3
    # a kept shard changed since: named
    blob = Path(snap, SHARDS[2]).resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    r = cli(["verify", str(tmp_path / "dst"), "--source", f"{REPO}@{commit}"], hub, cache)
    assert r.returncode == 5 and f"{SHARDS[2]}: differs from the file converted ({REPO}@{commit}: SHA-256)" in r.stdout


def test_sha256_mismatch_is_one_line_and_converts_nothing_of_it(hub, tmp_path):
    cache, dst = str(tmp_path / "cache"), str(tmp_path / "dst")
    hub.corrupt.add(SHARDS[0])
    r = cli(["mxfp4-to-int4", REPO, "-o", dst], hub, cache)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "SHA-256" in lines[0] and SHARDS[0] in lines[0] and "not converted" in lines[0], r.stderr
    assert not os.path.exists(os.path.join(dst, SHARDS[0]))
    assert not os.path.exists(os.path.join(dst, STATE, SHARDS[0] + ".done.json"))
    assert hub.repos[REPO]["main"].files[SHARDS[0]].sha256 not in blobs(cache)  # the bad download is not kept


def test_dropped_connection_mid_shard_resumes(hub, local_dst, tmp_path):
    cache, dst = str(tmp_path / "cache"), str(tmp_path / "dst")
    hub.drop_after[SHARDS[0]] = 300_000
    r = cli(["mxfp4-to-int4", REPO, "-o", dst], hub, cache, small_chunks=True)
    assert r.returncode == 0, r.stderr
    gets = shard_gets(hub)[SHARDS[0]]
    assert gets[0] is None and any(g and g.startswith("bytes=") and g != "bytes=0-" for g in gets[1:]), gets
    assert_same_output(local_dst, dst)


def test_kill_9_mid_download_then_resume_fetches_only_what_is_missing(src, local_dst, tmp_path):
    cache, dst = str(tmp_path / "cache"), str(tmp_path / "dst")
    with HubServer(rate=400_000, lifetime=600) as hub:
        hub.add(REPO, src)
        p = cli(["mxfp4-to-int4", REPO, "-o", dst], hub, cache, wait=False, small_chunks=True)
        deadline = time.monotonic() + 120
        # the second shard is being downloaded (the first is fully in the cache: shard 2 reads its scales)
        while hub.bytes_sent.get(SHARDS[1], 0) < 200_000:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
        p.wait()
        sent = hub.bytes_sent.get(SHARDS[1], 0)
        assert sent < os.path.getsize(os.path.join(src, SHARDS[1]))
        assert not os.path.exists(os.path.join(dst, "k3convert_manifest.json")) or \
            not json.loads(Path(dst, "k3convert_manifest.json").read_text())["complete"]
        hub.limiter.rate = None
        before = len(hub.requests)
        r = cli(["mxfp4-to-int4", REPO, "-o", dst], hub, cache)
        assert r.returncode == 0, r.stderr
        second = HubServer()
        second.requests = hub.requests[before:]
        gets = shard_gets(second)
    assert SHARDS[0] not in gets                          # fully fetched before the kill: not again
    # the shard in flight is fetched again, once, from its start: huggingface_hub 2.x resumes a dropped
    # connection within a process (test_dropped_connection_mid_shard_resumes), not a killed process's file
    assert gets[SHARDS[1]] == [None] and gets[SHARDS[2]] == [None]
    assert not [p for p in Path(cache).rglob("*.incomplete")]   # what the killed run left is removed
    assert_same_output(local_dst, dst)


def test_moved_revision_is_refused_and_the_pinned_commit_finishes(hub, src, local_dst, tmp_path):
    cache, dst = str(tmp_path / "cache"), str(tmp_path / "dst")
    r = cli(["mxfp4-to-int4", REPO, "-o", dst, "--shards", "3"], hub, cache)
    assert r.returncode == 0, r.stderr
    first = hub.repos[REPO]["main"].sha
    moved = tmp_path / "moved"
    shutil.copytree(src, moved)
    (moved / "generation_config.json").write_text('{"temperature": 0.5}\n')
    hub.add(REPO, str(moved))                       # main moves on
    assert hub.repos[REPO]["main"].sha != first
    r = cli(["mxfp4-to-int4", REPO, "-o", dst], hub, cache)
    assert r.returncode == 4, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{REPO}@{first}" in lines[0] and hub.repos[REPO]["main"].sha in lines[0], r.stderr
    r = cli(["mxfp4-to-int4", f"{REPO}@{first}", "-o", dst], hub, cache)
    assert r.returncode == 0, r.stderr
    assert_same_output(local_dst, dst)


def test_job_array_parts_fetch_only_their_shards(hub, src, local_dst, tmp_path):
    cache, dst = str(tmp_path / "cache"), str(tmp_path / "dst")
    r = cli(["mxfp4-to-int4", REPO, "-o", dst, "--part", "1/2"], hub, cache)   # shards 1 and 3
    assert r.returncode == 0, r.stderr
    assert sorted(shard_gets(hub)) == [SHARDS[0], SHARDS[2]]
    assert not os.path.exists(os.path.join(dst, SHARDS[1]))
    r = cli(["mxfp4-to-int4", REPO, "-o", dst, "--part", "2/2"], hub, cache)   # shard 2, with its partners
    assert r.returncode == 0, r.stderr
    assert_same_output(local_dst, dst)


@pytest.mark.parametrize("ahead", [1, 2])
def test_staging_holds_at_most_ahead_shards(ahead, tmp_path):
    """Shards cut between modules (no partner reads): never more than ``ahead`` source shards on disk."""
    src = str(tmp_path / "kept")
    make_fixture(src, FixtureSpec(layers=5, experts=4, shards=4, seed=3, keep_modules=True))
    sizes = sorted((os.path.getsize(os.path.join(src, n)) for n in os.listdir(src) if n.endswith(".safetensors")),
                   reverse=True)
    with HubServer(lifetime=600) as hub:
        hub.add(REPO, src)
        dry = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "dst"), "--ahead", str(ahead), "--progress", "json",
                   "--dry-run"], hub, str(tmp_path / "cache"))
        r = cli(["mxfp4-to-int4", REPO, "-o", str(tmp_path / "dst"), "--ahead", str(ahead), "--progress", "json"],
                hub, str(tmp_path / "cache"))
    assert dry.returncode == 0 and r.returncode == 0, dry.stderr + r.stderr
    assert json.loads(dry.stdout)["staging_peak_bytes"] == sum(sizes[:ahead])   # what the preflight reserves
    events = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
    staged = [e["staged_bytes"] for e in events if e["event"] == "fetched"]
    assert len(staged) == 4
    assert max(staged) <= sum(sizes[:ahead])
    if ahead == 1:
        assert max(staged) == sizes[0]      # one at a time: each removed once converted
    assert any(e["event"] == "finished" and e["complete"] for e in events)


def test_job_file_src_may_be_a_repo_id(hub, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'src = "{REPO}"\noutput = "out"\n')
    r = cli(["mxfp4-to-int4", "--config", str(job), "--dry-run", "--progress", "json"], hub, str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["source"].startswith(f"{REPO}@") and info["dst"] == str(tmp_path / "out")
    assert shard_gets(hub) == {}
