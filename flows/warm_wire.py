"""The warm runner's shared wire protocol and state (flows/warm.py describes the runner): the settings a caller
and the runner must agree on, the runner's private folder and socket, newline-delimited JSON messages, and the
per-process records of how a command runs. Standard library only: the caller imports it before anything heavy."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

from trainer.localhost import cache_root

OFF_ENV = "CREDITFLOW_WARM_RUNNER"  # "0": never use a runner
STATS_ENV = "CREDITFLOW_WARM_STATS"  # a file the caller appends one JSON line to per warm run (bench/)
COMMANDS = ("process",)  # the commands that import Prefect for a flow run
ROOT = Path(__file__).resolve().parents[1]  # the checkout whose modules the runner loaded
# set by the CLI itself per invocation (flows.cli.setup_logging), refreshed in the forked command
PER_COMMAND_ENV = ("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL",)
# CREDITFLOW_* variables read when a module is imported or the runner starts (a fork keeps the runner's value:
# CREDITFLOW_GC_FREEZE decides whether the heap a command inherits is frozen, flows.runtime.freeze_heap)
IMPORT_TIME_ENV = ("CREDITFLOW_CACHE", "CREDITFLOW_LOG_LEVEL", "CREDITFLOW_GC_FREEZE")
HEADER_LIMIT = 16 << 20

# in a command forked by the runner: {"client_s": seconds its caller ran before the hand-over, "runner": pid}
VIA: dict[str, float] = {}
# in a command that runs in its own process: {"why": the reason no runner ran it}
WHY: dict[str, str] = {}
SERVING = {"on": False}  # this process is a runner (or forked from one): never connect to a runner


def command_name(argv: list[str]) -> str | None:
    """The sub-command of a creditflow argv without the program (the first word after the root options)."""
    args = iter(argv)
    for arg in args:
        if arg == "--log-level":
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def disabled(env: dict[str, str] | os._Environ) -> bool:
    """Runners are off in this environment (the test suite, no shared API, or turned off)."""
    return env.get("CREDITFLOW_NO_SERVER") == "1" or "0" in (
        env.get("CREDITFLOW_SHARED_API"),
        env.get(OFF_ENV),
    )


# the caller's signals its command in the runner gets (flows/warm.py relays them; the supervisor blocks them across
# the fork until the command has its own handlers, flows/warm_runner.py)
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def services_folder() -> Path:
    """$CREDITFLOW_CACHE/services, where the machine's API and its runner are recorded."""
    return cache_root() / "services"


def runner_dir() -> Path:
    """The runner's private folder beside the server's record (flows.server.state_path's folder); computed
    here without importing flows.server (which imports httpx and the vLLM service module)."""
    return services_folder() / "runner"


def socket_path() -> Path:
    return runner_dir() / "runner.sock"


SUN_PATH_MAX = 107  # sockaddr_un.sun_path: 108 bytes with the terminating NUL


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """An address for the socket file `path` that fits sun_path: the path itself, or, where it is longer (a
    deep HOME, CREDITFLOW_CACHE or TMPDIR), the same file reached through an O_PATH descriptor of its folder,
    `/proc/self/fd/N/<name>` (Linux), closed when the bind or connect is done."""
    if len(os.fsencode(str(path))) <= SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def frozen_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """The part of an environment the runner's imports froze: a caller whose part differs runs in-process."""
    return {
        k: v
        for k, v in env.items()
        if (k.startswith(("PREFECT_", "PYTHON")) and k not in PER_COMMAND_ENV) or k in IMPORT_TIME_ENV
    }


def private_dir(path: Path, create: bool) -> bool:
    """The folder exists (created when asked), is this user's, and no one else may enter it."""
    if create:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and st.st_mode & 0o077 == 0


def send(sock: socket.socket, msg: dict) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


class Lines:
    """Newline-delimited JSON messages from a stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def next(self) -> dict | None:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)
