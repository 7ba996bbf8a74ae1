"""The conversion manifest and the files beside it: what makes a DST complete and resumable.

Every file here is replaced atomically (write, fsync, rename), so a kill at any moment
leaves either the old or the new version. DST is complete exactly when the manifest says
``complete: true``, and that is written last.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from typing import Any

import zstandard

from .errors import OutputError
from .safepath import fresh_file, lock_file

MANIFEST = "k3convert_manifest.json"
REPORT = "k3convert_report.json"            # per-layer error summary, written by finalize
TENSOR_TABLE = "k3convert_tensors.jsonl.zst"  # every converted tensor's figures
STATE_DIR = ".k3convert"  # per-shard figure tables and the lock, inside DST


def atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with os.fdopen(fresh_file(tmp), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: str, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OutputError("is corrupt: remove it, or run with --overwrite", file=path) from None


def file_fingerprint(path: str, edge: int = 1 << 20) -> dict[str, Any]:
    """Cheap identity of a source file: size, mtime, and a hash of its first and last MiB."""
    st = os.stat(path)
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(edge))
        if st.st_size > edge:
            f.seek(max(edge, st.st_size - edge))
            h.update(f.read(edge))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "edge_blake2b": h.hexdigest()}


def write_rows(path: str, rows: list[dict]) -> None:
    """A figure table as zstd-compressed JSON lines: ~10x smaller for 250k tensors."""
    raw = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
    atomic_write(path, zstandard.ZstdCompressor(level=9).compress(raw))


def read_rows(path: str) -> list[dict]:
    with open(path, "rb") as f:
        raw = zstandard.ZstdDecompressor().decompress(f.read())
    return [json.loads(line) for line in raw.splitlines() if line]


class ShardLocks:
    """Exclusive flocks on the shards a run converts, in DST's state folder.

    A second run that wants any of them is refused at once; runs on disjoint shards (job
    array parts) share a DST. The kernel drops a flock when its holder dies, kill -9 too.
    """

    def __init__(self, dst: str, names: list[str]):
        self.files = []
        try:
            for n in names:
                f = lock_file(os.path.join(dst, STATE_DIR, n + ".lock"))
                self.files.append(f)
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise OutputError("another k3convert run is converting it", file=os.path.join(dst, n)) from None
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for f in self.files:
            f.close()  # closing drops the flock
        self.files = []
