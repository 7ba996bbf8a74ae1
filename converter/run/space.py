"""Disk space: what the rest of a run writes, and the refusal (exit 4) of a job that does not fit."""
from __future__ import annotations

import math
import os
import shutil

from ..errors import OutputError
from ..state.atomic import copy_current
from .plan import Plan, ShardPlan, side_file_target


def space_margin(need: int) -> int:
    """Head-room beyond the estimate: 2% of the job, a tenth of it up to 1 GiB, and 4 MiB at
    least (file system metadata): a small job fits a small file system."""
    return max(need // 50, min(1 << 30, need // 10), 4 << 20)


def gb(n: int) -> str:
    """Bytes in GB with two significant digits at least: a small figure never reads 0.0."""
    if n >= 1e9 or n <= 0:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e9:.{1 - math.floor(math.log10(n / 1e9))}f} GB"


def bytes_needed(plan: Plan, dst: str, todo: list[ShardPlan], emptied: bool = False) -> int:
    """What the rest of the run writes: its shards, and the side files not yet in DST (every one
    when ``emptied``: DST is about to be replaced)."""
    side = 0
    for rel in plan.other_files:  # the same test as finalize's, which copies only these
        path = os.path.join(plan.src, rel)
        if emptied or not copy_current(path, os.path.join(dst, side_file_target(rel))):  # OutputError naming it
            try:
                side += os.stat(path).st_size
            except OSError as e:
                raise OutputError(f"cannot read: {e.strerror}", file=path) from None
    return sum(s.bytes_out for s in todo) + side


class NoRoom(OutputError):
    """A job that does not fit (exit 4). ``plan``: what the dry run shows before the refusal."""

    plan: dict | None = None


def check_space(dst: str, need: int, freed: int = 0, at: str | None = None) -> None:
    """Refuse (exit 4) a job that does not fit; ``freed``: bytes a replacement removes first; ``at``:
    the folder whose file system DST will be on (the dry run's DST may not exist yet)."""
    free = shutil.disk_usage(at or dst).free + freed
    margin = space_margin(need)
    if free < need + margin:
        raise NoRoom(f"needs {gb(need)} (+{gb(margin)} margin) but has {gb(free)} free", file=dst)


def bytes_under(dst: str) -> int:
    """Bytes the files under DST occupy (what --overwrite's wipe frees)."""
    total = 0
    for d, _, files in os.walk(dst):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except OSError:
                pass
    return total
