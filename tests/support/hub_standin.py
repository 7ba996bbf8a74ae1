"""A stand-in for huggingface_hub's HfApi, as `k3convert upload` calls it (no network): the token
check (whoami), create_repo, create_branch, preupload_lfs_files and create_commit.

It behaves as huggingface_hub does where upload depends on it: preupload reads each large file
from its path and records the SHA-256 of what it read as the operation's (hf_xet does that
while uploading), small files go inline, and create_commit takes inline content as the
operation gives it, reading a path then. ``committed`` is what the commit would publish."""
from __future__ import annotations

import hashlib


class RecordingApi:
    endpoint = "https://hub.invalid"

    def __init__(self, role: str = "write"):
        self.role = role
        self.calls: list[tuple] = []
        self.uploaded: dict[str, bytes] = {}
        self.committed: dict[str, bytes] | None = None

    def whoami(self, *a, **kw):
        self.calls.append(("whoami",))
        return {"type": "user", "name": "someone", "auth": {"accessToken": {"displayName": "t", "role": self.role}}}

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
            if op._upload_mode == "lfs":
                committed[op.path_in_repo] = self.uploaded[op.path_in_repo]
            else:
                with op.as_file() as f:
                    committed[op.path_in_repo] = f.read()
        self.committed = committed

    @property
    def names(self) -> list[str]:
        """The calls' names, in order."""
        return [c[0] for c in self.calls]
