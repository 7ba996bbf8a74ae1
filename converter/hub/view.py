"""A Hub commit as a local checkpoint directory before its shards are fetched: the view.

config.json, the index and the side files are real files; each shard is a sparse file of the
shard's size that holds only its real header (fetched by a range request), so it takes a few
kB of disk. Every local reader (the preflight's ``build_plan``, ``inspect``, the dry run) reads
the view as it reads any checkpoint: one implementation of "config, index, header of shard X",
no branch per source. A shard is fetched into the view (``place``) before it is converted, and
put back to its header-only stub (``restore``) once converted; byte offsets are the file's own,
so the plan built from the view holds for the fetched file.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

from ..errors import BadInput
from ..formats import checkpoint as ckpt
from ..state.atomic import discard
from . import remote as remote
from .owners import io_error

SIDE_LIMIT = 64 << 20   # a side file larger than this is a sized stub when only looking (inspect, --dry-run)


def _inside(root: str, name: str, where: str) -> str:
    """A repo file's path in the view; names from the Hub are untrusted."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or not name.isprintable() \
            or "\\" in name:
        raise BadInput(f"a file name the view cannot hold: {name!r}", file=where)
    return os.path.join(root, *parts)


def _hidden(name: str) -> bool:
    return any(p.startswith(".") for p in name.split("/"))  # .gitattributes, .cache: never read


@dataclass
class View:
    root: str
    snap: remote.Snapshot
    shards: list[str]                     # the index's shard names, sorted
    headers: dict[str, bytes] = field(default_factory=dict)

    def path(self, name: str) -> str:
        return _inside(self.root, name, self.snap.label)

    def stub(self, name: str) -> None:
        """The shard as its header-only sparse stub (also: a converted shard's source, removed)."""
        write_stub(self.path(name), self.headers.get(name, b""), self.snap.files[name].size)

    def check_header(self, name: str, fetched: str) -> None:
        """Refuse a fetched shard whose header is not the one the plan was built from (the range
        requests'): its offsets, dtypes and names are what the conversion follows."""
        want = self.headers[name]
        with open(fetched, "rb") as f:
            got = f.read(len(want))
        if got != want:
            raise BadInput("the downloaded file's header differs from the one the plan was read from (the Hub's "
                           "answer to a range request): not converted; run again to read it anew",
                           file=f"{self.snap.label}/{name}")

    def place(self, name: str, fetched: str) -> None:
        """Put a fetched, checked file in the view (a hard link to it where possible, else a copy)."""
        _linked(fetched, self.path(name))


def write_stub(path: str, header: bytes, size: int) -> None:
    tmp = path + ".k3stub"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(header)
            f.truncate(size)   # a hole: no blocks on disk
        os.replace(tmp, path)
    except OSError as e:
        discard(tmp)   # never raises: the first error is the one told
        raise io_error(e, path, f"writing a {size:,}-byte sparse stub") from None


def _fetch_small(snap: remote.Snapshot, name: str, cache_dir: str, dest: str, token: str | None) -> None:
    got = remote.download(snap, name, cache_dir, token)
    remote.check(snap, name, got)
    _linked(got, dest)


def _linked(fetched: str, dest: str) -> None:
    """A file of the cache at ``dest`` in the view: a hard link to its blob where possible, else a copy."""
    tmp = dest + ".k3fetch"
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        try:
            os.link(os.path.realpath(fetched), tmp)
        except OSError:
            shutil.copyfile(fetched, tmp)
        os.replace(tmp, dest)
    except OSError as e:
        discard(tmp)   # never raises: the first error is the one told
        raise io_error(e, dest, "putting a downloaded file in the view") from None


def shard_names(snap: remote.Snapshot, index_path: str | None) -> list[str]:
    """The shards the index names (or the single model.safetensors); the index is untrusted."""
    if index_path is None:
        if ckpt.SINGLE in snap.files:
            return [ckpt.SINGLE]
        raise BadInput(f"neither {ckpt.INDEX} nor {ckpt.SINGLE} in the repository", file=snap.label)
    wm = ckpt.load_json(index_path).get("weight_map")
    if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
        raise BadInput("no weight_map", file=f"{snap.label}/{ckpt.INDEX}")
    return sorted(set(wm.values()))


def build(snap: remote.Snapshot, root: str, cache_dir: str, full_side_files: bool, token: str | None = None,
          on_header=None) -> View:
    """Write the view of ``snap`` into ``root`` (made, or refreshed): small files fetched, shards as stubs
    holding their headers. ``full_side_files``: fetch every side file (a conversion copies them)."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise io_error(e, root, "creating the view folder") from None
    if "config.json" not in snap.files:
        raise BadInput("no config.json in the repository", file=snap.label)
    index = None
    if ckpt.INDEX in snap.files:
        index = _inside(root, ckpt.INDEX, snap.label)
        _fetch_small(snap, ckpt.INDEX, cache_dir, index, token)
    shards = shard_names(snap, index)
    missing = [s for s in shards if s not in snap.files]
    view = View(root, snap, shards)
    for name in sorted(snap.files):
        if _hidden(name) or name == ckpt.INDEX:
            continue
        f = snap.files[name]
        dest = view.path(name)
        if name in shards:
            continue
        if name.endswith(".safetensors"):   # not in the index: the preflight names it (never converted)
            write_stub(dest, b"", f.size)
        elif full_side_files or f.size <= SIDE_LIMIT:
            _fetch_small(snap, name, cache_dir, dest, token)
        else:
            write_stub(dest, b"", f.size)
    for name in shards:
        if name in missing:
            continue   # absent from the view: the preflight reports it as a missing shard
        view.headers[name] = remote.header_bytes(snap, name, token)
        view.stub(name)
        if on_header:
            on_header(name)
    _record(view)
    return view


VIEW_RECORD = ".k3convert-view.json"   # hidden: never taken for a side file


def _record(view: View) -> None:
    path = os.path.join(view.root, VIEW_RECORD)
    try:
        with open(path, "w") as f:
            json.dump({"repo": view.snap.source.repo, "commit": view.snap.commit,
                       "files": {n: {"size": r.size, "sha256": r.sha256} for n, r in sorted(view.snap.files.items())}},
                      f, indent=1)
    except OSError as e:
        raise io_error(e, path, "writing the view's record") from None
