"""What one verify run shares between its checks: DST as read, the options, and what earlier
checks found that later ones use (the accepted files, the figure table's rows)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..checks import Check, VerifyResult
from .dst import Dst, load

if TYPE_CHECKING:   # the serving rules load only with --serving
    from ..servers.rules import ServingRequest


@dataclass
class Context:
    dst: Dst
    result: VerifyResult
    source: str | None = None              # SRC made absolute (checked to be a directory by the source checks)
    sample: int | None = 8                 # converted tensors re-decoded (None: every one)
    checksums: bool = True
    workers: int = 4
    serving: ServingRequest | None = None
    loader_matcher: bool = False           # compressed-tensors' is_match re-decides the config's selection
    rows: dict[str, dict] = field(default_factory=dict)   # figure table rows by tensor (figures -> re-decode)
    plan: Any = None                       # the conversion plan recomputed from SRC (source files -> passthrough)
    started: dict[str, Check] = field(default_factory=dict)  # checks loading already found problems for

    def check(self, name: str) -> Check:
        """The check ``name``: the one loading started (with its problems), else a new one."""
        return self.started.pop(name, None) or Check(name)


def open_context(dst: str, source: str | None = None, **options) -> Context:
    """Load DST (BadInput when it cannot be read at all) and set up the run."""
    started = {n: Check(n) for n in ("files", "index", "config")}
    d = load(dst, started["files"], started["index"], started["config"])
    src = os.path.abspath(source) if source is not None else None
    return Context(d, VerifyResult(d.path), src, started=started, **options)
