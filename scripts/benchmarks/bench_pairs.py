"""Old against new, in alternating pairs: each round runs both commands, in an order that alternates,
so drift on a shared machine (other jobs, a warming page cache) falls on both sides alike.

    python scripts/benchmarks/bench_pairs.py -n 8 --warmup 1 --old "CMD" --new "CMD"

Each command runs under ``sh -c``; its CPU seconds (user + system of the child and its children,
``resource.getrusage``), wall seconds and peak resident memory are recorded. Printed: per round
the figures, then the medians and the new/old ratio of the medians and of each round (median, min,
max), as JSON with --json. A command that exits non-zero stops the run with its output.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import click


def _run(cmd: str) -> dict[str, float]:
    """One run of ``cmd``: its CPU and wall seconds and peak memory (this child's alone: wait4)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.read() if p.stdout else b""
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.stderr.write(out.decode(errors="replace"))
        raise click.ClickException(f"exit {code}: {cmd}")
    peak_kib = ru.ru_maxrss if sys.platform != "darwin" else ru.ru_maxrss / 1024
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "wall_s": wall, "peak_mib": peak_kib / 1024}


def _ratio(new: list[float], old: list[float]) -> dict[str, float]:
    per = [n / o for n, o in zip(new, old) if o > 0]
    return {"of_medians": statistics.median(new) / statistics.median(old),
            "median": statistics.median(per), "min": min(per), "max": max(per)}


@click.command()
@click.option("-n", "rounds", type=click.IntRange(min=1), default=8, show_default=True, help="Measured rounds.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Unmeasured rounds first.")
@click.option("--old", required=True, help="The reference command.")
@click.option("--new", required=True, help="The command measured against it.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def main(rounds: int, warmup: int, old: str, new: str, as_json: bool) -> None:
    """Old against new, alternating pairs; CPU seconds, wall seconds, peak memory."""
    for _ in range(warmup):
        _run(old), _run(new)
    got: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for i in range(rounds):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        for side in order:
            got[side].append(_run(old if side == "old" else new))
        if not as_json:
            o, n = got["old"][-1], got["new"][-1]
            click.echo(f"round {i + 1}: old {o['cpu_s']:.2f} s CPU {o['wall_s']:.2f} s wall, "
                       f"new {n['cpu_s']:.2f} s CPU {n['wall_s']:.2f} s wall")
    result = {
        "rounds": rounds, "warmup": warmup,
        **{f"{side}_median": {k: statistics.median(r[k] for r in got[side]) for k in ("cpu_s", "wall_s", "peak_mib")}
           for side in ("old", "new")},
        "cpu_ratio": _ratio([r["cpu_s"] for r in got["new"]], [r["cpu_s"] for r in got["old"]]),
        "wall_ratio": _ratio([r["wall_s"] for r in got["new"]], [r["wall_s"] for r in got["old"]]),
    }
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    c, w = result["cpu_ratio"], result["wall_ratio"]
    click.echo(f"new/old CPU seconds: median of rounds {c['median']:.3f} (min {c['min']:.3f}, max {c['max']:.3f}); "
               f"wall {w['median']:.3f}; peak memory {result['new_median']['peak_mib']:.0f} vs "
               f"{result['old_median']['peak_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
