"""A stand-in for huggingface_hub's HfApi, as `k3convert upload` calls it (no network): the token
check (whoami), the repository's listing (model_info), create_repo, create_branch,
preupload_lfs_files and create_commit.

It behaves as huggingface_hub does where upload depends on it: preupload reads each large file
from its path and records the SHA-256 of what it read as the operation's (hf_xet does that
while uploading), small files go inline, and create_commit takes inline content as the
operation gives it, reading a path then. ``committed`` is what the commit would publish."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace


def _response(status: int):
    """An HTTP response of the client huggingface_hub uses (httpx2 from 1.x, requests before)."""
    try:
        import httpx2
        return httpx2.Response(status, request=httpx2.Request("GET", RecordingApi.endpoint))
    except ImportError:
        import requests
        r = requests.Response()
        r.status_code = status
        return r


class RecordingApi:
    endpoint = "https://hub.invalid"

    def __init__(self, role: str = "write", files: list[str] | None = None):
        self.role = role
        self.files = files  # what the repository holds (None: there is no repository)
        self.calls: list[tuple] = []
        self.uploaded: dict[str, bytes] = {}
        self.committed: dict[str, bytes | None] | None = None   # None: deleted by the commit

    def whoami(self, *a, **kw):
        self.calls.append(("whoami",))
        return {"type": "user", "name": "someone", "auth": {"accessToken": {"displayName": "t", "role": self.role}}}

    def model_info(self, repo_id, revision=None, **kw):
        from huggingface_hub.errors import RepositoryNotFoundError

        self.calls.append(("model_info", repo_id, revision))
        if self.files is None:
            raise RepositoryNotFoundError("404 Repository Not Found", response=_response(404))
        return SimpleNamespace(sha="b" * 40, siblings=[SimpleNamespace(rfilename=f) for f in self.files])

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))
        return f"https://hub.invalid/{repo_id}"

    def create_branch(self, repo_id, **kw):
        self.calls.append(("create_branch", repo_id, kw))

    def preupload_lfs_files(self, repo_id, additions, **kw):
        self.calls.append(("preupload_lfs_files", repo_id, kw))
        for op in additions:
            op._upload_mode = "regular" if isinstance(op.path_or_fileobj, bytes) else "lfs"
            if op._upload_mode == "lfs":
                with op.as_file() as f:
                    data = f.read()
                op.upload_info.sha256 = hashlib.sha256(data).digest()  # of what was sent
                self.uploaded[op.path_in_repo] = data

    def create_commit(self, repo_id, operations, **kw):
        self.calls.append(("create_commit", repo_id, kw))
        committed = {}
        for op in operations:
            if not hasattr(op, "path_or_fileobj"):  # a CommitOperationDelete
                committed[op.path_in_repo] = None
            elif op._upload_mode == "lfs":
                committed[op.path_in_repo] = self.uploaded[op.path_in_repo]
            else:
                with op.as_file() as f:
                    committed[op.path_in_repo] = f.read()
        self.committed = committed

    @property
    def names(self) -> list[str]:
        """The calls' names, in order."""
        return [c[0] for c in self.calls]
