"""Leave the process at once when a command is done.

A process that imported torch and numba spends 1-3 s tearing them down after its last line
(module finalization), and multiprocessing's resource tracker outlives it by a moment in its
process group. The command line exits through ``leave`` instead: what Python's exit does that
matters (thread pools stopped and non-daemon threads joined, multiprocessing's finalizers,
streams flushed), then ``os._exit``. Only ``main()`` called with the process's own arguments comes here: library use,
click's test runner and scripts that pass arguments exit as click does.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import NoReturn


def exit_status(code: object) -> int:
    """``sys.exit``'s rule: None is 0, a number is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def leave(code: object) -> NoReturn:
    status = exit_status(code)
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter's exit does first:
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()  # its atexit calls (idle thread pools told to stop), then non-daemon threads joined
    if "multiprocessing" in sys.modules:
        from multiprocessing import resource_tracker, util
        # private, so absent from typeshed's stubs: workers joined, queues closed, semaphores released (atexit's job)
        util._exit_function()  # type: ignore[attr-defined]
        stop = getattr(resource_tracker._resource_tracker, "_stop", None)
        if stop is not None:  # the tracker exits now, not after us (Python >= 3.8; private)
            stop()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
