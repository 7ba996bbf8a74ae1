"""How soon each k3convert command answers, and how soon it exits after its last line.

Each command runs in a pseudo-terminal (as a user sees it: the bar drawn, stdout and stderr
together), in its own process group. Per run: seconds from start to the first output, from start
to the last output, from the last output to the process's exit, and how many processes outlived
it (workers, resource trackers: this script is their subreaper, so each is counted). Run it once per tree:

    PYTHONPATH=. python scripts/benchmarks/bench_cli_latency.py [--repeats 2] [--only demo,inspect]
    PYTHONPATH=/tmp/base python scripts/benchmarks/bench_cli_latency.py   # a worktree of an older commit

Every command works in a fresh temporary folder (removed after). Timings on a shared machine
vary: give ``--repeats`` and say how loaded the machine was.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import pty
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time

K3 = [sys.executable, "-m", "converter"]


def subreaper() -> None:
    """Adopt whatever outlives a command (Linux PR_SET_CHILD_SUBREAPER): counted, however briefly."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def outlived(command: int) -> int:
    """Processes that outlived ``command`` (now this process's adopted children), reaped."""
    n = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            return n
        n += pid != command


def timed(argv: list[str], cwd: str, timeout: float = 900) -> dict:
    """Run ``argv`` on a pty in a new session; time its output and exit."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, start_new_session=True,
                         close_fds=True)
    os.close(slave)
    first = last = None
    text = b""
    while True:
        r, _, _ = select.select([master], [], [], 0.05)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every holder of the pty's other end is gone
                chunk = b""
            if not chunk:
                break
            now = time.monotonic()
            if chunk.strip():
                first = first or now
                last = now
            text += chunk
        if time.monotonic() - t0 > timeout:
            os.killpg(p.pid, signal.SIGKILL)
            break
        if p.poll() is not None and not r:
            break
    rc = p.wait()
    t_exit = time.monotonic()  # close to the exit: the loop above polls every 50 ms at most
    os.close(master)
    return {"rc": rc, "first": (first or t_exit) - t0, "last": (last or t_exit) - t0,
            "linger": t_exit - (last or t_exit), "left": outlived(p.pid), "text": text.decode(errors="replace")}


def commands(work: str) -> dict[str, list[list[str]]]:
    """name: setup commands (untimed) then the timed one, all run in ``work``."""
    fix, out = ["make-fixture", "src"], ["mxfp4-to-int4", "src", "-o", "dst", "--workers", "1"]
    return {
        "--help": [["--help"]],
        "make-fixture": [fix],
        "make-fixture --real-dims --layers 2 --experts 2": [["make-fixture", "big", "--real-dims", "--layers", "2",
                                                             "--experts", "2", "--shards", "2"]],
        "mxfp4-to-int4 --dry-run": [fix, out + ["--dry-run"]],
        "mxfp4-to-int4": [fix, out],
        "inspect SRC": [fix, ["inspect", "src"]],
        "verify DST": [fix, out, ["verify", "dst"]],
        "demo --dir": [["demo", "--dir", "d"]],
        "convert (a typo)": [["convert", "src"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma list of command names (see the table)")
    a = ap.parse_args()
    subreaper()
    print(f"{'command':<50} {'first line':>10} {'last line':>10} {'exit after':>10} {'left':>5}  rc")
    root = tempfile.mkdtemp(prefix="k3bench-")
    try:
        for name, steps in commands(root).items():
            if a.only and name not in a.only.split(","):
                continue
            runs = []
            for i in range(a.repeats):
                work = os.path.join(root, f"{len(runs)}-{abs(hash(name))}")
                os.makedirs(work)
                for setup in steps[:-1]:
                    subprocess.run(K3 + setup, cwd=work, check=True, capture_output=True)
                outlived(0)  # what the set-up left is not the timed command's
                runs.append(timed(K3 + steps[-1], work))
                shutil.rmtree(work)
            best = min(runs, key=lambda r: r["first"])
            worst_linger = max(r["linger"] for r in runs)
            print(f"{name:<50} {best['first']:>9.2f}s {min(r['last'] for r in runs):>9.2f}s "
                  f"{worst_linger:>9.2f}s {max(r['left'] for r in runs):>5}  {best['rc']}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
