"""Running k3convert against the local Hub (``hub_server.HubServer``) as real processes, and comparing two
DSTs of the same bytes: shared by the Hub tests and ``scripts/tools/hub_side_by_side.py``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hub_server import HubServer

REPO_ROOT = Path(__file__).resolve().parents[2]   # the checkout
REPO = "org/kimi"
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
STATE = ".k3convert"
# what differs between two conversions of the same bytes: where the source was, when, how fast
VOLATILE = {"mtime_ns", "seconds", "stages", "finished_at"}


# huggingface_hub writes a download to its .incomplete file in chunks of DOWNLOAD_CHUNK_SIZE (10 MB): the
# tests that cut a download of these few-MB shards short make the chunks small, so what arrived is on disk
SMALL_CHUNKS = ("import sys, huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 1 << 16; "
                "from converter.cli import main; sys.argv[0] = 'k3convert'; main()")


def cli(args: list[str], server: HubServer | None = None, cache: str | None = None, wait: bool = True,
        small_chunks: bool = False, timeout: float = 300, **env):
    e = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "K3CONVERT_WORKERS": "1", "K3CONVERT_QUIET": "1",
         "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    e.pop("HF_HUB_OFFLINE", None)
    if server is not None:
        e["HF_ENDPOINT"] = server.url
    if cache is not None:
        e["HF_HUB_CACHE"] = cache
    cmd = [sys.executable, *(["-c", SMALL_CHUNKS] if small_chunks else ["-m", "converter"]), *args]
    if not wait:
        return subprocess.Popen(cmd, env=e, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=e, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in VOLATILE}
    return x


def _comparable(dst: str, name: str):
    """A file of DST as compared: bytes, or for our JSON records, without paths, times and the source's identity."""
    data = Path(dst, name).read_bytes()
    if name == "k3convert_report.json":
        return _strip({k: v for k, v in json.loads(data).items() if k != "source"})
    if name == "k3convert_manifest.json":
        m = _strip(json.loads(data))
        m["source"] = {k: v for k, v in m["source"].items() if k not in ("path", "shards")}
        m["files"].pop("k3convert_report.json")  # its digest covers the source path
        return m
    return data


def assert_same_output(a: str, b: str) -> None:
    """Every file of DST (the state folder aside) identical, the manifest and report but for paths and times."""
    def files(d: str) -> list[str]:
        return sorted(str(p.relative_to(d)) for p in Path(d).rglob("*")
                      if p.is_file() and STATE not in p.relative_to(d).parts)

    assert files(a) == files(b)
    for name in files(a):
        assert _comparable(a, name) == _comparable(b, name), name


def shard_gets(server: HubServer) -> dict[str, list[str | None]]:
    """Per shard, the Range of each GET of its data (None: the whole file); header reads excluded."""
    out: dict[str, list[str | None]] = {}
    for m, p, r in server.requests:
        if m == "GET" and "/resolve/" in p and p.endswith(".safetensors") and (r is None or r.endswith("-")):
            out.setdefault(p.rsplit("/", 1)[1], []).append(r)
    return out


def blobs(cache: str) -> list[str]:
    d = Path(cache, "models--org--kimi", "blobs")
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []
