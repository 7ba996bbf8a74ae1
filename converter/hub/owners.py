"""Who owns what in a Hugging Face cache that several k3convert runs, dry runs and the user share
(docs/hub.md, "The cache"): one owner for every file.

- A run's view (config, index, side files, the shards' header-only stubs, the shards it is
  converting) is in a folder of its own, ``<cache>/.k3convert-views/<org--name>/runs/<id>/``, held
  by an flock on its ``lock`` for as long as the run lives and removed when it ends; a later run
  removes the folders whose lock nobody holds (a killed run's), under the repository's lock.
  Nothing one run writes there is read or rewritten by another.
- A blob (a shard's bytes, shared by every run through huggingface_hub's cache) is k3convert's
  only when a run fetched it: ``fetched/<sha256>`` is written, under the repository's lock, before
  the download starts. One that was complete in the cache before is the user's and is never removed.
- Each live run lists the blobs it still reads (its ``needs.json``). A run done with a blob removes
  it only when it is k3convert's, the run was not told to keep it (``--keep-source``, which hands it
  to the user: the mark goes), and no other live run lists it: the last run that reads it removes it.
"""
from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import uuid
from typing import IO, Iterator

from ..errors import BadInput, OutputError
from ..safepath import lock_file, try_lock
from ..state.atomic import atomic_write

VIEWS = ".k3convert-views"   # under the cache folder
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_sha256(sha: object) -> bool:
    """A blob name huggingface_hub could have written: 64 lowercase hex digits, never a path."""
    return isinstance(sha, str) and _SHA256.fullmatch(sha) is not None


def _blob_name(sha: str, where: str) -> str:
    """``sha`` as a file name under the cache, refused (BadInput) unless it is a SHA-256: the
    Hub's listing is untrusted and this name is joined to the cache's folders."""
    if not is_sha256(sha):
        raise BadInput(f"malformed SHA-256 {str(sha)[:80]!r}: not used as a file name", file=where)
    return sha


class Fate(enum.Enum):
    """What became of a blob a run was done with (the closing line counts them)."""

    REMOVED = "removed (k3convert fetched it)"
    YOURS = "kept (not fetched by k3convert: yours)"
    SHARED = "kept (another live run still reads it; the last one removes it)"
    KEPT = "kept (--keep-source)"


def io_error(e: OSError, path: str, what: str) -> OutputError:
    """An OSError in the cache or a view as one line naming the path; a full disk says so (exit 4)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"no space left on the disk holding it ({what}): free some, or give the Hub cache "
                           "another disk with --cache-dir", file=path)
    return OutputError(f"{what} failed: {e.strerror}", file=path)


def repo_folder(cache_dir: str, repo: str) -> str:
    """The repository's folder in a Hugging Face cache, named as huggingface_hub names it."""
    from huggingface_hub.file_download import repo_folder_name
    return os.path.join(cache_dir, repo_folder_name(repo_id=repo, repo_type="model"))


def _probe_lock(path: str) -> IO[str] | None:
    """The lock file ``path`` taken (its holder is dead), or None (a live run holds it, or it is gone)."""
    try:
        return try_lock(path)
    except OSError:
        return None


