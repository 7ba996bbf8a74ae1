"""SRC as typed: a local checkpoint directory, or a Hugging Face Hub repository ``ORG/NAME[@REVISION]``.

Parsed once, at the command line's edge (``parse_source``): a path that exists is always local
(a folder named ``org/name`` in the working directory wins over the Hub); anything else must be
a valid repo id, else one line says why. Nothing here touches the network.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import BadInput

# the Hub's own rules (huggingface_hub.utils.validate_repo_id): letters, digits, - _ . ;
# no leading or trailing - or ., no "--" or ".."; at most 96 characters
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO = re.compile(rf"^{_PART}/{_PART}$")
# a branch, tag or commit: git's ref characters, no "..", no leading "-" or "/" (never an option or a path)
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubSource:
    """A Hub model repository and the revision asked for (None: the default branch)."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo

    @property
    def pinned(self) -> bool:
        """Whether the revision is a full commit id (it cannot move)."""
        return self.revision is not None and bool(COMMIT.fullmatch(self.revision))

    @property
    def name(self) -> str:
        """The repository's name (``default_dst``: ``NAME-int4`` in the working directory)."""
        return self.repo.split("/", 1)[1]


REPO_RULES = "letters, digits, - _ . in each part, not first or last; no -- or ..; at most 96 characters"


def repo_id_ok(repo: str) -> bool:
    """Whether ``repo`` is a Hub repo id ``ORG/NAME`` by the Hub's rules."""
    return bool(_REPO.fullmatch(repo)) and "--" not in repo and ".." not in repo and not repo.endswith(".git")


def hub_id_problem(text: str) -> str | None:
    """Why ``text`` is not ``ORG/NAME[@REVISION]``, or None."""
    repo, at, rev = text.partition("@")
    if not repo_id_ok(repo):
        return f"not an existing path, nor a Hub repo id ORG/NAME[@REVISION] ({REPO_RULES})"
    if at and (not _REVISION.fullmatch(rev) or ".." in rev or rev.endswith((".", "/", ".lock"))):
        return f"{rev!r} is not a revision (a branch, tag or commit id)"
    return None


def meant_for_hub(text: str) -> bool:
    """Whether a SRC that does not exist reads as an attempt at a repo id (one slash, not a path's start)."""
    return text.split("@", 1)[0].count("/") == 1 and not text.startswith(("/", ".", "~"))


def parse_source(text: str) -> str | HubSource:
    """A local path (it exists) or a HubSource; BadInput (one line, naming what was given) otherwise."""
    if os.path.lexists(text):
        return text
    if why := hub_id_problem(text):
        raise BadInput(why, file=text)
    repo, _, rev = text.partition("@")
    return HubSource(repo, rev or None)
