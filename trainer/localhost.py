"""The machine's local services, the standard library only: where they are recorded, a free port, whether a
pid lives, whether a server answers its health check.

One copy for the vLLM service (trainer.llm.service) and the Prefect API (flows.api_launch, which the CLI
imports in its first lines, before anything heavy: importing `trainer.llm` would pull its client, httpx and
pydantic, ~0.14 s)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def cache_root() -> Path:
    """$CREDITFLOW_CACHE, default ~/.cache/creditflow: the services' records, the vLLM venv, the models."""
    return Path(os.environ.get("CREDITFLOW_CACHE", Path.home() / ".cache" / "creditflow"))


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """`pid` is a live process (a zombie, exited but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def health_url(url: str) -> str:
    """A service's health check: vLLM's at its root (`.../v1` is its OpenAI API), Prefect's under its API
    (`.../api/health`)."""
    base = url.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/health"


def healthy(url: str, timeout: float = 2.0) -> bool:
    """The service at `url` answers its health check with 200. Plain HTTP (every server recorded here listens
    on 127.0.0.1) is asked with the standard library: `httpx.get` builds a client and its SSL context per call,
    ~25 ms of CPU, which a command polling a starting server every 0.1 s paid 10 times a second of waiting;
    ~0.2 ms here. Another scheme goes through httpx."""
    import http.client
    from urllib.parse import urlsplit

    target = health_url(url)
    parts = urlsplit(target)
    if parts.scheme != "http" or not parts.hostname:
        return _healthy_httpx(target, timeout)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _healthy_httpx(target: str, timeout: float) -> bool:
    import httpx

    try:
        return httpx.get(target, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False
