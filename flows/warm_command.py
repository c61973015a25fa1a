"""The command the warm runner forks for a caller (flows/warm.py): it takes the caller's descriptors, standard
streams, cwd, environment and argv, rebuilds what the runner's imports built from its own terminal, runs
`flows.cli.app` in-process and exits as the interpreter would; `refresh_prefect` (called by flows.cli once the
command set up its logging) gives Prefect the caller's settings."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

from flows.exiting import exit_code, finish
from flows.warm_wire import VIA


def run_command(req: dict, fds: list[int], mask: set[int | signal.Signals] | None = None) -> None:
    """The forked command: the caller's process as far as the command can tell (module docstring). It starts
    with the caller's signals blocked; `mask` (the supervisor's own) is restored once the command's handlers are
    set, and a signal held meanwhile is taken then, as the command's."""
    code = 1
    try:
        os.setpgid(0, 0)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin, sys.stdout, sys.stderr = (
            _reopen(0, "r", req["streams"][0]),
            _reopen(1, "w", req["streams"][1]),
            _reopen(2, "w", req["streams"][2]),
        )
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = list(req["argv"])
        VIA.update(runner=float(os.getppid()))
        if req.get("client_s") is not None:
            VIA["client_s"] = float(req["client_s"])
        _refresh_terminal()
        import importlib

        app = importlib.import_module("flows.cli").app  # loaded by the runner (its PRELOAD)
        try:
            if mask is not None:  # a SIGINT held: KeyboardInterrupt here (130, below); a SIGTERM: dies of it
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            app()
            code = 0
        except SystemExit as exc:
            code = exit_code(exc.code)
        except KeyboardInterrupt:
            code = 130
        finish()
    except BaseException:  # noqa: BLE001 (a bug here must reach the caller's stderr, not the runner's log)
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reopen(fd: int, mode: str, info: dict | None):
    info = info or {}
    tty = os.isatty(fd)
    buffering = 1 if (tty or mode == "w" and fd == 2) else -1
    if mode == "w" and os.environ.get("PYTHONUNBUFFERED"):
        buffering = 1
    return open(  # noqa: SIM115 (the process's own standard stream)
        fd,
        mode,
        buffering=buffering,
        encoding=info.get("encoding") or None,
        errors=info.get("errors") or None,
        closefd=False,
    )


def _refresh_terminal() -> None:
    """Objects the runner's imports built from its own terminal and environment, rebuilt from the caller's:
    the CLI's rich console (colour system, width and NO_COLOR/TERM were read when it was made)."""
    display = sys.modules.get("flows.display")
    if display is not None:
        display.console.__init__()  # in place: modules hold the object itself


def refresh_prefect() -> None:
    """In a forked command, once the CLI set this invocation's logging: Prefect's settings and logging from
    the caller's environment (the runner's import read its own). The library loggers lose the API handlers
    the runner's import gave them (Prefect gives them new ones), keeping the CLI's terminal handler."""
    if not VIA:
        return
    import prefect.context
    from prefect.logging.configuration import setup_logging
    from prefect.settings import PREFECT_LOGGING_EXTRA_LOGGERS

    for name in PREFECT_LOGGING_EXTRA_LOGGERS.value():
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if h.get_name() != "creditflow-console"]:
            logger.removeHandler(handler)
    prefect.context.refresh_global_settings_context()
    setup_logging(incremental=False)