class RunSpace:
    """This run's private folder under the cache and its claims on the repository's blobs.

    ``view``: where the run's view of the commit is built. ``close`` removes the folder (the
    claims with it). Blob bookkeeping (``claim``, ``before_fetch``, ``release``) happens under the
    repository's lock, a few file operations each."""

    def __init__(self, cache_dir: str, repo: str):
        self.cache_dir = os.path.abspath(cache_dir)
        self.repo_dir = os.path.join(self.cache_dir, VIEWS, repo.replace("/", "--"))
        self.blobs = os.path.join(repo_folder(self.cache_dir, repo), "blobs")
        self.marks = os.path.join(self.repo_dir, "fetched")
        runs = os.path.join(self.repo_dir, "runs")
        ident = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.root = os.path.join(runs, ident)
        self.needs: set[str] = set()
        self._lock = None
        try:
            os.makedirs(self.marks, exist_ok=True)
            with self.locked():
                self._clean_dead(runs)
                os.makedirs(self.root)
                self._lock = lock_file(os.path.join(self.root, "lock"))
                fcntl.flock(self._lock, fcntl.LOCK_EX)   # held until close (or the process dies)
                self._write_needs()
        except OSError as e:
            self.close()
            raise io_error(e, self.root, "creating this run's folder") from None
        except BaseException:
            self.close()
            raise

    @property
    def view(self) -> str:
        return os.path.join(self.root, "view")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The repository's lock (exclusive; short holds only)."""
        with lock_file(os.path.join(self.repo_dir, "lock")) as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _live_runs(self) -> Iterator[str]:
        """The folders of the other live runs (under the lock); a dead run's is removed on the way."""
        runs = os.path.dirname(self.root)
        for entry in sorted(os.listdir(runs)) if os.path.isdir(runs) else []:
            folder = os.path.join(runs, entry)
            if folder == self.root:
                continue
            dead = _probe_lock(os.path.join(folder, "lock"))
            if dead is None:
                yield folder
                continue
            with dead:
                shutil.rmtree(folder, ignore_errors=True)

    def _clean_dead(self, runs: str) -> None:
        if os.path.isdir(runs):
            for folder in list(self._live_runs()):
                if not os.path.exists(os.path.join(folder, "lock")):   # being made, or half-removed: no lock file
                    shutil.rmtree(folder, ignore_errors=True)

    def _write_needs(self) -> None:
        atomic_write(os.path.join(self.root, "needs.json"), json.dumps(sorted(self.needs)).encode())

    def _others_need(self, sha: str) -> bool:
        for folder in self._live_runs():
            try:
                with open(os.path.join(folder, "needs.json")) as f:
                    if sha in json.load(f):
                        return True
            except FileNotFoundError:
                continue      # killed while its folder was made: it reads nothing
            except (OSError, ValueError):
                return True   # a live run whose list cannot be read: assume it reads everything
        return False

    def _complete(self, sha: str, size: int) -> bool:
        try:
            return os.path.getsize(os.path.join(self.blobs, sha)) == size
        except OSError:
            return False

    def claim(self, shas: set[str]) -> None:
        """The blobs this run will read: no other run removes them until ``release``."""
        try:
            with self.locked():
                self.needs |= shas
                self._write_needs()
        except OSError as e:
            raise io_error(e, self.root, "recording which shards this run reads") from None

    def before_fetch(self, sha: str, size: int) -> bool:
        """A blob about to be fetched: marked k3convert's unless it is complete in the cache already
        (then it is the user's, or an earlier run's that is marked). Whether it was there."""
        _blob_name(sha, self.marks)
        try:
            with self.locked():
                if self._complete(sha, size):
                    return True
                with open(os.path.join(self.marks, sha), "w"):
                    pass
                return False
        except OSError as e:
            raise io_error(e, self.marks, "marking a shard as fetched by k3convert") from None

    def release(self, sha: str, paths: list[str], keep: bool) -> Fate:
        """This run is done with a blob: remove it (and ``paths``, its snapshot links) where it is
        k3convert's, not to be kept, and no other live run reads it; else say why it stays."""
        return self._let_go(sha, paths, keep, bad=False)

    def discard_bad(self, sha: str, paths: list[str]) -> bool:
        """A blob that is not what the Hub lists: removed (True) where a run fetched it, whoever
        else reads it (every reader checks it and refuses it too); the user's is left (False)."""
        return self._let_go(sha, paths, keep=False, bad=True) is Fate.REMOVED

    def _let_go(self, sha: str, paths: list[str], keep: bool, bad: bool) -> Fate:
        mark = os.path.join(self.marks, _blob_name(sha, self.marks))
        try:
            with self.locked():
                self.needs.discard(sha)
                # A full disk must not abort the run here (removing the blob is what frees space); a
                # stale needs.json only lists more, so another run keeps a blob longer, never less.
                with contextlib.suppress(OSError, OutputError):
                    self._write_needs()
                if not os.path.exists(mark):
                    return Fate.YOURS
                if keep:
                    os.unlink(mark)
                    return Fate.KEPT
                if not bad and self._others_need(sha):
                    return Fate.SHARED
                for p in (*paths, os.path.join(self.blobs, sha), mark):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
                return Fate.REMOVED
        except OSError as e:
            raise io_error(e, self.blobs, "removing a downloaded shard") from None

    def close(self) -> None:
        """Remove this run's folder (under the repository's lock: no run sees it half gone), then
        let go of its lock. Never raises: a folder left behind is a dead run's, removed by the next."""
        if os.path.isdir(self.root):
            try:
                with self.locked():
                    shutil.rmtree(self.root, ignore_errors=True)
            except (OSError, OutputError):
                shutil.rmtree(self.root, ignore_errors=True)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
