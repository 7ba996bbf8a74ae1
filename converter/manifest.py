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

MANIFEST = "k3convert_manifest.json"
STATE_DIR = ".k3convert"  # per-shard figure tables and the lock, inside DST


def atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
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


def sha256_file(path: str, block: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def write_rows(path: str, rows: list[dict]) -> None:
    """A figure table as zstd-compressed JSON lines: ~10x smaller for 250k tensors."""
    raw = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
    atomic_write(path, zstandard.ZstdCompressor(level=9).compress(raw))


def read_rows(path: str) -> list[dict]:
    with open(path, "rb") as f:
        raw = zstandard.ZstdDecompressor().decompress(f.read())
    return [json.loads(line) for line in raw.splitlines() if line]


class Lock:
    """An exclusive lock on DST: a second run on the same DST is refused, not interleaved."""

    def __init__(self, dst: str):
        os.makedirs(os.path.join(dst, STATE_DIR), exist_ok=True)
        self.path = os.path.join(dst, STATE_DIR, "lock")
        self._f = open(self.path, "a+")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise OutputError("another k3convert run holds this output directory", file=dst) from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(f"{os.getpid()}\n")
        self._f.flush()

    def release(self) -> None:
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
