"""What a person sees while a command works: human sizes and times, and the conversion's bar.

The bar exists from the command's first moment, saying what it waits on (the shard headers,
the workers' torch and kernel), and its clock runs on a terminal while nothing else moves; every
line is printed through it (``tqdm.write``), never onto it.
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from typing import Any, TextIO

import click

ETA_AFTER_S = 2.0  # seconds of data flowing before a rate, and so an ETA, is shown
TICK_S = 0.5       # how often a terminal's bar is redrawn while no bytes arrive (its clock moves)


def human_bytes(n: float) -> str:
    """Decimal units, three significant digits: 5.24 MB, 12.7 GB, 1.45 TB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        r = float(f"{n:.3g}")
        if abs(r) < 1000 or unit == "TB":
            break
        n /= 1000
    digits = 0 if r == 0 or unit == "B" else max(0, 2 - math.floor(math.log10(abs(r))))
    return f"{r:.{digits}f} {unit}"


def human_seconds(s: float) -> str:
    if s < 59.5:
        return f"{s:.3g} s" if s < 10 else f"{s:.1f} s"
    m, sec = divmod(round(s), 60)
    return f"{m} min {sec:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def rate_line(nbytes: int, seconds: float) -> str:
    """What the run converted, over its wall time: '5.24 MB in 0.41 s, 12.8 MB/s'."""
    if nbytes <= 0:
        return f"nothing left to convert ({human_seconds(seconds)})"
    rate = f", {human_bytes(nbytes / seconds)}/s" if seconds > 0 else ""
    return f"{human_bytes(nbytes)} in {human_seconds(seconds)}{rate}"


def eta(done: int, total: int, seconds: float) -> str | None:
    """'rate, time left' from the bytes done in the ``seconds`` since data began to flow; None
    until ETA_AFTER_S of it (before that, a rate is mostly the start-up's noise)."""
    if seconds < ETA_AFTER_S or done <= 0:
        return None
    rate = done / seconds
    return f"{human_bytes(rate)}/s, {human_seconds(max(0, total - done) / rate)} left"


def human_sizes(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` for people: every ``*bytes*`` count as a size (5.21 MB); JSON keeps the exact bytes."""
    return {k: human_bytes(v) if "bytes" in k and isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in info.items()}


class Ticker:
    """Redraws a bar every TICK_S on a terminal, so that its clock runs while nothing arrives."""

    def __init__(self, bar):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(bar,), name="k3-bar-clock", daemon=True)
        self.thread.start()

    def _run(self, bar) -> None:
        while not self.stop.wait(TICK_S):
            bar.refresh()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def bar(file: TextIO | None = None, **kw):
    """A tqdm bar on ``file`` (stderr) whose clock runs on a terminal; ``close_bar`` ends both."""
    from tqdm import tqdm  # 0.1 s: only where a bar is drawn

    file = file or sys.stderr
    b = tqdm(file=file, dynamic_ncols=True, **kw)
    b.k3_ticker = Ticker(b) if _isatty(file) else None
    return b


def close_bar(b, leave: bool = True) -> None:
    if b.k3_ticker:
        b.k3_ticker.close()
    b.leave = leave
    b.close()


def interactive() -> bool:
    """stderr is a terminal: a person is watching (lines that only say what is awaited go there)."""
    return _isatty(sys.stderr)


def _isatty(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False


def say(line: str, b=None) -> None:
    """A line on stderr, above the bar when there is one (never glued onto it)."""
    if b is None:
        click.echo(line, err=True)
    else:
        b.write(line, file=b.fp)


class Progress:
    """Turns pipeline events into a tqdm bar (bytes, GB/s, ETA) or JSON lines."""

    BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    WAIT = "{desc} [{elapsed}{postfix}]"  # before the plan: no total yet

    def __init__(self, mode: str):
        self.mode, self.bar, self.done, self.total = mode, None, 0, 0
        self.first: tuple[float, int] | None = None  # (time, bytes) of the first bytes event
        self.ready = 0  # workers that reported their kernel loaded

    def start(self) -> None:
        """At once, before anything slow: the bar, saying what the run waits on (on a terminal: in
        a log, the first line stays the plan's, and an early error the only line)."""
        if self.mode == "bar" and self.bar is None and interactive():
            self.bar = bar(desc="starting", bar_format=self.WAIT, unit="B", unit_scale=True, unit_divisor=1000,
                           postfix="reading the shard headers; workers loading torch…")

    def __call__(self, kind: str, f: dict) -> None:
        if self.mode == "json":
            click.echo(json.dumps({"event": kind, "time": round(time.time(), 3), **f}), err=True)
            return
        if self.mode == "none":
            return
        if kind == "plan" and not f["todo"]:
            self.close(leave=False)
            say(f"nothing to convert: all {f['shards']} shard(s) done")
        elif kind == "plan":
            self._plan(f)
        elif kind == "ready":
            self.ready += 1
            if self.bar is not None and self.first is None and self.total:
                self.bar.set_postfix_str("reading", refresh=False)
        elif kind == "bytes" and self.bar is not None:
            now = time.monotonic()
            if self.first is None:
                self.first = (now, self.bar.n + f["n"])  # the first bytes arrive at once: not a rate
            t0, n0 = self.first
            self.bar.set_postfix_str(eta(self.bar.n + f["n"] - n0, self.bar.total - n0, now - t0) or "", refresh=False)
            self.bar.update(f["n"])
        elif kind == "done" and self.bar is not None:
            self.done += 1
            self.bar.set_description(f"shards {self.done}/{self.total}")

    def _plan(self, f: dict) -> None:
        self.total = f["todo"]
        devices = f.get("devices") or []
        kernel = "the GPU kernel" if any(d != "cpu" for d in devices) else "the CPU kernel"
        how = f.get("workers") or f"{', '.join(sorted(set(devices)))} ({len(devices)} worker(s))"
        if self.bar is None:
            self.bar = bar(unit="B", unit_scale=True, unit_divisor=1000, desc="", bar_format=self.WAIT)
        say(f"converting {f['todo']} of {f['shards']} shards; {how}", self.bar)
        self.bar.total, self.bar.bar_format = f["bytes_in"], self.BAR
        self.bar.set_description(f"shards 0/{self.total}", refresh=False)
        self.bar.set_postfix_str("reading" if self.ready else f"loading torch and {kernel}…", refresh=True)

    def close(self, leave: bool | None = None) -> None:
        """End the bar; by default it stays on screen once it has shown shards (a run that fails
        before its plan leaves no 'starting' frame above its error)."""
        if self.bar is not None:
            close_bar(self.bar, bool(self.total) if leave is None else leave)
            self.bar = None
