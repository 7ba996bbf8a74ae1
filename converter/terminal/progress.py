"""What a person sees while a command works: human sizes and times, and the conversion's bar.

The bar exists from the command's first moment, saying what it waits on (the shard headers,
the workers' torch and kernel), and its clock runs on a terminal while nothing else moves; every
line is printed through it (``tqdm.write``), never onto it. Where stderr is a file or a pipe the
bar is a plain line every LINE_EVERY_S (a log never holds carriage returns); quiet (``-q``,
K3CONVERT_QUIET), TQDM_DISABLE or HF_HUB_DISABLE_PROGRESS_BARS turn bars off (``Output``).
"""
from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import sys
import threading
import time
from typing import Any, Iterator, TextIO

import click

ETA_AFTER_S = 2.0  # seconds of data flowing before a rate, and so an ETA, is shown
TICK_S = 0.5       # how often a terminal's bar is redrawn while no bytes arrive (its clock moves)
LINE_EVERY_S = 5.0  # how often a bar that is not on a terminal prints its line

QUIET_ENV = "K3CONVERT_QUIET"
HF_BARS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"
BARS_OFF_ENV = (QUIET_ENV, "TQDM_DISABLE", HF_BARS_ENV)  # the ecosystem's switches, and ours
_quiet = False  # set by the command group's -q/--quiet for the command's duration


class Output(enum.Enum):
    """How progress is shown on a stream."""

    BAR = "bar"      # a terminal: a tqdm bar redrawn in place
    LINES = "lines"  # a file or pipe: a plain line every LINE_EVERY_S
    OFF = "off"      # quiet, or a bars-off switch set: nothing


def env_true(name: str) -> bool:
    """An on/off switch in the environment, read as Hugging Face reads its own: 1, true, yes, on."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def set_quiet(on: bool) -> None:
    global _quiet
    _quiet = bool(on)


def quiet() -> bool:
    """No bars and no status lines on stderr (results on stdout, errors and JSON events stay)."""
    return _quiet or env_true(QUIET_ENV)


def output(file: TextIO | None = None) -> Output:
    if quiet() or any(env_true(v) for v in BARS_OFF_ENV):
        return Output.OFF
    return Output.BAR if _isatty(file or sys.stderr) else Output.LINES


@contextlib.contextmanager
def libraries_quiet() -> Iterator[None]:
    """Hugging Face Hub's own bars (an upload's) off too while a quiet command runs: through its
    variable for a hub imported later (the command line), through its switch for one imported."""
    old = os.environ.get(HF_BARS_ENV)
    os.environ[HF_BARS_ENV] = "1"
    hub = sys.modules.get("huggingface_hub.utils")
    was_off = hub.are_progress_bars_disabled() if hub is not None else True
    if hub is not None and not was_off:
        hub.disable_progress_bars()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(HF_BARS_ENV, None)
        else:
            os.environ[HF_BARS_ENV] = old
        if hub is not None and not was_off:
            hub.enable_progress_bars()


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
    """Redraws a bar every ``every`` seconds (TICK_S on a terminal, so that its clock runs while
    nothing arrives; LINE_EVERY_S in a log, where each redraw is a line)."""

    def __init__(self, bar, every: float = TICK_S):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(bar, every), name="k3-bar-clock", daemon=True)
        self.thread.start()

    def _run(self, bar, every: float) -> None:
        while not self.stop.wait(every):
            bar.refresh()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class LineBar:
    """The bar where it is not drawn: tqdm's attributes and methods that the commands use, shown
    as a plain line every LINE_EVERY_S and once more at the end when it stays (``leave``), or
    never (``silent``: Output.OFF). Lines printed through it (``write``) are printed as they are."""

    def __init__(self, file: TextIO, total: float | None = None, desc: str = "", unit: str = "",
                 postfix: str | None = None, silent: bool = False, **_tqdm_only: Any):
        self.fp, self.total, self.desc, self.unit, self.postfix = file, total, desc, unit, postfix or ""
        self.n: float = 0
        self.leave, self.silent, self.bar_format = True, silent, None
        self.k3_ticker: Ticker | None = None   # set by bar()
        self.start_t = time.monotonic()
        self.lock = threading.Lock()

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        self.desc = desc

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def line(self) -> str:
        """'shards 1/3: 44%, 2.31 MB of 5.21 MB, 5.02 s, 1.2 MB/s, 2.4 s left'; without a total, the step
        and its time."""
        count = human_bytes if self.unit == "B" else (lambda x: f"{x:g}")
        took = human_seconds(time.monotonic() - self.start_t)
        if not self.total:  # a step, not a count: 'from source: recomputing every file from SRC (5.0 s)'
            return f"{self.desc} ({', '.join([took] + ([self.postfix] if self.postfix else []))})"
        parts = [f"{100 * self.n / self.total:.0f}%", f"{count(self.n)} of {count(self.total)}", took]
        return (f"{self.desc}: " if self.desc else "") + ", ".join(parts + ([self.postfix] if self.postfix else []))

    def refresh(self) -> None:
        if not self.silent:
            self.write(self.line())

    def write(self, s: str, file: TextIO | None = None) -> None:
        with self.lock:
            click.echo(s, file=file or self.fp)

    def close(self) -> None:
        if self.leave and self.total:
            self.refresh()


def bar(file: TextIO | None = None, **kw):
    """A bar on ``file`` (stderr) as ``output`` says: a tqdm bar whose clock runs on a terminal,
    a ``LineBar`` elsewhere; ``close_bar`` ends it and its clock."""
    file = file or sys.stderr
    how = output(file)
    if how is not Output.BAR:
        b = LineBar(file, silent=how is Output.OFF, **kw)
        b.k3_ticker = Ticker(b, LINE_EVERY_S) if how is Output.LINES else None
        return b
    from tqdm import tqdm  # 0.1 s: only where a bar is drawn

    width = {} if _columns(file) else {"ncols": 80, "nrows": 24}  # a terminal of no size (`script` into a
    # pipe, some containers): tqdm would draw nothing
    b = tqdm(file=file, dynamic_ncols=not width, disable=False, **width, **kw)  # TQDM_DISABLE=0: drawn
    b.k3_ticker = Ticker(b)
    return b


def _columns(file: TextIO) -> int:
    """The terminal's width, 0 when it reports none."""
    try:
        return os.get_terminal_size(file.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


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
    """A status line on stderr, above the bar when there is one (never glued onto it); none when quiet."""
    if quiet():
        return
    if b is None:
        click.echo(line, err=True)
    else:
        b.write(line, file=b.fp)


class Status:
    """What a command does now, for as long as it does it (``verify``'s checks): a bar with no
    total, its clock running, gone when the step ends (``bar``: in a log, a line every LINE_EVERY_S)."""

    FORMAT = "{desc} [{elapsed}]"

    def __init__(self) -> None:
        self.bar: Any = None   # bar(): a tqdm bar or a LineBar

    def start(self, doing: str) -> None:
        self.end()
        self.bar = bar(desc=doing, bar_format=self.FORMAT)

    def end(self) -> None:
        if self.bar is not None:
            close_bar(self.bar, leave=False)
            self.bar = None


class Progress:
    """Turns pipeline events into a tqdm bar (bytes, GB/s, ETA) or JSON lines."""

    BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    WAIT = "{desc} [{elapsed}{postfix}]"  # before the plan: no total yet

    def __init__(self, mode: str):
        self.bar: Any = None   # bar(): a tqdm bar or a LineBar
        self.mode, self.done, self.total = mode, 0, 0
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
