"""The warm runner: `creditflow process` without importing Prefect in every command (issue 36).

A new small round with an API up cost ~3.3 s of CPU, most of it imports (Prefect alone 1.1-1.6 s) that every
command paid again. When the machine's Prefect API runs (flows/server.py: `creditflow server start`, or the
shared API a command started), a runner process starts beside it: it imports Prefect, the CLI, the flow and the
stage packages once, starts no thread, and listens on a unix socket in a private folder
($CREDITFLOW_CACHE/services/runner, mode 0700; a peer of another uid is refused: SO_PEERCRED). Like
multiprocessing's forkserver, it forks per request:

- the `process` CLI (flows.cli, before it imports anything heavy) connects and sends its argv, cwd, environment
  and its stdin/stdout/stderr file descriptors (SCM_RIGHTS), so progress bars, colours and isatty behave as in
  the command's own process;
- the runner checks the request (below) and forks a supervisor, which forks the command's process: it takes the
  caller's cwd, environment and descriptors, a process group of its own, refreshes Prefect's settings and
  logging from that environment and runs the same command function (`flows.cli.app`) in-process; the
  supervisor reports its exit status (and its CPU seconds) to the caller, which exits with it;
- Ctrl-C / SIGTERM / SIGHUP of the caller are forwarded to the command, Ctrl-Z stops both (`fg` / `bg` resume
  both); when the caller dies (kill -9) its socket closes and the supervisor kills the command's process
  group.

The caller runs the command itself instead (silently; a debug log line says why) when no runner answers,
CREDITFLOW_NO_SERVER=1 (the test suite), CREDITFLOW_SHARED_API=0 or CREDITFLOW_WARM_RUNNER=0, the settings the
runner's imports froze differ from the caller's (`frozen_env`: every PREFECT_* and PYTHON* variable and the
CREDITFLOW_* ones read at import time), the caller is another interpreter or checkout, or a project module the
runner loaded changed on disk since it started (its size or mtime): the runner then exits, and the next
command that finds the server up starts a fresh one (`ensure_runner`). The runner exits with the server (it
polls the server's pid and record) and holds no in-use lock of the API itself: the commands it runs hold it
(flows.api_idle), so the API's idle rule is unchanged.

The flow run's log says a round ran via the runner and how long its caller took to hand it over
(`describe`). Client side: standard library only (it runs before the CLI imports anything).

Modules: this one is the caller's side (the CLI's hand-over, the flow log's line) and starts and stops the
runner (flows.server); flows/warm_wire.py the protocol and settings both sides share; flows/warm_runner.py the
runner and its per-request supervisor (`python -m flows.warm_runner SERVER_PID STATE [LAUNCHER_PID]`);
flows/warm_command.py the forked command's process."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import struct
import sys
from pathlib import Path

from flows.warm_wire import (
    COMMANDS,
    PER_COMMAND_ENV,
    RELAYED,
    ROOT,
    SERVING,
    STATS_ENV,
    VIA,
    WHY,
    Lines,
    command_name,
    disabled,
    private_dir,
    runner_dir,
    send,
    socket_path,
    unix_address,
)

log = logging.getLogger(__name__)


def _started_s() -> float | None:
    """Seconds since this process started (from /proc: the interpreter's own start-up included)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


# ---------------------------------------------------------------------------------------------------- caller
def run_via_runner(argv: list[str]) -> int | None:
    """Run `argv` (the CLI's sys.argv) in the warm runner when one is up and may run it; returns the command's
    exit status, or None: run it in this process (module docstring: when)."""
    if SERVING["on"] or command_name(argv[1:]) not in COMMANDS:
        return None
    env = os.environ
    if disabled(env):
        return _fallback("disabled by the environment")
    path = socket_path()
    if not path.exists():
        return _fallback("no runner")
    if not private_dir(path.parent, create=False):
        return _fallback(f"{path.parent} is not a private folder of this user")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    relay = _Relay()  # from here on a signal is the command's (held until the runner has it)
    try:
        sock.settimeout(2.0)
        with unix_address(path) as address:
            sock.connect(address)
        client_s = _started_s()
        header = {
            "argv": list(argv),
            "cwd": os.getcwd(),
            "env": dict(env),
            "root": str(ROOT),
            "executable": sys.executable,
            "client_s": client_s,
            "streams": [_stream_info(s) for s in (sys.stdin, sys.stdout, sys.stderr)],
        }
        data = json.dumps(header).encode()
        socket.send_fds(sock, [struct.pack("!I", len(data))], [0, 1, 2])
        sock.sendall(data)
        lines = Lines(sock)
        reply = lines.next()
    except OSError as exc:
        sock.close()
        relay.restore(redeliver=True)
        return _fallback(f"runner unreachable ({exc})")
    if reply is None or "fallback" in reply:
        sock.close()
        relay.restore(redeliver=True)
        return _fallback(reply["fallback"] if reply else "the runner closed the connection")
    sock.settimeout(None)
    relay.attach(sock)
    _stats({"started": reply.get("pid")})
    return _wait(sock, lines, reply, client_s, relay)


def _stats(record: dict) -> None:
    """One JSON line to $CREDITFLOW_WARM_STATS (bench/fixed_cost.py and the tests read it), when set."""
    if os.environ.get(STATS_ENV):
        with contextlib.suppress(OSError), open(os.environ[STATS_ENV], "a") as fh:
            fh.write(json.dumps(record) + "\n")


def _stream_info(stream) -> dict | None:
    if stream is None:
        return None
    return {"encoding": getattr(stream, "encoding", None), "errors": getattr(stream, "errors", None)}


def _fallback(why: str) -> int | None:
    """No runner for this command: the reason is logged at debug once the CLI set up its logging
    (`log_fallback`) and named in the flow run's log (`describe`)."""
    WHY["why"] = why
    return None


def log_fallback() -> None:
    if WHY:
        log.debug("no warm runner (%s): the command runs in this process", WHY["why"])


class _Relay:
    """The caller's signals for its command in the runner, from before the request is sent: held until the
    runner's supervisor has the command (a handler writing into the socket in the middle of the request would
    corrupt it), then sent on; delivered to this process again when the runner falls back (the command then runs
    here). Ctrl-Z (SIGTSTP) stops the command where it is, then this process as the shell's job; `fg` / `bg`
    (SIGCONT) resumes this process, and it resumes the command."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.held: list[int] = []
        self.previous = {sig: signal.signal(sig, self._on) for sig in (*RELAYED, signal.SIGTSTP)}

    def _on(self, signum: int, _frame=None) -> None:
        if self.sock is None:
            self.held.append(signum)
        elif signum == signal.SIGTSTP:
            self._send(signal.SIGSTOP)
            signal.signal(signal.SIGTSTP, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTSTP)  # stops here until SIGCONT
            signal.signal(signal.SIGTSTP, self._on)
            self._send(signal.SIGCONT)
        else:
            self._send(signum)

    def _send(self, signum: int) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                send(self.sock, {"signal": signum})

    def attach(self, sock: socket.socket) -> None:
        """The runner has the command: send what was held, and every signal from now on."""
        self.sock = sock
        held, self.held = self.held, []
        for signum in held:
            self._on(signum)

    def restore(self, redeliver: bool = False) -> None:
        """This process's own handlers again; `redeliver`: the signals held are this process's."""
        self.sock = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        held, self.held = self.held, []
        for signum in held if redeliver else []:
            os.kill(os.getpid(), signum)


def _wait(sock: socket.socket, lines: Lines, started: dict, client_s: float | None, relay: _Relay) -> int:
    """Relay this process's signals to the command until it reports its exit status; returns it."""
    try:
        while True:
            msg = lines.next()
            if msg is None:  # the runner died under the command
                print("error: the warm runner went away during the command", file=sys.stderr)
                return 1
            if "exit" in msg:
                break
    finally:
        relay.restore()
        sock.close()
    code = int(msg["exit"])
    if os.environ.get(STATS_ENV):
        import resource

        res = resource.getrusage(resource.RUSAGE_SELF)
        _stats(
            {
                "client_s": client_s,
                "client_cpu_s": round(res.ru_utime + res.ru_stime, 3),
                "command_cpu_s": msg.get("cpu_s"),
                "command_pid": started.get("pid"),
                "exit": code,
            }
        )
    if code < 0:  # the command died of a signal: so does its caller, as an in-process command would
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def describe() -> str:
    """How this command runs, for the flow run's log next to the round's fixed cost."""
    if not VIA:
        return f"in its own process ({WHY.get('why', 'no warm runner')})"
    client = VIA.get("client_s")
    took = f"; its caller took {client:.2f} s to hand it over" if client is not None else ""
    return f"via warm runner {int(VIA['runner'])}{took}"


# ---------------------------------------------------------------------------------------------------- start
def runner_alive() -> bool:
    """A runner holds the folder's lock (cheap: no connection)."""
    from flows.api_idle import _unused  # the same test as the API's in-use lock (standard library only)

    path = runner_dir() / "runner.lock"
    return path.exists() and not _unused(path)


def ensure_runner(server_pid: int, state: Path, log_path: Path) -> bool:
    """Start a runner for the server unless one runs or runners are off; True when one was launched. Its
    environment is this process's without the per-command settings (`PER_COMMAND_ENV`) and PREFECT_API_URL
    (the caller's commands find the server themselves), in a session of its own like the server."""
    import subprocess

    env = os.environ
    if disabled(env):
        return False
    if SERVING["on"] or runner_alive():
        return False
    child_env = {k: v for k, v in env.items() if k not in (*PER_COMMAND_ENV, "PREFECT_API_URL")}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        subprocess.Popen(
            [sys.executable, "-m", "flows.warm_runner", str(server_pid), str(state), str(os.getpid())],
            cwd=str(ROOT),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
        )
    return True


def stop_runner() -> None:
    """End the runner (with `creditflow server stop`): SIGTERM to the lock holder's pid read from /proc."""
    path = runner_dir() / "runner.lock"
    if not runner_alive():
        return
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if len(parts) > 5 and parts[1] == "FLOCK" and parts[3] == "WRITE":
                dev_ino = parts[5].split(":")
                if int(dev_ino[-1]) == path.stat().st_ino:
                    os.kill(int(parts[4]), signal.SIGTERM)
