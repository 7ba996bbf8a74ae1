"""DST's records as bytes: JSON (read with bounded numbers), zstd JSON lines for the figure tables,
and the cheap fingerprint of a source file."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import zstandard

from ..errors import OutputError
from ..formats import json_input
from ..safepath import open_regular
from .atomic import atomic_write


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()


def write_json(path: str, obj: Any) -> None:
    atomic_write(path, json_bytes(obj))


def read_json(path: str) -> dict | None:
    """A DST JSON file (numbers bounded: formats.json_input; Infinity as our writer spells it), None
    when absent."""
    try:
        return json_input.load_file(path, constants=True)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise OutputError("is corrupt: remove it, or run with --overwrite", file=path) from None


def file_fingerprint(path: str, edge: int = 1 << 20) -> dict[str, Any]:
    """Cheap identity of a source file: size, mtime, and a hash of its first and last MiB."""
    h = hashlib.blake2b(digest_size=16)
    fd = open_regular(path)  # a FIFO is refused, not waited on
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            h.update(f.read(edge))
            if st.st_size > edge:
                f.seek(max(edge, st.st_size - edge))
                h.update(f.read(edge))
    except OSError as e:  # EIO: one line naming the file (exit 4), not a traceback
        raise OutputError(f"cannot read: {e.strerror}", file=path) from None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "edge_blake2b": h.hexdigest()}


def rows_bytes(rows: list[dict]) -> bytes:
    """A figure table as zstd-compressed JSON lines: ~10x smaller for 250k tensors."""
    raw = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
    return zstandard.ZstdCompressor(level=9).compress(raw)


def write_rows(path: str, rows: list[dict]) -> None:
    atomic_write(path, rows_bytes(rows))


def read_rows(path: str) -> list[dict]:
    with open(path, "rb") as f:
        raw = zstandard.ZstdDecompressor().decompress(f.read())
    return [json.loads(line) for line in raw.splitlines() if line]
