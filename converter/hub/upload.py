"""Publish a finished DST on the Hugging Face Hub (docs/publish.md): refuse unfinished or broken
output, write a model card (``card``), then upload. The card is ours: the source's README.md is
kept beside it as README.source.md (converter.run.plan) and never published as the int4 model's card.

Before anything is written or hashed: the repo id (the Hub's rules), DST's verification, the token
(``whoami``: it must be able to write to the repository) and the repository (no other weight files
in it unless ``delete_stale``) are checked (``access``). Then every file is read once and checked
against the manifest's size and digest (``publish``), and sent with huggingface_hub's operation API:
``preupload_lfs_files`` uploads the large files (through hf_xet where installed, else LFS, each
byte proven to be the checked one as it is read), and only then ``create_commit`` makes one commit;
small files are committed from the bytes that were checked. Re-running the same command resumes:
what the Hub already holds is not sent again. (``upload_folder``/``upload_large_folder`` read DST on
their own, after any check of ours, and commit as they go: a changed byte would be published, and a
partial upload would show as a partial model.)

While it reads DST the upload holds DST's read lock (``locks.reading``): a run that would
change DST (a redo, ``--overwrite``, finalize) is refused meanwhile, and an upload is refused
while such a run holds it. Any other writer is caught by the checks above.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ..errors import BadInput, ConvertError, OutputError, VerifyFailed
from ..formats import json_input
from ..run.outputs import accepted, listing
from ..run.plan import README_SOURCE
from ..safepath import open_regular
from ..state.atomic import atomic_write
from ..state.files import MANIFEST
from ..state.locks import reading
from ..state.records import read_json
from ..verify import verify
from . import access, publish
from .access import authorize, network, one_line
from .card import model_card, read_or_none
from .source import REPO_RULES, repo_id_ok

README = "README.md"


@dataclass
class UploadResult:
    repo_id: str
    revision: str | None
    files: list[tuple[str, int]]      # (path in repo, bytes), what is (or would be) sent
    dry_run: bool
    readme: str                       # "written", "kept" (the user's own), "would write" or NOT_WRITTEN
    card: str | None = None           # the model card written (or that would be)
    method: str | None = None         # the HfApi method that committed
    url: str | None = None
    notes: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)   # other weight files removed by the commit (--delete-stale)

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.files)


def upload_files(dst: str) -> list[tuple[str, int]]:
    """Files of DST the upload sends, with sizes: those verify accepts (``outputs.accepted``)."""
    return _sized(dst, accepted(listing(dst), read_json(os.path.join(dst, MANIFEST)) or {}))


def _sized(dst: str, names: list[str]) -> list[tuple[str, int]]:
    return [(p, os.path.getsize(os.path.join(dst, p))) for p in names]


def _source_card(dst: str, theirs: bytes | None) -> bool:
    """Whether DST's README.md is the source's card ``theirs`` (earlier k3convert versions copied it there)."""
    return theirs is not None and read_or_none(os.path.join(dst, README)) == theirs


# --------------------------------------------------------------------------- upload

def _xet_available() -> bool:
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:  # private module moved: cannot tell, say nothing
        return True
    return bool(is_xet_available())


NOT_WRITTEN = "sent, not written to DST (DST is read-only)"


def _manifest(dst: str) -> tuple[dict, bytes]:
    """DST's manifest, parsed from the bytes that are published with it."""
    manifest, data = None, None
    if os.path.isdir(dst):
        try:
            with os.fdopen(open_regular(os.path.join(dst, MANIFEST), missing_ok=True), "rb") as f:
                data = f.read()
            manifest = json_input.loads(data.decode(), constants=True)
        except FileNotFoundError:
            pass
        except (ConvertError, OSError, ValueError, UnicodeDecodeError):  # a FIFO or device too
            raise BadInput(f"{MANIFEST} is not valid JSON", file=dst) from None
    if data is None:
        raise BadInput(f"no {MANIFEST}: not a k3convert output directory", file=dst)
    if not isinstance(manifest, dict):
        raise BadInput(f"{MANIFEST} is not valid JSON", file=dst)
    return manifest, data


