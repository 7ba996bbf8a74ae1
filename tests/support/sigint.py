"""SIGINT for the processes a test starts, as a terminal gives it to a foreground command.

A background job of a non-interactive shell (``pytest ... &`` in a script, some CI runners) starts
with SIGINT ignored, and a child inherits that through exec: Python then keeps it ignored (no
KeyboardInterrupt), as it should. A test that sends SIGINT to a child means Ctrl-C at a terminal,
so the child is started with SIGINT at its default (a handled signal is reset to the default by exec)."""
from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def interruptible_children():
    """While inside, processes started get SIGINT at its default, even where this one ignores it."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
