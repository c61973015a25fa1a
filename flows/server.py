"""The managed Prefect server: `creditflow server start|stop|status`, and the API a command shares with the next.

Prefect's ephemeral API is a uvicorn subprocess that imports Prefect's server, checks the database's migrations
and starts its services: 4-6 s of CPU, paid by every command that started its own and stopped it again (issue
36: 9.5-14.4 s wall for a small new round on 2 cores, 4.0 s with a server up). So the API runs once per machine:

- `creditflow server start` starts Prefect's server with its UI in the background (its own session, its log
  under $CREDITFLOW_CACHE/services/);
- otherwise the first command that runs a flow starts the same API without the UI (`shared_api`: the command
  Prefect's ephemeral server runs, in a session of its own) and leaves it running for the next one; it says so
  in one line. It stops by itself once no command has used it for CREDITFLOW_SHARED_API_IDLE_S seconds
  (default 1800; flows/api_idle.py), so no server outlives its use for long. CREDITFLOW_NO_SERVER=1 (the test
  suite), or `CREDITFLOW_SHARED_API=0`, keeps Prefect's ephemeral API per command instead.

Either is recorded in $CREDITFLOW_CACHE/services/prefect.json; every later command uses it when PREFECT_API_URL
is not set and it answers its health check: flow runs, task runs and logs then show in one place.
`creditflow server stop` ends it (its whole process group)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from flows.api_idle import hold_in_use, idle_limit
from flows.api_launch import (
    API_APP,
    ServerInfo,
    StartLock,
    drop_prelaunched,
    healthy,
    launch,
    may_share,
    read_state,
    state_path,
    take_prelaunched,
)
from trainer.llm.service import kill
from trainer.localhost import pid_alive


def running() -> ServerInfo | None:
    """The recorded server if its process lives and its API answers."""
    info = read_state()
    if info is None or not pid_alive(info.pid) or not healthy(info.url, timeout=1.0):
        return None
    return info


def wait_started(
    proc: subprocess.Popen, url: str, log: Path, ui: bool = True, timeout_s: float = 120.0
) -> ServerInfo:
    """Wait until the launched server answers, record it (prefect.json) and return it; stop it and raise
    RuntimeError when it exits or does not answer within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    up = False
    try:
        while time.monotonic() < deadline and not up:
            if proc.poll() is not None:
                raise RuntimeError(f"the Prefect server exited with status {proc.returncode}; see {log}")
            up = healthy(url, timeout=1.0)
            if not up:
                time.sleep(0.05)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C while it starts: nobody could find it later
        kill(proc.pid, grace_s=5)
        raise
    if up:
        info = ServerInfo(pid=proc.pid, url=url, log=str(log), started=time.time(), ui=ui)
        tmp = state_path().with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(info)))
        tmp.replace(state_path())
        start_runner(info)  # it imports once this command has exited (flows/warm_runner.py)
        return info
    kill(proc.pid, grace_s=5)
    raise RuntimeError(f"the Prefect server did not answer within {timeout_s:.0f} s; see {log}")


def start_runner(info: ServerInfo) -> bool:
    """The warm runner beside the server (flows/warm.py: `process` without importing Prefect each time), unless
    one runs or runners are off; its log next to the server's."""
    from flows.warm import ensure_runner

    return ensure_runner(info.pid, state_path(), Path(info.log).with_name("runner.log"))


def start(port: int | None = None, timeout_s: float = 120.0, ui: bool = True) -> tuple[ServerInfo, bool]:
    """Start the server in the background unless one is running; returns (info, started_now)."""
    with StartLock():
        info = running()
        if info is not None:
            start_runner(info)  # one that exited (its sources changed) starts again
            return info, False
        proc, url, log = launch(port, ui)
        return wait_started(proc, url, log, ui, timeout_s), True


