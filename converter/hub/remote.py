"""What k3convert asks of the Hub, through huggingface_hub only: one commit's file list with each
file's size and LFS SHA-256, a shard's safetensors header by a range request, small files, and a
whole shard (``hf_hub_download``: resumable, hf_xet where installed) checked against its SHA-256.

Every call names the commit resolved once (``resolve``), never a branch: a branch that moves
during a run cannot mix two revisions. Hub errors become one line (BadInput: the repo, revision
or file is not there or not allowed; OutputError: the Hub cannot be reached).

The header is fetched as bytes (the same two range requests ``get_safetensors_metadata`` makes,
first 100 kB then the rest) rather than as that function's parsed result: our own strict parser
(converter.formats.safetensors_io) must judge the untrusted bytes, and the conversion's
absolute offsets depend on the header's exact length.
"""
from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass

from ..digest import sha256_of
from ..errors import BadInput, OutputError
from ..formats.safetensors_io import MAX_HEADER
from .owners import io_error, is_sha256, repo_folder
from .source import HubSource

FIRST_RANGE = 100_000  # bytes asked for first, as huggingface_hub's get_safetensors_metadata does
# the largest file size a listing may state: far beyond any shard (a whole 2.8T-parameter model in one
# file is ~1.5 TB), within what common file systems hold as one (sparse) file (ext4: 16 TiB)
MAX_LISTED = 1 << 42


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None   # the LFS SHA-256 (None: a small file kept in git)


@dataclass(frozen=True)
class Snapshot:
    """One commit of a repository, as listed by the Hub."""

    source: HubSource
    commit: str
    files: dict[str, RemoteFile]

    @property
    def label(self) -> str:
        return f"{self.source.repo}@{self.commit}"


def endpoint() -> str | None:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def timeouts() -> tuple[float, float]:
    """Seconds to wait for an answer: (metadata: model info, HEAD; data: ranges, downloads), as
    huggingface_hub reads them at import (HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT; 10 s each)."""
    from huggingface_hub import constants
    return float(constants.HF_HUB_ETAG_TIMEOUT), float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


