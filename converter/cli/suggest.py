"""'Did you mean ...?' for a command the CLI does not have: close spellings, and the words people
reach for first (``convert``, ``quantize``, ``check``) mapped to the command that does it."""
from __future__ import annotations

import difflib
from typing import Iterable

ALIASES = {  # a word people type -> the command that does it
    "convert": "mxfp4-to-int4", "quantize": "mxfp4-to-int4", "quantise": "mxfp4-to-int4",
    "requantize": "mxfp4-to-int4", "int4": "mxfp4-to-int4", "run": "mxfp4-to-int4",
    "check": "verify", "validate": "verify", "test": "verify",
    "info": "inspect", "show": "inspect", "describe": "inspect",
    "fixture": "make-fixture", "push": "upload", "publish": "upload",
}


def close_commands(name: str, commands: Iterable[str]) -> list[str]:
    """The commands ``name`` was probably meant to be, best first (may be empty)."""
    commands = sorted(commands)
    word = name.lower().replace("_", "-")
    out = [ALIASES[word]] if ALIASES.get(word) in commands else []
    out += [c for c in difflib.get_close_matches(word, commands, n=3, cutoff=0.6) if c not in out]
    out += [c for c in commands if word and len(word) > 2 and word in c and c not in out]  # "fixture"
    return out[:3]


def unknown_command(name: str, commands: Iterable[str]) -> str:
    """The one-line complaint: "No such command 'convert'. Did you mean mxfp4-to-int4?"."""
    close = close_commands(name, commands)
    hint = f" Did you mean {' or '.join(close)}?" if close else " (k3convert --help lists the commands)"
    return f"No such command {name!r}.{hint}"
