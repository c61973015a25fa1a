"""Launching the machine's Prefect API, and launching it first thing when a command will need it (issue 36).

The API server (flows/server.py) costs 3.4-4.5 s of CPU to come up, most of it importing Prefect's server
(2.4 s). A `creditflow process` that found no API up used to launch it only when its flow was about to run:
after its own imports and the round's up-to-date check, 2-5 s into the command, so the two start-ups ran one
after the other. `prelaunch(argv)` launches it from the CLI's first lines instead (flows.cli, before any heavy
import), so the server's start-up and the command's own run side by side on two cores; `flows.server.SharedAPI`
adopts the launched server when the flow needs it. A command that ends without needing it (the round was up to
date, a usage error, `--help`) stops it again at exit: only a server some command waited for is recorded and
shared.

Standard library only: the CLI imports it before anything heavy. flows/server.py holds the rest (waiting,
recording, stopping, the watchdog and the warm runner beside it)."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from flows.api_idle import hold_in_use
from flows.warm_wire import command_name, services_folder
from trainer.localhost import free_port, healthy

STATE = "prefect.json"
API_APP = "prefect.server.api.server:create_app"  # what Prefect's ephemeral API server runs (uvicorn)
# the API's task-run recorder writes task runs in batches (up to 100 events, flushed every second) instead of
# one database transaction per state event: a round's task runs send three events each
API_ENV = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}
PRELAUNCH_COMMANDS = ("process",)  # the commands whose flow reports to the machine's API


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    url: str  # the API URL, http://127.0.0.1:PORT/api
    log: str
    started: float
    ui: bool = True  # False: the API alone, started by a command (`shared_api`)


def state_path() -> Path:
    return services_folder() / STATE


def read_state() -> ServerInfo | None:
    try:
        return ServerInfo(**json.loads(state_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _server_command(port: int, ui: bool) -> list[str]:
    if ui:
        return [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    import importlib.util

    spec = importlib.util.find_spec("prefect")  # its folder, without importing Prefect (a second of CPU)
    app_dir = Path(next(iter(spec.submodule_search_locations or []))).parent if spec else Path(".")
    # `python -m uvicorn` with the same arguments, the app's module imported without GC passes
    return [
        sys.executable,
        str(Path(__file__).with_name("api_serve.py")),
        "--app-dir",
        str(app_dir),
        "--factory",
        API_APP,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]


class StartLock:
    """One command at a time starts a server (two `process` started together share one): an exclusive flock on
    prefect.lock beside the record, held until the server answers (or failed)."""

    def __init__(self) -> None:
        self._fh: IO[str] | None = None

    def acquire(self, wait: bool = True) -> bool:
        path = state_path().with_suffix(".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a")  # noqa: SIM115 (held past this call; closing it releases the lock)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            fh.close()
            return False
        self._fh = fh
        return True

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> StartLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def launch(port: int | None = None, ui: bool = True) -> tuple[subprocess.Popen, str, Path]:
    """Start a server process in the background (its own session: it outlives this command, stopped as a
    group); returns (process, API URL, log). `flows.server.wait_started` waits for it and records it."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/api"
    log = state_path().with_name("prefect-server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if ui:
        env["PREFECT_UI_ENABLED"] = env.get("PREFECT_UI_ENABLED", "true")
    else:
        env.update({"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1"})
        env.update({k: v for k, v in API_ENV.items() if k not in os.environ})
    if not ui:
        hold_in_use(state_path())  # this command uses it from now: its watchdog stops it once none does
    command = _server_command(port, ui)
    if not ui:  # the server starts its watchdog itself, before it becomes the server (flows/api_idle.py)
        idle = str(Path(__file__).with_name("api_idle.py"))
        command = [sys.executable, idle, "--exec", str(state_path()), *command]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    return proc, url, log


@dataclass
class Launched:
    """A shared API launched by this process and not yet waited for: its start lock is held."""

    lock: StartLock
    proc: subprocess.Popen
    url: str
    log: Path


_early: dict[str, Launched] = {}


def may_share(env: dict[str, str] | os._Environ) -> bool:
    """This environment leaves the API to the machine's shared one (flows.server.shares_api, less the Prefect
    profile's URL, which only Prefect's settings read: a launch it makes needless is stopped again)."""
    return not (
        env.get("PREFECT_API_URL")
        or env.get("CREDITFLOW_NO_SERVER") == "1"
        or env.get("CREDITFLOW_SHARED_API", "1") == "0"
    )


def prelaunch(argv: list[str]) -> bool:
    """Launch the shared API now when `argv` is a command that runs a flow, the environment shares the API, no
    recorded API answers and no other command is starting one (its start lock is free); True when launched.
    Never waits: the command adopts it (`take_prelaunched`) or it is stopped at exit."""
    rest = argv[1:]
    if _early or command_name(rest) not in PRELAUNCH_COMMANDS or {"--help", "-h"} & set(rest):
        return False
    if not may_share(os.environ):
        return False
    info = read_state()
    if info is not None and healthy(info.url, timeout=0.5):
        return False
    lock = StartLock()
    if not lock.acquire(wait=False):  # another command is starting one: this one waits for it later
        return False
    info = read_state()  # recorded while this process looked
    if info is not None and healthy(info.url, timeout=0.5):
        lock.release()
        return False
    proc, url, log = launch(ui=False)
    _early["api"] = Launched(lock, proc, url, log)
    atexit.register(drop_prelaunched)
    return True


def take_prelaunched() -> Launched | None:
    """The API `prelaunch` started, now the caller's to wait for, record and release; None when none."""
    return _early.pop("api", None)


def drop_prelaunched() -> None:
    """Stop an API launched by `prelaunch` that no one adopted (its process group) and free the start lock."""
    early = _early.pop("api", None)
    if early is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(early.proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        early.proc.wait(timeout=5)
    if early.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(early.proc.pid, signal.SIGKILL)
        early.proc.wait()
    early.lock.release()
