"""What DST holds, file by file: derived from the plan in one place, listed from disk in one place.

``expected`` is the one list of the transformations the converter makes (shards laid out by
the plan, side files copied byte-identical under ``side_file_target``'s name, config and index
derived from the plan): ``finalize`` writes exactly it and ``verify --source`` compares DST
with it, so the two cannot drift. ``listing`` is the one walk of what DST holds on disk:
``verify`` accepts or refuses each file and ``upload`` sends exactly the accepted ones.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..formats import checkpoint as ckpt
from ..state.files import MANIFEST, REPORT, STATE_DIR, TENSOR_TABLE
from .plan import README, TEMPORARY, Plan, ShardPlan, side_file_target

CONFIG = "config.json"
BOOKKEEPING = (MANIFEST, REPORT, TENSOR_TABLE)  # ours, about the conversion
# Folders under DST that are not part of the output and never published: our state, and
# huggingface_hub's own (its upload cache, a git checkout; its upload ignores both).
NOT_OUTPUT = (STATE_DIR, ".cache/huggingface", ".git")


@dataclass(frozen=True)
class Expected:
    """Every file of a complete DST that the source decides."""

    shards: dict[str, ShardPlan]     # name -> its layout (header bytes, size)
    side_files: dict[str, str]       # DST path -> SRC path, relative; copied byte-identical
    documents: dict[str, Any]        # config.json and the index, exactly

    @property
    def names(self) -> set[str]:
        return set(self.shards) | set(self.side_files) | set(self.documents)


def expected(plan: Plan, rule: str) -> Expected:
    """What DST must hold when ``plan`` is converted with scale ``rule``."""
    total = sum(t.nbytes for s in plan.shards for t in s.layout.tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(plan.weight_map().items()))}
    return Expected({s.name: s for s in plan.shards},
                    {side_file_target(rel): rel for rel in plan.other_files},
                    {ckpt.INDEX: index, CONFIG: plan.output_config(rule)})


@dataclass(frozen=True)
class Listing:
    """What DST holds on disk outside ``NOT_OUTPUT``, relative paths, sorted."""

    files: list[str]         # regular files (and anything else that is not a folder or a link)
    temporaries: list[str]   # ``plan.TEMPORARY``: left by a killed run, never part of the output
    links: list[str]         # symlinks (to a file or a folder): an upload would send what they point to


def listing(dst: str) -> Listing:
    files: list[str] = []
    temporaries: list[str] = []
    links: list[str] = []
    for d, dirs, names in os.walk(dst):
        rel_dir = os.path.relpath(d, dst).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirs[:] = sorted(x for x in dirs if rel_dir + x not in NOT_OUTPUT)
        for name in dirs + names:  # os.walk lists a linked folder among dirs (and does not enter it)
            rel = rel_dir + name
            if os.path.islink(os.path.join(d, name)):
                links.append(rel)
            elif name in names:
                (temporaries if TEMPORARY.search(name) else files).append(rel)
    return Listing(sorted(files), sorted(temporaries), sorted(links))


def named_by(manifest: dict) -> set[str]:
    """Every output file the manifest accounts for: its shards and files, itself, the model card
    (``upload`` writes README.md; a user's own card is kept)."""
    return set(manifest.get("shards") or {}) | set(manifest.get("files") or {}) | {MANIFEST, README}


def accepted(found: Listing, manifest: dict) -> list[str]:
    """The files of ``found`` that the manifest accounts for: what verify passes and upload sends."""
    named = named_by(manifest)
    return [f for f in found.files if f in named]
