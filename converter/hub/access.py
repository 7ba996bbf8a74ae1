"""What ``upload`` asks the Hub before any work (before the card is written or a byte hashed): can the
token write to the repository (whoami: its role, a fine-grained token's grants), and what does the
branch hold already (weight files the upload would leave beside the new model are refused, or
deleted in the same commit with --delete-stale: docs/publish.md). Also the one-line form of the
Hub's and the network's errors that every upload step reports."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import BadInput, ConvertError, OutputError

# what a loader may take for the model's weights: files of these kinds that this upload does not write are
# refused in the repository (or deleted in the same commit with --delete-stale)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz",
                   ".index.json")


def one_line(e: BaseException, limit: int = 400) -> str:
    """An exception's message on one line. huggingface_hub's HTTP errors span several (status,
    a documentation link, the server's words): for them, the status, the URL and the server's message."""
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    if response is not None and isinstance(status, int):
        try:
            url = f" on {response.request.method} {response.request.url}"
        except Exception:  # a response built without its request
            url = ""
        said = getattr(e, "server_message", None)
        text = (f"HTTP {status} {getattr(response, 'reason_phrase', '') or ''}".rstrip() + url
                + (f": {said}" if said else ""))
    else:
        text = str(e)
    text = " ".join(text.split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def network(e: BaseException) -> bool:
    """Whether ``e`` is the network's (a refused connection, a timeout, offline mode), not the Hub's answer."""
    from huggingface_hub.errors import HfHubHTTPError

    module = type(e).__module__.split(".")[0]
    return not isinstance(e, HfHubHTTPError) and (module in ("httpx", "httpx2", "requests", "urllib3")
                                                  or isinstance(e, OSError))


def _ask(endpoint: str, what: str, step: Any) -> Any:
    """``step()``, a question to the Hub before any work: the network's failure is exit 4, the Hub's
    answer (other than the ones the caller handles) one line, exit 1; neither is a resume."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return step()
    except Exception as e:
        if network(e):
            raise OutputError(f"cannot reach {endpoint}: {one_line(e)}") from None
        if isinstance(e, (HfHubHTTPError, ValueError)):
            raise ConvertError(f"cannot {what} with {endpoint}: {one_line(e)}") from None
        raise


def authorize(api: Any, repo_id: str) -> None:
    """The token, checked with the Hub before anything is hashed or sent: missing or refused is
    exit 2, a read-only token too, and a fine-grained one that cannot write to ``repo_id``; the
    Hub out of reach is exit 4, with the cause."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    endpoint = getattr(api, "endpoint", None) or "the Hub"
    login = "log in with `hf auth login`, set HF_TOKEN, or pass --token"

    def whoami():
        try:
            return api.whoami()
        except LocalTokenNotFoundError:
            raise BadInput(f"no Hugging Face token: {login}") from None
        except HfHubHTTPError as e:
            if getattr(e.response, "status_code", None) == 401:
                raise BadInput(f"the Hub refused the token ({one_line(e)}): {login}") from None
            raise

    token = ((_ask(endpoint, "check the token", whoami) or {}).get("auth") or {}).get("accessToken") or {}
    name = f" {token['displayName']!r}" if isinstance(token.get("displayName"), str) else ""
    if token.get("role") == "read":
        raise BadInput(f"the token{name} is read-only: upload needs a write token; {login}")
    if token.get("role") == "fineGrained" and not can_write(token.get("fineGrained"), repo_id):
        raise BadInput(f"the fine-grained token{name} cannot write to {repo_id} (it has no repo.write on "
                       f"{repo_id.split('/')[0]} or on the repository): grant it that, or use a write token; {login}")


def can_write(grants: Any, repo_id: str) -> bool:
    """Whether a fine-grained token's grants (whoami's ``accessToken.fineGrained``) include writing to
    ``repo_id``: ``repo.write`` on its owner (a user or an organization), on the repository itself, or
    everywhere. Anything unreadable counts as no."""
    if not isinstance(grants, dict):
        return False
    owner = repo_id.split("/")[0]
    if "repo.write" in (grants.get("global") or []):
        return True
    for scope in grants.get("scoped") or []:
        entity = scope.get("entity") if isinstance(scope, dict) else None
        if not isinstance(entity, dict) or "repo.write" not in (scope.get("permissions") or []):
            continue
        kind, name = entity.get("type"), entity.get("name")
        if (kind in ("user", "org") and name == owner) or name == repo_id:
            return True
    return False


@dataclass(frozen=True)
class Target:
    """The branch the commit lands on, as listed before any work: its commit (None: no repository
    yet) and the weight files in it that the upload does not write (``stale``: deleted by the commit)."""

    parent: str | None
    stale: list[str]


def weight_file(path: str) -> bool:
    """Whether a loader may take ``path`` for the model's weights (``WEIGHT_SUFFIXES``)."""
    return path.lower().endswith(WEIGHT_SUFFIXES)


def target(api: Any, repo_id: str, revision: str | None, ours: set[str], delete_stale: bool) -> Target:
    """What ``repo_id`` holds on ``revision`` (a branch to be made: on the default branch it starts
    from). Weight files that this upload does not write are refused (BadInput, exit 2) unless
    ``delete_stale``: a loader may take them beside the new model (H8, docs/decisions.md)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    endpoint = getattr(api, "endpoint", None) or "the Hub"

    def listing():
        try:
            try:
                return api.model_info(repo_id, revision=revision)
            except RevisionNotFoundError:  # a new branch: made from the default one
                return api.model_info(repo_id)
        except RepositoryNotFoundError:
            return None

    info = _ask(endpoint, f"list {repo_id}", listing)
    if info is None:
        return Target(None, [])
    held = sorted(s.rfilename for s in (getattr(info, "siblings", None) or []))
    stale = [p for p in held if weight_file(p) and p not in ours]
    if stale and not delete_stale:
        shown = ", ".join(stale[:5]) + (f" (and {len(stale) - 5} more)" if len(stale) > 5 else "")
        raise BadInput(f"{repo_id}{f'@{revision}' if revision else ''} holds weight files this upload does not "
                       f"replace: {shown}; a loader may load them beside the new model. Pass --delete-stale to "
                       "delete them in the same commit, or upload to another repository or --revision")
    return Target(getattr(info, "sha", None), stale)
