"""Ends the shared Prefect API (flows.server.shared_api) once no command has used it for a while.

A command that runs a flow and found no API starts one for itself and the commands after it. Left alone, that
server (uvicorn, ~230 MB) would outlive every command for good. So it starts with this watchdog (in a session of
its own: a process group may be joined only within its session). Every command that reports to the shared API
holds a shared lock on `prefect.inuse` for its lifetime (`hold_in_use`; the kernel drops it when the command
exits, kill -9 included); the watchdog checks every `CREDITFLOW_SHARED_API_POLL_S` seconds (default 10) whether
it can take that lock exclusively. Once it could for `CREDITFLOW_SHARED_API_IDLE_S` seconds in a row (default
1800; 0 keeps the API until `creditflow server stop`), it forgets the record, stops the server's process group
and exits; it exits too when the server is gone. It starts with the server, before the server answers: a
server its launching command never recorded (that command died or was stopped while the API came up) is
stopped as soon as no command holds the in-use lock, whatever the idle limit, since no later command can find
it. A server started by `creditflow server start` has no
watchdog: the user started it and stops it.

Run as `python flows/api_idle.py SERVER_PID STATE_FILE`, or as the server's own first step (`python
flows/api_idle.py --exec STATE_FILE SERVER_COMMAND...`: it forks the watchdog, then becomes the server);
standard library and trainer/localhost.py only (it must stay small beside the server)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from pathlib import Path

# run as a script (`python flows/api_idle.py`, the server's watchdog): the checkout importable
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.localhost import pid_alive  # noqa: E402 (after the line above)

IDLE_ENV = "CREDITFLOW_SHARED_API_IDLE_S"
POLL_ENV = "CREDITFLOW_SHARED_API_POLL_S"
DEFAULT_IDLE_S = 1800.0

_held: list = []  # this process's open lock files (kept open: closing one drops its lock)


def in_use_path(state: Path) -> Path:
    return state.with_name("prefect.inuse")


def hold_in_use(state: Path) -> None:
    """Mark the shared API in use by this process until it exits (a shared lock; see the module docstring)."""
    if _held:
        return
    path = in_use_path(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a")  # noqa: SIM115 (held open for the process's life)
    fcntl.flock(fh, fcntl.LOCK_SH)
    _held.append(fh)


def idle_limit() -> float:
    try:
        return max(0.0, float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S)))
    except ValueError:
        return DEFAULT_IDLE_S


def _unused(path: Path) -> bool:
    """No command holds the in-use lock right now."""
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


def _forget(state: Path, pid: int) -> None:
    """Remove the record when it still names this server (a newer one may have replaced it)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        if json.loads(state.read_text()).get("pid") == pid:
            state.unlink()


def _names(state: Path, pid: int) -> bool:
    """The record names this server (its launcher saw it answer and recorded it for the next commands)."""
    try:
        return json.loads(state.read_text()).get("pid") == pid
    except (OSError, ValueError, TypeError, AttributeError):
        return False


UNRECORDED_POLL_S = 0.5  # while the server starts: its launcher may die before it records it


def watch(pid: int, state: Path, idle_s: float, poll_s: float) -> str:
    """Poll until the server is gone, unused for `idle_s`, or unused and not recorded (its launcher died
    while it started: no later command can find it); returns why it stopped watching. `idle_s` 0: once the
    server is recorded it is kept (until `creditflow server stop`)."""
    path = in_use_path(state)
    last_busy = time.monotonic()
    while pid_alive(pid):
        recorded = _names(state, pid)
        if recorded and idle_s == 0:
            return "kept"
        time.sleep(poll_s if recorded else min(poll_s, UNRECORDED_POLL_S))
        if not _unused(path):
            last_busy = time.monotonic()
        elif not _names(state, pid) or time.monotonic() - last_busy >= idle_s:
            _forget(state, pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)  # the server's process group (it leads its session)
            return "idle" if recorded else "abandoned"
    return "server gone"


def _watch_for(pid: int, state: Path) -> None:
    idle_s = idle_limit()
    try:
        poll_s = max(0.05, float(os.environ.get(POLL_ENV, "10")))
    except ValueError:
        poll_s = 10.0
    watch(pid, state, idle_s, min(poll_s, idle_s) if idle_s else poll_s)


def exec_server(state: Path, command: list[str]) -> None:
    """Become the server (`os.execv` of `command`) after starting this server's watchdog: a grandchild
    (double fork: init adopts it, the server need not reap it) that watches this very pid. So no server runs
    without its watchdog, however its launcher dies: a launcher killed between starting the server and starting
    a watchdog of its own had left a server no one stopped."""
    pid = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            if os.fork() == 0:  # the watchdog, under its usual command line
                os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), str(pid), str(state)])
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    os.execv(command[0], command)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--exec"]:  # api_idle.py --exec STATE COMMAND...: the server with its watchdog
        exec_server(Path(argv[1]), argv[2:])
    _watch_for(int(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
