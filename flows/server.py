"""The managed Prefect server: `creditflow server start|stop|status`.

Without a server every `creditflow process` starts Prefect's ephemeral API (a uvicorn subprocess, database
migrations, seconds of CPU) and stops it again. A server started once with `creditflow server start` keeps
running in the background (its own session, its log under $CREDITFLOW_CACHE/services/), its URL is recorded in
$CREDITFLOW_CACHE/services/prefect.json, and every later command uses it automatically when PREFECT_API_URL is
not set and the recorded server answers its health check: flow runs, task runs and logs then show in its UI.
`creditflow server stop` ends it (its whole process group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.llm.service import cache_root, free_port, kill, pid_alive

STATE = "prefect.json"


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    url: str  # the API URL, http://127.0.0.1:PORT/api
    log: str
    started: float


def state_path() -> Path:
    return cache_root() / "services" / STATE


def read_state() -> ServerInfo | None:
    try:
        return ServerInfo(**json.loads(state_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def healthy(url: str, timeout: float = 1.0) -> bool:
    import httpx

    try:
        return httpx.get(url.rstrip("/") + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def running() -> ServerInfo | None:
    """The recorded server if its process lives and its API answers."""
    info = read_state()
    if info is None or not pid_alive(info.pid) or not healthy(info.url):
        return None
    return info


def start(port: int | None = None, timeout_s: float = 120.0) -> tuple[ServerInfo, bool]:
    """Start the server in the background unless one is running; returns (info, started_now)."""
    info = running()
    if info is not None:
        return info, False
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/api"
    log = state_path().with_name("prefect-server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env["PREFECT_UI_ENABLED"] = env.get("PREFECT_UI_ENABLED", "true")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: outlives this command, stopped as a group
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with status {proc.returncode}; see {log}")
        if healthy(url):
            info = ServerInfo(pid=proc.pid, url=url, log=str(log), started=time.time())
            tmp = state_path().with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(asdict(info)))
            tmp.replace(state_path())
            return info, True
        time.sleep(0.25)
    kill(proc.pid, grace_s=5)
    raise RuntimeError(f"the Prefect server did not answer within {timeout_s:.0f} s; see {log}")


def _is_prefect_server(pid: int) -> bool:
    """The process runs `prefect server start` (what `start` launched), read from /proc/<pid>/cmdline."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"prefect" in args and b"server" in args


def stop() -> ServerInfo | None:
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
    return info.url