def _is_prefect_server(pid: int) -> bool:
    """The process runs `prefect server start` (what `start` launched), read from /proc/<pid>/cmdline."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return (b"prefect" in args and b"server" in args) or API_APP.encode() in args


def stop() -> ServerInfo | None:
    from flows.warm import stop_runner

    stop_runner()  # it would also exit within seconds of the server
    info = read_state()
    if info is None:
        return None
    if pid_alive(info.pid) and _is_prefect_server(info.pid):  # a stale record's pid may be another's now
        kill(info.pid, grace_s=10)
    try:
        state_path().unlink()
    except OSError:
        pass
    return info


def use_running_server() -> str | None:
    """Point this process at the managed server when it runs and the user named no other (PREFECT_API_URL);
    call before Prefect reads its settings. Returns the URL used, or None."""
    if os.environ.get("PREFECT_API_URL") or os.environ.get("CREDITFLOW_NO_SERVER") == "1":
        return None
    info = read_state()  # the cheap check first: no state file, no HTTP
    if info is None or not pid_alive(info.pid) or not healthy(info.url, timeout=0.5):
        return None
    os.environ["PREFECT_API_URL"] = info.url
    hold_in_use(state_path())
    start_runner(info)  # this command runs in its own process: the next one need not
    return info.url


def shares_api() -> bool:
    """Whether a command that runs a flow starts an API for the next ones when none runs (`shared_api`): not
    when this process has an API named (PREFECT_API_URL, from the environment or the Prefect profile) or keeps
    Prefect's ephemeral one."""
    if not may_share(os.environ):  # the environment's part, the same test as the CLI's early launch
        return False
    from prefect.settings import PREFECT_API_URL  # a profile's or a prefect.toml's URL

    return not PREFECT_API_URL.value()


class SharedAPI:
    """The API a command starts for itself and the commands after it (module docstring): launched at once,
    waited for with `url()` (the command prepares its round meanwhile)."""

    def __init__(self) -> None:
        self.info: ServerInfo | None = None
        self._proc: subprocess.Popen | None = None
        early = take_prelaunched()  # launched by the CLI's first lines (flows/api_launch.py), lock held
        if early is not None:
            self._lock, self._proc, self._url, self._log = early.lock, early.proc, early.url, early.log
            return
        self._lock = StartLock()
        self._lock.acquire()  # released once the server answers (or failed): a second command then finds it
        self.info = running()
        if self.info is None:
            self._proc, self._url, self._log = launch(ui=False)
        else:
            self._lock.release()

    @property
    def started_here(self) -> bool:
        return self._proc is not None

    def url(self) -> str:
        """Its URL once it answers; this process's flows report to it (PREFECT_API_URL)."""
        if self.info is None:
            assert self._proc is not None  # __init__ launched one when none ran
            try:
                self.info = wait_started(self._proc, self._url, self._log, ui=False)
            finally:
                self._lock.release()
        os.environ["PREFECT_API_URL"] = self.info.url
        hold_in_use(state_path())
        return self.info.url


def shared_api() -> SharedAPI | None:
    """The recorded server when it answers, else one started now and left running for the next command; None
    when this process has an API named (PREFECT_API_URL) or keeps Prefect's ephemeral one (`shares_api`)."""
    if shares_api():
        return SharedAPI()
    drop_prelaunched()  # the Prefect profile names an API: the one launched first thing is not needed
    return None


def api_url(say=None, while_starting=None) -> str | None:
    """The API this process's flows report to: the recorded server, else a shared one started now (`say`
    gets the one line telling so; `while_starting()` runs meanwhile); None: Prefect's own choice
    (PREFECT_API_URL, or its ephemeral API)."""
    url = use_running_server()
    api = None if url else shared_api()
    if while_starting is not None:
        while_starting()
    if api is None:
        return url
    url = api.url()
    if api.started_here and say is not None:
        limit = idle_limit()
        idle = "never" if limit == 0 else f"{limit / 60:g} min" if limit >= 60 else f"{limit:g} s"
        say(STARTED.format(url=url, idle=idle))
    return url


STARTED = (
    "started a Prefect API at {url} for this and later commands "
    "(it stops after {idle} unused, or `creditflow server stop`; CREDITFLOW_SHARED_API=0: one per command)"
)
