"""While a round's batch stages run, the run's own Prefect API server waits for idle CPU.

`creditflow process` without PREFECT_API_URL talks to an ephemeral Prefect API server, a subprocess that
lives and dies with the run. Every finished task run sends it three state events, and on a machine whose
cores the stage workers fill it takes its share of them in short bursts (its event handlers, the task-run
recorder's and the event persister's SQLite writes): ~1 s of CPU per 49 task runs, on the cores the stages
need. Nothing in the round waits for that bookkeeping: the thread runner orchestrates task runs client-side
and sends their events over a websocket.

So when the stage workers alone fill every core this process may use, the server's threads run under Linux's
SCHED_IDLE policy during the stage phase: the kernel gives them a core only when no normal thread wants it
(and they never preempt one). The events queue up in the server and are recorded in the gaps and once the
stages finish, when the server's threads go back to the normal policy (before the round's stats and the flow
run's final state, which do call the API). Measured on 2 cores (bench/results/flows.md): with 2 workers the
round takes ~2-11% less (medians of back-to-back pairs in four runs); with 1 worker and a spare core the
server is better left alone (it keeps up on the spare core; idle, it stays behind and fills every short gap
the worker's threads leave, 5 of 5 pairs 1-2 s slower), hence the rule on the number of workers.

It applies only with the thread runner (Ray / Dask workers report to the API from their own processes), only
to a server this process started (Prefect's ephemeral server), never to a server named by PREFECT_API_URL that
this process did not start,
and only where the change can be undone: an unprivileged process may enter SCHED_IDLE but may leave it only
with CAP_SYS_NICE or an RLIMIT_NICE of at least 20 (`ulimit -e`), so without either it is skipped. Off with
`flow.api_idle: false`."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flows.api_launch import API_APP  # what a Prefect API server process runs (uvicorn --factory)

_lock = threading.Lock()
_holders: dict[int, int] = {}  # API server pid -> stage phases in progress (rounds run side by side)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def stages_fill_cpus(workers: int) -> bool:
    """Whether `workers` stage workers alone keep every usable CPU busy."""
    return workers >= usable_cpus()


def own_api_pid() -> int | None:
    """The pid of a running Prefect API server that this process started (a child process serving Prefect's API
    app, found from /proc: no Prefect internals) and that its flows report to, if any."""
    from urllib.parse import urlparse

    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    port = urlparse(str(url)).port if url else None
    me = os.getpid()
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != me or stat[0] == "Z":
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if API_APP not in argv:
            continue
        if port is None or (
            "--port" in argv and argv[argv.index("--port") + 1 : argv.index("--port") + 2] == [str(port)]
        ):
            return int(entry)
    return None


@functools.cache
def can_leave_idle() -> bool:
    """Whether this process may move a thread of its own from SCHED_IDLE back to the normal policy (probed on
    a short-lived thread: the kernel's rule depends on CAP_SYS_NICE, RLIMIT_NICE and the nice value)."""
    if not hasattr(os, "sched_setscheduler") or not hasattr(os, "SCHED_IDLE"):
        return False
    ok: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except OSError:
            ok.append(False)

    thread = threading.Thread(target=probe, name="creditflow-sched-probe", daemon=True)
    thread.start()
    thread.join()
    return bool(ok and ok[0])


def _thread_ids(pid: int) -> list[int]:
    """The threads of process `pid` now (none if it has ended)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def set_policy(pid: int, policy: int) -> None:
    """Put every thread of process `pid` under `policy` (threads the server starts later inherit the policy of
    the thread that starts them)."""
    for tid in _thread_ids(pid):
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:  # a thread that just ended
            pass


def thread_policies(pid: int) -> set[int]:
    """The scheduling policies of the threads of process `pid` (for tests and diagnostics)."""
    out = set()
    for tid in _thread_ids(pid):
        try:
            out.add(os.sched_getscheduler(tid))
        except OSError:  # a thread that just ended
            pass
    return out


@contextmanager
def api_waits_for_idle_cpu(enabled: bool = True) -> Iterator[int | None]:
    """Within the block, this process's own Prefect API server runs under SCHED_IDLE (see the module's
    docstring); yields its pid, or None when nothing was changed."""
    pid = own_api_pid() if enabled else None
    if pid is None or not can_leave_idle():
        yield None
        return
    with _lock:
        _holders[pid] = _holders.get(pid, 0) + 1
        if _holders[pid] == 1:
            set_policy(pid, os.SCHED_IDLE)
    try:
        yield pid
    finally:
        with _lock:
            _holders[pid] -= 1
            if _holders[pid] == 0:
                del _holders[pid]
                set_policy(pid, os.SCHED_OTHER)
