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
- Ctrl-C / SIGTERM / SIGHUP of the caller are forwarded to the command; when the caller dies (kill -9) its
  socket closes and the supervisor kills the command's process group.

The caller runs the command itself instead (silently; a debug log line says why) when no runner answers,
CREDITFLOW_NO_SERVER=1 (the test suite), CREDITFLOW_SHARED_API=0 or CREDITFLOW_WARM_RUNNER=0, the settings the
runner's imports froze differ from the caller's (`frozen_env`: every PREFECT_* and PYTHON* variable and the
CREDITFLOW_* ones read at import time), the caller is another interpreter or checkout, or a project module the
runner loaded changed on disk since it started (its size or mtime): the runner then exits, and the next
command that finds the server up starts a fresh one (`ensure_runner`). The runner exits with the server (it
polls the server's pid and record) and holds no in-use lock of the API itself: the commands it runs hold it
(flows.api_idle), so the API's idle rule is unchanged.

The flow run's log says a round ran via the runner and how long its caller took to hand it over
(`describe`). Client side: standard library only (it runs before the CLI imports anything)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

OFF_ENV = "CREDITFLOW_WARM_RUNNER"  # "0": never use a runner
STATS_ENV = "CREDITFLOW_WARM_STATS"  # a file the caller appends one JSON line to per warm run (bench/)
COMMANDS = ("process",)  # the commands that import Prefect for a flow run
ROOT = Path(__file__).resolve().parents[1]  # the checkout whose modules the runner loaded
# set by the CLI itself per invocation (flows.cli.setup_logging), refreshed in the forked command
PER_COMMAND_ENV = ("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL",)
# CREDITFLOW_* variables read when a module is imported (a fork keeps the runner's value)
IMPORT_TIME_ENV = ("CREDITFLOW_CACHE", "CREDITFLOW_LOG_LEVEL")
POLL_S = 2.0
HEADER_LIMIT = 16 << 20

# in a command forked by the runner: {"client_s": seconds its caller ran before the hand-over, "runner": pid}
VIA: dict[str, float] = {}
_SERVING = {"on": False}  # this process is a runner (or forked from one): never connect to a runner


def runner_dir() -> Path:
    """The runner's private folder beside the server's record (flows.server.state_path's folder); computed
    here without importing flows.server (which imports httpx and the vLLM service module)."""
    root = Path(os.environ.get("CREDITFLOW_CACHE", Path.home() / ".cache" / "creditflow"))
    return root / "services" / "runner"


def socket_path() -> Path:
    return runner_dir() / "runner.sock"


def frozen_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """The part of an environment the runner's imports froze: a caller whose part differs runs in-process."""
    return {
        k: v
        for k, v in env.items()
        if (k.startswith(("PREFECT_", "PYTHON")) and k not in PER_COMMAND_ENV) or k in IMPORT_TIME_ENV
    }


def _command(argv: list[str]) -> str | None:
    """The sub-command of a creditflow argv (the first word after the root options)."""
    args = iter(argv)
    for arg in args:
        if arg == "--log-level":
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def _private_dir(path: Path, create: bool) -> bool:
    """The folder exists (created when asked), is this user's, and no one else may enter it."""
    if create:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and st.st_mode & 0o077 == 0


def _started_s() -> float | None:
    """Seconds since this process started (from /proc: the interpreter's own start-up included)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


class _Lines:
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


# ---------------------------------------------------------------------------------------------------- caller
def run_via_runner(argv: list[str]) -> int | None:
    """Run `argv` (the CLI's sys.argv) in the warm runner when one is up and may run it; returns the command's
    exit status, or None: run it in this process (module docstring: when)."""
    if _SERVING["on"] or _command(argv[1:]) not in COMMANDS:
        return None
    env = os.environ
    if env.get("CREDITFLOW_NO_SERVER") == "1" or "0" in (env.get("CREDITFLOW_SHARED_API"), env.get(OFF_ENV)):
        return _fallback("disabled by the environment")
    path = socket_path()
    if not path.exists():
        return _fallback("no runner")
    if not _private_dir(path.parent, create=False):
        return _fallback(f"{path.parent} is not a private folder of this user")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)
        sock.connect(str(path))
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
        lines = _Lines(sock)
        reply = lines.next()
    except OSError as exc:
        sock.close()
        return _fallback(f"runner unreachable ({exc})")
    if reply is None or "fallback" in reply:
        sock.close()
        return _fallback(reply["fallback"] if reply else "the runner closed the connection")
    sock.settimeout(None)
    _stats({"started": reply.get("pid")})
    return _wait(sock, lines, reply, client_s)


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


WHY: dict[str, str] = {}


def log_fallback() -> None:
    if WHY:
        log.debug("no warm runner (%s): the command runs in this process", WHY["why"])


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _wait(sock: socket.socket, lines: _Lines, started: dict, client_s: float | None) -> int:
    """Forward this process's signals to the command until it reports its exit status; returns it."""

    def forward(signum, _frame) -> None:
        with contextlib.suppress(OSError):
            _send(sock, {"signal": signum})

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        while True:
            msg = lines.next()
            if msg is None:  # the runner died under the command
                print("error: the warm runner went away during the command", file=sys.stderr)
                return 1
            if "exit" in msg:
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
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


# ---------------------------------------------------------------------------------------------------- runner
PRELOAD = (
    "flows.cli",
    "prefect",
    "prefect.flows",
    "prefect.tasks",
    "prefect.client.orchestration",
    "flows.run",
    "flows.process_round",
    "flows.execution",
    "flows.server",
    "flows.summary",
    "flows.uptodate",
    "flows.progress",
    "flows.runners",
    "warehouse.lake",
    "warehouse.locks",
    "pyarrow.dataset",
    "pyarrow.compute",
)


# what a small round's `process` imported on top of PRELOAD (found by diffing sys.modules around the command):
# Prefect's engines, anyio's backend, the SQL views of the credit table, the stage settings of the loop
PRELOAD_RUN = (
    "prefect.engine",
    "prefect.flow_engine",
    "prefect.task_engine",
    "prefect.concurrency.context",
    "prefect.concurrency._sync",
    "prefect.concurrency.v1.context",
    "prefect._internal.control_listener",
    "prefect.telemetry.run_telemetry",
    "prefect.utilities.visualization",
    "anyio._backends._asyncio",
    "anyio.streams.memory",
    "anyio.streams.stapled",
    "anyio.streams.tls",
    "warehouse.views",
    "deltalake.fs",
    "trainer.loop",
    "trainer.train",
    "pipeline.credit.preconditions",
    "pyarrow.acero",
    "encodings.idna",
    "rich._emoji_codes",
    "typer._click.decorators",
)


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from pipeline.config import _load_stage_modules

    _load_stage_modules()  # every stage package and the credit methods (polars)
    for name in ("deltalake", "warehouse.delta_lake", "duckdb", *PRELOAD_RUN):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # pyarrow (26) imports pandas at its first conversion of Python or NumPy values (pa.array, pa.scalar: its
    # pandas shim), ~0.3 s of CPU: done here once, not in every command
    import pyarrow as pa

    pa.array([0])


def _native_threads() -> list[str]:
    """The names of this process's threads (native ones included: the libraries' own)."""
    try:
        tasks = os.listdir("/proc/self/task")
        return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tasks)
    except OSError:
        return []


def loaded_sources() -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of every project module this process loaded: changed ones make the runner stale."""
    out: dict[str, tuple[int, int]] = {}
    root = str(ROOT) + os.sep
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and path.startswith(root) and ".venv" not in path:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                out[path] = (st.st_mtime_ns, st.st_size)
    return out


def _stale(sources: dict[str, tuple[int, int]]) -> str | None:
    for path, (mtime, size) in sources.items():
        try:
            st = os.stat(path)
        except OSError:
            return f"{path} is gone"
        if (st.st_mtime_ns, st.st_size) != (mtime, size):
            return f"{path} changed since the runner started"
    return None


def _server_alive(server_pid: int, state: Path) -> bool:
    if not _alive(server_pid):
        return False
    try:
        return json.loads(state.read_text()).get("pid") == server_pid
    except (OSError, ValueError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie, not yet reaped by its parent, has)."""
    from flows.api_idle import _alive as exists

    try:
        return exists(pid) and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def serve(server_pid: int, state: Path, after: int = 0) -> int:
    """The runner's life (module docstring): returns its exit status."""
    folder = runner_dir()
    if not _private_dir(folder, create=True):
        print(f"creditflow runner: {folder} is not a private folder of this user", file=sys.stderr)
        return 1
    lock = open(folder / "runner.lock", "a")  # noqa: SIM115 (held for the runner's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another runner serves this folder
    _SERVING["on"] = True
    # a runner a command started imports only once that command is done: its imports (2-4 s of CPU) would
    # compete with the command's round on a small machine (the command runs in its own process anyway)
    while after and _alive(after):
        time.sleep(0.2)
    t0 = time.perf_counter()
    _preload()
    import threading

    # A fork copies only the forking thread: a lock another thread holds stays locked in the child. No Python
    # thread may run here; the libraries' native threads are idle ones that fork handles: jemalloc's background
    # threads (pyarrow, polars, deltalake; pthread_atfork handlers), OpenBLAS's workers (numpy; atfork too) and
    # polars' spill-file cleaner (its thread pool starts lazily, in the forked command).
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        print(f"creditflow runner: Python threads {names} after the imports; not serving", file=sys.stderr)
        return 1
    sources = loaded_sources()
    frozen = frozen_env(os.environ)
    path = folder / "runner.sock"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    listener.settimeout(POLL_S)
    print(
        f"creditflow runner {os.getpid()}: {len(sys.modules)} modules ({len(sources)} of the project) imported "
        f"in {time.perf_counter() - t0:.2f} s, native threads {_native_threads()}; serving {path}",
        file=sys.stderr,
        flush=True,
    )
    why = "server gone"
    try:
        while _server_alive(server_pid, state):
            _reap()
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            stale = _stale(sources)
            with conn:
                _serve_one(conn, listener, sources, frozen, stale)
            if stale:
                why = stale
                break
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # this runner's (it holds the folder's lock)
        listener.close()
    print(f"creditflow runner {os.getpid()}: exits ({why})", file=sys.stderr, flush=True)
    return 0


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _serve_one(
    conn: socket.socket,
    listener: socket.socket,
    sources: dict[str, tuple[int, int]],
    frozen: dict[str, str],
    stale: str | None,
) -> None:
    """Read one request; answer a fallback, or fork the supervisor that runs it."""
    conn.settimeout(5.0)
    fds: list[int] = []
    try:
        if _peer_uid(conn) != os.getuid():
            return  # another user's process: closed without a word
        head, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
        while len(head) < 4:
            more = conn.recv(4 - len(head))
            if not more:
                return
            head += more
        (size,) = struct.unpack("!I", head)
        if size > HEADER_LIMIT:
            return
        data = b""
        while len(data) < size:
            chunk = conn.recv(min(size - len(data), 1 << 20))
            if not chunk:
                return
            data += chunk
        req = json.loads(data)
        why = stale or _mismatch(req, frozen)
        if why is None and len(fds) != 3:
            why = f"{len(fds)} descriptors received, not 3"
        if why is not None:
            _send(conn, {"fallback": why})
            return
        pid = os.fork()
        if pid == 0:  # the supervisor
            code = 1
            try:
                listener.close()
                code = _supervise(conn, req, fds)
            finally:
                os._exit(code)
    except (OSError, ValueError) as exc:
        print(f"creditflow runner: a request failed: {exc}", file=sys.stderr, flush=True)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _mismatch(req: dict, frozen: dict[str, str]) -> str | None:
    if req.get("root") != str(ROOT):
        return f"another checkout ({req.get('root')})"
    if req.get("executable") != sys.executable:
        return f"another interpreter ({req.get('executable')})"
    theirs = frozen_env(req.get("env") or {})
    if theirs != frozen:
        keys = sorted(k for k in set(theirs) | set(frozen) if theirs.get(k) != frozen.get(k))
        return "settings differ from the runner's: " + ", ".join(keys[:5])
    return None


def _supervise(conn: socket.socket, req: dict, fds: list[int]) -> int:
    """Fork the command, tell the caller, relay its signals, report its exit; kill its group when the caller
    goes away."""
    conn.settimeout(None)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_command(req, fds)  # never returns
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also done by the child: whichever runs first
    import selectors

    try:
        _send(conn, {"pid": pid})
    except OSError:
        _kill_group(pid)
    lines = _Lines(conn)
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ)
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if sel.select(timeout=0.05):
            try:
                chunk = conn.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:  # the caller is gone (kill -9 included): so is its command
                _kill_group(pid)
                continue
            lines.buf += chunk
            while b"\n" in lines.buf:
                line, lines.buf = lines.buf.split(b"\n", 1)
                sig = json.loads(line).get("signal")
                if isinstance(sig, int):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, sig)
    code = os.waitstatus_to_exitcode(status)
    with contextlib.suppress(OSError):
        _send(conn, {"exit": code, "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)})
    return 0


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _run_command(req: dict, fds: list[int]) -> None:
    """The forked command: the caller's process as far as the command can tell (module docstring)."""
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

        app = importlib.import_module("flows.cli").app  # loaded by the runner (flows.cli imports this module)
        try:
            app()
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except KeyboardInterrupt:
            code = 130
        _finish()
    except BaseException:  # noqa: BLE001 (a bug here must reach the caller's stderr, not the runner's log)
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # what the interpreter does with SystemExit("message")
    return 1


def _finish() -> None:
    """What the interpreter does at exit: wait for non-daemon threads, then the atexit handlers (Prefect's
    log and event workers flush there; logging shuts down)."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


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
    if env.get("CREDITFLOW_NO_SERVER") == "1" or "0" in (env.get("CREDITFLOW_SHARED_API"), env.get(OFF_ENV)):
        return False
    if _SERVING["on"] or runner_alive():
        return False
    child_env = {k: v for k, v in env.items() if k not in (*PER_COMMAND_ENV, "PREFECT_API_URL")}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        subprocess.Popen(
            [sys.executable, "-m", "flows.warm", str(server_pid), str(state), str(os.getpid())],
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


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return serve(int(argv[0]), Path(argv[1]), int(argv[2]) if len(argv) > 2 else 0)


if __name__ == "__main__":  # `python -m flows.warm`: run as the importable module, not a copy named __main__
    from flows import warm

    raise SystemExit(warm.main(sys.argv[1:]))
