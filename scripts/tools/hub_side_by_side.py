"""Two conversions of one Hub repository sharing one cache, started side by side, N rounds (issue 40, H1).

Each round: a fresh cache; conversion A starts; once A has downloaded its first shard (fetched, not
yet converted: where a0896fb's shared view was re-stubbed under it), conversion B starts, into
another DST (``--mode two-dsts``), or into A's DST (``--mode same-dst``: B may be refused in one line,
exit 4), or as a ``--dry-run`` (``--mode dry-run``); ``--mode mixed`` cycles through the three. Every
finished output is compared, file by file, with the local conversion of the same files
(tests/support/hub_runs.py ``assert_same_output``). Prints one line per round and a summary; exit 1
if any round differed or failed.

    PYTHONPATH=. python scripts/tools/hub_side_by_side.py --rounds 20 --mode mixed
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support")]   # the package, the tests' helpers

from hub_runs import REPO, SHARDS, assert_same_output, cli  # noqa: E402
from hub_server import HubServer  # noqa: E402

from converter.fixture import FixtureSpec, make_fixture  # noqa: E402

MODES = ("two-dsts", "same-dst", "dry-run")


def one_round(src: str, local: str, work: str, mode: str, rate: float) -> str:
    cache, a_dst, b_dst = (os.path.join(work, x) for x in ("cache", "a", "b"))
    with HubServer(rate=rate, lifetime=600) as hub:
        hub.add(REPO, src)
        a = cli(["mxfp4-to-int4", REPO, "-o", a_dst], hub, cache, wait=False)
        first = os.path.getsize(os.path.join(src, SHARDS[0]))
        deadline = time.monotonic() + 120
        while hub.bytes_sent.get(SHARDS[0], 0) < first:
            if a.poll() is not None or time.monotonic() > deadline:
                return f"A ended early: {a.communicate()[1].strip()}"
            time.sleep(0.01)
        args = {"two-dsts": ["-o", b_dst], "same-dst": ["-o", a_dst],
                "dry-run": ["-o", b_dst, "--dry-run"]}[mode]
        rb = cli(["mxfp4-to-int4", REPO, *args], hub, cache)
        out, err = a.communicate(timeout=300)
    if a.returncode != 0:
        return f"A exit {a.returncode}: {err.strip()}"
    assert_same_output(local, a_dst)   # AssertionError names the differing file
    if mode == "same-dst" and rb.returncode != 0:
        lines = rb.stderr.strip().splitlines()
        if rb.returncode != 4 or len(lines) != 1:
            return f"B exit {rb.returncode}: {rb.stderr.strip()}"
        return f"A identical; B refused in one line: {lines[0][-70:]}"
    if rb.returncode != 0:
        return f"B exit {rb.returncode}: {rb.stderr.strip()}"
    if mode == "two-dsts":
        assert_same_output(local, b_dst)
        return "A and B identical to the local conversion"
    return "A identical to the local conversion" + ("; B too" if mode == "same-dst" else "; the dry run succeeded")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--mode", choices=(*MODES, "mixed"), default="two-dsts")
    ap.add_argument("--rate", type=float, default=1_500_000, help="bytes/s the local Hub serves (all downloads)")
    args = ap.parse_args()
    os.environ.setdefault("K3CONVERT_WORKERS", "1")
    with tempfile.TemporaryDirectory(prefix="k3-side-by-side-") as tmp:
        src, local = os.path.join(tmp, "kimi"), os.path.join(tmp, "local")
        make_fixture(src, FixtureSpec(layers=3, experts=4, shards=3, seed=7))
        r = cli(["mxfp4-to-int4", src, "-o", local])
        if r.returncode != 0:
            print(r.stderr)
            return 1
        bad = 0
        for i in range(args.rounds):
            mode = MODES[i % len(MODES)] if args.mode == "mixed" else args.mode
            work = os.path.join(tmp, f"round{i}")
            os.makedirs(work)
            t = time.monotonic()
            try:
                said = one_round(src, local, work, mode, args.rate)
                ok = said.startswith("A identical") or said.startswith("A and B identical")
            except AssertionError as e:
                said, ok = f"DIFFERS from the local conversion: {str(e).splitlines()[0]}", False
            bad += not ok
            print(f"round {i + 1:2d} {mode:9s} {time.monotonic() - t:5.1f} s  {'ok ' if ok else 'BAD'} {said}",
                  flush=True)
            shutil.rmtree(work, ignore_errors=True)
    print(f"{args.rounds - bad}/{args.rounds} rounds identical to the local conversion (or B refused in one line)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