def upload(dst: str, repo_id: str, *, private: bool = False, revision: str | None = None, dry_run: bool = False,
           token: str | None = None, verify_checksums: bool = False, base: str | None = None,
           endpoint: str | None = None, api: Any = None, delete_stale: bool = False) -> UploadResult:
    """Check DST, write its model card if it has none, and upload it to ``repo_id`` (a model repo).

    Refuses (VerifyFailed, exit 5) unless the manifest says complete, the structural checks
    pass and every file's bytes are the manifest's (read once, and those bytes are what is
    committed); BadInput (exit 2) for a repo id the Hub would refuse (first), a missing or
    refused token, one that cannot write to ``repo_id``, or a repository that holds other weight
    files (``delete_stale``: they are deleted in the same commit), all checked once DST verifies
    and before anything is written or hashed; OutputError (exit 4) while a run changes DST (its
    read lock) or when the Hub cannot be reached. ``dry_run``: only list what would be sent;
    nothing is written, nothing is sent, no lock is taken, and shards are hashed only with
    ``verify_checksums``.
    """
    dst = os.path.abspath(dst)
    if not repo_id_ok(repo_id):
        raise BadInput(f"{repo_id!r} is not a Hub repo id OWNER/NAME ({REPO_RULES})")
    manifest, manifest_bytes = _manifest(dst)
    if manifest.get("complete") is not True:
        raise VerifyFailed(f"the manifest says the conversion is not complete (status {manifest.get('status')!r}): "
                           "finish it before uploading", file=dst)
    if dry_run:  # nothing written, nothing sent: what it lists is a snapshot, no lock needed
        return _with_card(dst, *_verified(dst, manifest, True, verify_checksums), repo_id, revision, True, base)
    if api is None:
        from huggingface_hub import HfApi
        api = HfApi(endpoint=endpoint, token=token)
    with reading(dst):  # DST unchanged by our own runs from verify to the last byte sent (S14)
        # the shards' digests are checked below, as they are read for sending: not twice
        verified = _verified(dst, manifest, False, False)  # a broken DST is refused offline
        # the token and the repository, before the card is written and hours of hashing (issue 33 §3, H8, H12)
        authorize(api, repo_id)
        target = access.target(api, repo_id, revision, {README, *verified[0].files}, delete_stale)
        result = _with_card(dst, *verified, repo_id, revision, False, base)
        result.deleted = target.stale
        in_memory = {MANIFEST: manifest_bytes}
        readme = result.card.encode() if result.card is not None else read_or_none(os.path.join(dst, README))
        if readme is None:
            raise OutputError("README.md cannot be read", file=dst)
        in_memory[README] = readme
        checked = publish.check(dst, [p for p, _ in result.files], manifest, in_memory)  # T1
        _send(result, dst, checked, private, api, target)
    if private:
        result.notes.append("an existing repository keeps its visibility: --private applies to a new one")
    return result


def _verified(dst: str, manifest: dict, dry_run: bool, verify_checksums: bool) -> tuple[Any, bytes | None]:
    """DST verified (VerifyFailed otherwise), and the source's card as read (None: none)."""
    readme_path = os.path.join(dst, README)
    src = (manifest.get("source") or {}).get("path")
    theirs = read_or_none(os.path.join(src, README)) if isinstance(src, str) and src else None  # read once
    if not dry_run and _source_card(dst, theirs) and not os.path.exists(os.path.join(dst, README_SOURCE)):
        try:  # the source's card is not ours to publish: back to the name the manifest records it by
            os.replace(readme_path, os.path.join(dst, README_SOURCE))
        except OSError as e:
            raise OutputError(f"cannot rename README.md to {README_SOURCE}: {e.strerror}", file=dst) from None
    # the publishing gate: the config's selection decided by compressed-tensors' own matcher too
    verified = verify(dst, checksums=verify_checksums, loader_matcher=True)
    verified.raise_if_failed()  # only regular files pass (a FIFO README.md included: S16)
    return verified, theirs


