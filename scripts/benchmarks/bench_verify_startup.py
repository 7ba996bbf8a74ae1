"""Wall time and peak RSS of ``k3convert verify DST`` (and of ``verify`` of a missing path) as a
user runs it: a fresh interpreter each time, this tree against an older one, runs alternating.

    python scripts/benchmarks/bench_verify_startup.py DST --old /tmp/base-verify --runs 5

DST: e.g. the output of ``k3convert demo --dir D`` (D/kimi-k3-fixture-int4). Issue 24 §2.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one(tree: str, args: list[str]) -> tuple[float, float, int]:
    """(wall s, peak RSS MB, exit code) of ``python -m converter ARGS`` importing ``tree``'s converter."""
    env = {**os.environ, "PYTHONPATH": tree}
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "converter", *args], env=env, cwd="/",  # not this checkout
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return wall, usage.ru_maxrss / 1024, p.returncode


def which(tree: str) -> str:
    """The converter package a run with ``tree`` imports (a check that the trees differ)."""
    env = {**os.environ, "PYTHONPATH": tree}
    return subprocess.run([sys.executable, "-c", "import converter; print(converter.__file__)"], env=env, cwd="/",
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dst")
    ap.add_argument("--old", help="another checkout's root (its converter/ is imported for the 'old' runs)")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    trees = [("new", HERE)] + ([("old", os.path.abspath(a.old))] if a.old else [])
    for name, tree in trees:
        print(f"{name}: {which(tree)}")
    cases = [("verify DST", ["verify", a.dst]), ("verify /nonexistent", ["verify", "/nonexistent/k3convert-bench"])]
    for label, args in cases:
        got: dict[str, list[tuple[float, float, int]]] = {n: [] for n, _ in trees}
        for _ in range(a.runs):  # alternating, so that the machine's load falls on both alike
            for name, tree in trees:
                got[name].append(one(tree, args))
        for name, _ in trees:
            walls, rss, codes = zip(*got[name])
            print(f"{label:<20} {name}: wall median {statistics.median(walls):.2f} s (min {min(walls):.2f}, "
                  f"max {max(walls):.2f}), peak RSS {max(rss):.0f} MB, exit {sorted(set(codes))}")


if __name__ == "__main__":
    main()
