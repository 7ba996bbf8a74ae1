"""Convert while downloading, measured (issue 34): against the local Hub of the tests
(tests/support/hub_server.py, 127.0.0.1, its bandwidth limited), the wall time of

  download alone    every shard fetched with hf_hub_download, one after another (what `hf download` does)
  conversion alone  `k3convert mxfp4-to-int4 LOCAL_SRC` of the same files, already on disk
  both overlapped   `k3convert mxfp4-to-int4 ORG/NAME`: fetched --ahead shards ahead and converted as they arrive

and the peak bytes the staging area (the cache folder) held during the overlapped run, sampled every
20 ms (blocks on disk) and as the run reports it. The goal: overlapped within one shard's download of
max(download alone, conversion alone).

    python scripts/benchmarks/bench_hub.py --experts 16 --layers 6 --shards 6 --rate 5e5 [--keep-modules]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from hub_server import HubServer  # noqa: E402

REPO = "bench/kimi"


def _disk_bytes(folder: str) -> int:
    total = 0
    for d, _, files in os.walk(folder):
        if ".k3convert-views" in d:
            continue   # headers only, sparse
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _env(server: HubServer, cache: str) -> dict:
    return {**os.environ, "HF_ENDPOINT": server.url, "HF_HUB_CACHE": cache, "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "K3CONVERT_QUIET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--rate", type=float, default=4e6, help="the server's bandwidth, bytes/s")
    ap.add_argument("--ahead", type=int, default=2)
    ap.add_argument("--workers", default="1")
    ap.add_argument("--keep-modules", action="store_true", help="cut shards between modules: no partner shards")
    ap.add_argument("--dir", default=None, help="work folder [default: a temporary one]")
    args = ap.parse_args()

    from converter.fixture import FixtureSpec, make_fixture
    from converter.hub.remote import Snapshot, download, resolve  # noqa: F401
    work = args.dir or tempfile.mkdtemp(prefix="k3-bench-hub-")
    src = os.path.join(work, "src")
    if not os.path.isdir(src):
        make_fixture(src, FixtureSpec(layers=args.layers, experts=args.experts, shards=args.shards, seed=5,
                                      keep_modules=args.keep_modules))
    shards = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    sizes = [os.path.getsize(os.path.join(src, n)) for n in shards]
    out: dict = {"machine": f"{platform.node()} {os.cpu_count()} cores",
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "shards": len(shards), "source_bytes": sum(sizes), "largest_shard_bytes": max(sizes),
                 "rate_bytes_per_s": args.rate, "ahead": args.ahead}

    with HubServer(rate=args.rate, lifetime=3600) as server:
        server.add(REPO, src)
        for old in ("cache-download", "cache-overlap", "dst-local", "dst-hub"):   # every figure from nothing
            shutil.rmtree(os.path.join(work, old), ignore_errors=True)
        # download alone: huggingface_hub's own download of every shard, one after another
        cache = os.path.join(work, "cache-download")
        os.environ["HF_ENDPOINT"] = server.url
        from converter.hub.source import HubSource
        snap = resolve(HubSource(REPO))
        t = time.perf_counter()
        for n in shards:
            download(snap, n, cache)
        out["download_alone_s"] = round(time.perf_counter() - t, 2)

        # conversion alone: the same files, local
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "converter", "mxfp4-to-int4", src,
                            "-o", os.path.join(work, "dst-local"),
                            "--workers", args.workers], env=_env(server, cache), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        out["conversion_alone_s"] = round(time.perf_counter() - t, 2)

        # both overlapped
        cache = os.path.join(work, "cache-overlap")
        peak = [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _disk_bytes(cache))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t, t_wall = time.perf_counter(), time.time()
        r = subprocess.run([sys.executable, "-m", "converter", "mxfp4-to-int4", REPO,
                            "-o", os.path.join(work, "dst-hub"),
                            "--workers", args.workers, "--ahead", str(args.ahead), "--progress", "json"],
                           env=_env(server, cache), capture_output=True, text=True)
        out["overlapped_s"] = round(time.perf_counter() - t, 2)
        stop.set()
        sampler.join()
        assert r.returncode == 0, r.stderr
        events = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
        out["peak_staging_bytes_sampled"] = peak[0]
        out["peak_staging_bytes_reported"] = max(e.get("staged_bytes", 0) for e in events if e["event"] == "fetched")
        at = lambda kind, pick: round(pick(e["time"] for e in events if e["event"] == kind) - t_wall, 2)  # noqa: E731
        out["timeline_s"] = {"first_fetch": at("fetch", min), "last_fetched": at("fetched", max),
                             "first_shard_start": at("start", min), "last_done": at("done", max),
                             "finished": at("finished", max)}
        out["header_bytes_read"] = sum(int(r[6:].split("-")[1]) - int(r[6:].split("-")[0]) + 1
                                       for m, p, r in server.requests if r and not r.endswith("-"))
    out["one_shard_download_s"] = round(max(sizes) / args.rate, 2)
    out["goal_s"] = round(max(out["download_alone_s"], out["conversion_alone_s"]) + out["one_shard_download_s"], 2)
    out["sequential_s"] = round(out["download_alone_s"] + out["conversion_alone_s"], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
