"""CPU cost of verify's whole-DST checks and of finalize's file records, on a real DST.

Times, best of ``--repeats`` in CPU seconds of this process (all its threads; a warm-up run
first, so the page cache holds DST): ``verify DST`` (plain, with checksums), ``verify DST
--no-checksums`` (what ``upload`` runs), ``verify DST --source SRC`` (default sample), and
``finalize DST`` (which rewrites the derived files and the manifest of a complete DST).
Run it once per tree on a DST that tree made:

    PYTHONPATH=. python scripts/benchmarks/bench_verify_files.py DST SRC [--repeats 5]
    PYTHONPATH=/tmp/before python scripts/benchmarks/bench_verify_files.py DST_BEFORE SRC
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale_rule import cpu_seconds  # noqa: E402  (one timer for the CPU benchmarks)

from converter.run.finalize import finalize
from converter.verify import verify


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dst")
    ap.add_argument("src")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    runs = {
        "verify": lambda: verify(a.dst),
        "verify --no-checksums": lambda: verify(a.dst, checksums=False),
        "verify --source": lambda: verify(a.dst, a.src),
        "finalize": lambda: finalize(a.dst),
    }
    for name, fn in runs.items():
        print(f"{name:<24} {cpu_seconds(fn, a.repeats):.3f} s CPU (best of {a.repeats})")
    assert verify(a.dst, a.src).ok


if __name__ == "__main__":
    main()
