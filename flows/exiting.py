"""Ending a creditflow process the way the interpreter ends it, less the teardown.

A command that ran a flow has ~2,000 modules loaded (Prefect, pyarrow, polars, deltalake, DuckDB): the
interpreter's own finalization then frees every module and object one by one, 0.2-0.7 s after the command's
work and its summary are done (py-spy of a cold `creditflow process`: the main thread without Python frames for
the last ~0.7 s). `exit_now` does what the interpreter does first at exit, and stops there:

1. `threading._shutdown()`: the threads' exit hooks (Prefect's log and event workers drain to the API there),
   then a wait for every non-daemon thread;
2. the `atexit` handlers (logging's flush and close, weakref finalizers, an unadopted prelaunched API's stop);
3. the standard streams flushed;

then `os._exit(code)`. Files the project holds open past a block are lock files (nothing buffered), and every
lake write is closed and renamed into place before its task ends, so the teardown has nothing left to save.
Standard library only."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_code(code: object) -> int:
    """The process's exit status for `SystemExit(code)`, as the interpreter makes it (a message: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# Prefect's queue services (its run-log and event workers) drain at exit and, when items are still queued then
# (a loaded machine), warn "Still processing items: N items remaining..." on stderr: the command still waits for
# them, so the line is noise, and it made a failing command's one-line error two lines (the clean-clone CI of
# a585535 under load 5). Kept when their level was lowered to DEBUG (--log-level debug).
DRAIN_LOGGERS = ("EventsWorker", "APILogWorker")


def finish() -> None:
    """What the interpreter runs at exit before its teardown: the threads' exit hooks and their join, then the
    atexit handlers; the standard streams flushed."""
    for name in DRAIN_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() > logging.DEBUG:
            logger.setLevel(logging.ERROR)
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # an interpreter without it: wait for the non-daemon threads at least
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def exit_now(code: object) -> NoReturn:
    """End the process with `SystemExit(code)`'s status after `finish`, without the interpreter's teardown."""
    status = exit_code(code)
    finish()
    os._exit(status)