def _hub_error(e: BaseException, what: str, cache_dir: str | None = None) -> Exception:
    from huggingface_hub import errors as hfe
    if isinstance(e, hfe.LocalEntryNotFoundError) and e.__cause__ is not None:
        e = e.__cause__   # huggingface_hub's "cannot find it in the cache either": the cause is the news
    name = type(e).__name__
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return io_error(e, cache_dir or what, "downloading into the Hub cache")
    if isinstance(e, hfe.GatedRepoError):
        return BadInput("gated repository: accept its terms on the Hub and log in (hf auth login or HF_TOKEN)",
                        file=what)
    if isinstance(e, hfe.RepositoryNotFoundError):
        return BadInput("no such repository on the Hub (or it is private: log in with hf auth login or HF_TOKEN)",
                        file=what)
    if isinstance(e, hfe.RevisionNotFoundError):
        return BadInput("no such revision in the repository", file=what)
    if isinstance(e, hfe.EntryNotFoundError) and not isinstance(e, hfe.LocalEntryNotFoundError):
        return BadInput("no such file in the repository at this commit", file=what)
    if isinstance(e, hfe.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return OutputError(f"the Hub answered HTTP {status}: {str(e).splitlines()[0][:200]}", file=what)
    again = "; run the same command again once it answers (a conversion resumes)"
    if "Timeout" in name:
        meta, data = timeouts()
        return OutputError(f"the Hub ({endpoint() or 'huggingface.co'}) did not answer within {meta:g} s "
                           f"(HF_HUB_ETAG_TIMEOUT) / {data:g} s (HF_HUB_DOWNLOAD_TIMEOUT){again}, or raise them",
                           file=what)
    if isinstance(e, OSError) or "Connect" in name or "Network" in name:
        return OutputError(f"cannot reach the Hub ({endpoint() or 'huggingface.co'}): "
                           f"{str(e).splitlines()[0][:200] if str(e) else name}{again}", file=what)
    return OutputError(f"{name}: {str(e).splitlines()[0][:200] if str(e) else ''}", file=what)


def resolve(source: HubSource, token: str | None = None) -> Snapshot:
    """The commit ``source`` names now, and every file of it with its size and LFS SHA-256."""
    from huggingface_hub import HfApi
    try:
        info = HfApi(endpoint=endpoint(), token=token).model_info(source.repo, revision=source.revision,
                                                                   files_metadata=True, timeout=timeouts()[0])
    except Exception as e:  # huggingface_hub and httpx errors, turned into one line
        raise _hub_error(e, str(source)) from None
    if not isinstance(info.sha, str) or len(info.sha) != 40:
        raise BadInput(f"the Hub gave no commit id for it ({info.sha!r})", file=str(source))
    files = {}
    for s in info.siblings or []:
        size = s.lfs.size if s.lfs else s.size
        if not isinstance(size, int) or size < 0:
            raise BadInput("the Hub lists no size for it", file=f"{source.repo}/{s.rfilename}")
        if size > MAX_LISTED:
            raise BadInput(f"the Hub lists {size:,} bytes for it, more than any file this tool reads "
                           f"({MAX_LISTED:,} bytes at most)", file=f"{source.repo}/{s.rfilename}")
        sha = s.lfs.sha256 if s.lfs else None
        if sha is not None and not is_sha256(sha):   # it names files in the cache: never a path
            raise BadInput(f"the Hub lists a malformed SHA-256 for it ({str(sha)[:80]!r})",
                           file=f"{source.repo}/{s.rfilename}")
        files[s.rfilename] = RemoteFile(s.rfilename, size, sha)
    return Snapshot(source, info.sha, files)


def _get_range(snap: Snapshot, name: str, start: int, end: int, token: str | None) -> bytes:
    """Bytes [start, end] of a file of the commit (huggingface_hub's session, headers and errors)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
    url = hf_hub_url(snap.source.repo, name, revision=snap.commit, endpoint=endpoint())
    headers = {**build_hf_headers(token=token), "Range": f"bytes={start}-{end}"}
    try:
        r = get_session().get(url, headers=headers, follow_redirects=True, timeout=timeouts()[1])
        hf_raise_for_status(r)
    except Exception as e:
        raise _hub_error(e, f"{snap.label}/{name}") from None
    return r.content


def header_bytes(snap: Snapshot, name: str, token: str | None = None) -> bytes:
    """A shard's 8-byte length and JSON header, exactly as the file holds them."""
    size = snap.files[name].size
    where = f"{snap.label}/{name}"
    if size < 8:
        raise BadInput(f"{size} bytes: too short for a safetensors file", file=where)
    first = _get_range(snap, name, 0, min(size, FIRST_RANGE) - 1, token)
    if len(first) < 8:
        raise BadInput("the Hub returned fewer bytes than asked for", file=where)
    n = struct.unpack("<Q", first[:8])[0]
    if n > MAX_HEADER or 8 + n > size:
        raise BadInput(f"header length {n:,} exceeds the limit or the file's {size:,} bytes", file=where)
    if len(first) < 8 + n:
        first += _get_range(snap, name, len(first), 8 + n - 1, token)
    if len(first) < 8 + n:
        raise BadInput("the Hub returned fewer bytes than asked for", file=where)
    return first[: 8 + n]


def drop_dead_partials(snap: Snapshot, name: str, cache_dir: str) -> int:
    """Remove what a killed download of the file left in the cache, under huggingface_hub's own lock for
    it (a download in progress holds it: then nothing is touched); bytes freed. huggingface_hub 2.x
    writes each attempt to a process-unique ``<etag>.<id>.incomplete`` (it resumes within a process,
    after a dropped connection, not across processes): a kill -9 would leave one behind per run."""
    from filelock import Timeout
    from huggingface_hub.utils import WeakFileLock
    etag = snap.files[name].sha256
    folder = repo_folder(cache_dir, snap.source.repo)
    blobs = os.path.join(folder, "blobs")
    try:
        dead = [e for e in os.listdir(blobs) if e.startswith(f"{etag}.") and e.endswith(".incomplete")]
    except OSError:
        return 0
    if not dead or etag is None:
        return 0
    freed = 0
    lock = os.path.join(cache_dir, ".locks", os.path.basename(folder), f"{etag}.lock")
    try:
        with WeakFileLock(lock, timeout=0.01):
            for e in dead:
                p = os.path.join(blobs, e)
                try:
                    freed += os.path.getsize(p)
                    os.unlink(p)
                except OSError:
                    pass
    except Timeout:  # another process downloads it now
        return 0
    return freed


def download(snap: Snapshot, name: str, cache_dir: str, token: str | None = None) -> str:
    """The file, in the HF cache layout under ``cache_dir`` (a complete one is not fetched again): its path."""
    from huggingface_hub import hf_hub_download
    drop_dead_partials(snap, name, cache_dir)
    try:
        return hf_hub_download(snap.source.repo, name, revision=snap.commit, cache_dir=cache_dir,
                               endpoint=endpoint(), token=token, etag_timeout=timeouts()[0])
    except Exception as e:
        raise _hub_error(e, f"{snap.label}/{name}", cache_dir) from None


def problem(snap: Snapshot, name: str, path: str) -> str | None:
    """Why a downloaded file is not what the commit lists (its size or SHA-256), or None."""
    want = snap.files[name]
    size = os.path.getsize(path)
    if size != want.size:
        return f"downloaded {size:,} bytes, the Hub lists {want.size:,}"
    if want.sha256 is not None and (got := sha256_of(path)) != want.sha256:
        return f"SHA-256 {got} differs from the Hub's {want.sha256}"
    return None


def check(snap: Snapshot, name: str, path: str) -> None:
    """Refuse a downloaded file whose size or SHA-256 is not what the commit lists (BadInput)."""
    if why := problem(snap, name, path):
        raise BadInput(f"{why}: not used", file=f"{snap.label}/{name}")


def snapshot_path(source: HubSource, cache_dir: str | None = None, token: str | None = None) -> str:
    """The commit's files in the HF cache, each fetched unless the cache holds it (what a kept
    conversion left there): the snapshot folder, for ``verify --source ORG/NAME@COMMIT``."""
    snap = resolve(source, token)
    from huggingface_hub import constants
    cache_dir = os.path.abspath(cache_dir or constants.HF_HUB_CACHE)
    for name in sorted(snap.files):
        if not name.startswith("."):
            download(snap, name, cache_dir, token)
    return os.path.join(repo_folder(cache_dir, snap.source.repo), "snapshots", snap.commit)
