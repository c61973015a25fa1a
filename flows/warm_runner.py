"""The warm runner's process (flows/warm.py describes it): imports Prefect, the CLI, the flow and the stage
packages once, serves requests on its socket until its server goes or a loaded module changes, and per request
forks a supervisor that forks the command (flows/warm_command.py), relays the caller's signals and reports the
command's exit status. Started as `python -m flows.warm_runner SERVER_PID STATE [LAUNCHER_PID]`
(flows.warm.ensure_runner)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from flows.warm_command import run_command
from flows.warm_wire import (
    HEADER_LIMIT,
    RELAYED,
    ROOT,
    SERVING,
    Lines,
    frozen_env,
    private_dir,
    runner_dir,
    send,
    unix_address,
)
from trainer.localhost import pid_alive

POLL_S = 2.0


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
    if not pid_alive(server_pid):
        return False
    try:
        return json.loads(state.read_text()).get("pid") == server_pid
    except (OSError, ValueError, AttributeError):
        return False


def serve(server_pid: int, state: Path, after: int = 0) -> int:
    """The runner's life (module docstring): returns its exit status."""
    folder = runner_dir()
    if not private_dir(folder, create=True):
        print(f"creditflow runner: {folder} is not a private folder of this user", file=sys.stderr)
        return 1
    lock = open(folder / "runner.lock", "a")  # noqa: SIM115 (held for the runner's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another runner serves this folder
    SERVING["on"] = True
    # a runner a command started imports only once that command is done: its imports (2-4 s of CPU) would
    # compete with the command's round on a small machine (the command runs in its own process anyway)
    while after and pid_alive(after):
        time.sleep(0.2)
    t0 = time.perf_counter()
    import gc

    from flows.runtime import freeze_heap

    gc.disable()  # the imports build objects none of which is garbage: no passes over them meanwhile
    try:
        _preload()
    finally:
        freeze_heap()  # what the commands inherit: out of their collector's passes (and their pages unwritten)
        gc.enable()
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
    with unix_address(path) as address:
        listener.bind(address)
    listener.listen(16)
    listener.settimeout(POLL_S)
    print(
        f"creditflow runner {os.getpid()}: {len(sys.modules)} modules ({len(sources)} of the project) imported "
        f"in {time.perf_counter() - t0:.2f} s, {gc.get_freeze_count()} objects frozen for the commands, native "
        f"threads {_native_threads()}; serving {path}",
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
            send(conn, {"fallback": why})
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
    # The caller's signals are held (blocked) across the fork until the command has set its own handlers: a
    # signal sent on before the child first runs would reach the handler this process inherited from the runner,
    # and the interpreter clears a signal caught before its after-fork hook runs, so the command lost it and went
    # on (a SIGTERM while the child waited for a CPU on a busy machine: the command then ran on to its end)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    pid = os.fork()
    if pid == 0:
        conn.close()
        run_command(req, fds, mask)  # never returns; unblocks once its handlers are the command's
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also done by the child: whichever runs first
    import selectors

    try:
        send(conn, {"pid": pid})
    except OSError:
        _kill_group(pid)
    lines = Lines(conn)
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
        send(conn, {"exit": code, "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)})
    return 0


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return serve(int(argv[0]), Path(argv[1]), int(argv[2]) if len(argv) > 2 else 0)


if (
    __name__ == "__main__"
):  # `python -m flows.warm_runner`: run as the importable module, not a copy named __main__
    from flows import warm_runner

    raise SystemExit(warm_runner.main(sys.argv[1:]))