def _with_card(dst: str, verified: Any, theirs: bytes | None, repo_id: str, revision: str | None, dry_run: bool,
               base: str | None) -> UploadResult:
    """Write (or, dry or on a read-only DST, compose) DST's card: what the upload sends, by name and size."""
    readme_path = os.path.join(dst, README)
    files = _sized(dst, [p for p in verified.files if p != README])  # exactly what verify accepted
    card = None
    if README in verified.files and not _source_card(dst, theirs):
        readme = "kept"
    else:
        card = model_card(dst, base, repo_id)
        if dry_run:
            readme = "would write"
        elif not os.access(dst, os.W_OK):  # read-only storage (T17): published from memory
            readme = NOT_WRITTEN
        else:
            readme = "written"
            atomic_write(readme_path, card.encode())
    size = len(card.encode()) if card is not None else os.path.getsize(readme_path)
    return UploadResult(repo_id, revision, sorted(files + [(README, size)]), dry_run, readme, card)


def _send(result: UploadResult, dst: str, checked: list[publish.Checked], private: bool, api: Any,
          target: access.Target) -> None:
    """Create the repository (and branch), upload exactly ``checked`` and commit it once (deleting
    ``target.stale`` in it), after each large file is proven to be what was sent (``publish.confirm``).
    A Hub failure that a rerun may get past (the network, HTTP 408/409/412/429/5xx) says how to resume; one
    that it cannot (any other refusal) does not."""
    from huggingface_hub import CommitOperationDelete

    repo_id, revision = result.repo_id, result.revision
    xet = _xet_available()
    sending = publish.operations(dst, checked, xet)

    def hub(step):
        try:
            return step()
        except Exception as e:  # the Hub or the network: one line; anything else is a bug
            sending.raise_if_changed()  # a file found changed as it was sent: that, not huggingface_hub's wrapping
            raise _hub_error(e, repo_id) from None

    try:
        result.url = str(hub(lambda: api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)))
        if revision and revision != "main":
            hub(lambda: api.create_branch(repo_id, repo_type="model", branch=revision, exist_ok=True))
        if not xet:
            result.notes.append("hf_xet is not installed (or HF_HUB_DISABLE_XET is set): files went by the LFS "
                                "protocol, which resumes file by file; `pip install hf_xet` for large uploads")
        hub(lambda: api.preupload_lfs_files(repo_id, additions=sending.ops, repo_type="model", revision=revision))
        publish.confirm(checked, sending)  # T2, H6: what the commit names is what was checked and sent
        deletes = [CommitOperationDelete(path_in_repo=p) for p in target.stale]
        hub(lambda: api.create_commit(repo_id, operations=[*sending.ops, *deletes], repo_type="model",
                                      revision=revision, parent_commit=target.parent,
                                      commit_message=f"int4 group-32 experts converted by k3convert {__version__}"))
    finally:
        sending.close()
    result.method = "create_commit"
    if target.stale:
        result.notes.append(f"deleted {len(target.stale)} other weight file(s) in the same commit (--delete-stale): "
                            + ", ".join(target.stale))


# and 5xx: the Hub's own trouble, which a rerun may get past; 409/412: the branch moved since it was listed
# (a rerun lists it again)
RESUMABLE = (408, 409, 412, 429)


def _hub_error(e: BaseException, repo_id: str) -> BaseException:
    """One line for a failed Hub call of the upload: the network's is exit 4 and a rerun resumes; an
    HTTP 408/409/412/429/5xx answer is exit 1 and a rerun may resume; any other answer is a refusal a rerun
    would meet again (401/403: the token, exit 2). Anything else is a bug, raised as it is."""
    from huggingface_hub.errors import HfHubHTTPError

    while isinstance(e, RuntimeError) and e.__cause__ is not None:  # "Error while uploading X" around the cause
        e = e.__cause__
    if not isinstance(e, (HfHubHTTPError, ValueError)) and not network(e):
        return e
    said = f"upload to {repo_id} failed: {one_line(e)}"
    if network(e):
        return OutputError(f"{said}. Run the same command again to resume")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(status, int) and (status in RESUMABLE or status >= 500):
        return ConvertError(f"{said}. Run the same command again to resume")
    if status in (401, 403):
        return BadInput(f"{said}: the token cannot write there")
    return ConvertError(said)
