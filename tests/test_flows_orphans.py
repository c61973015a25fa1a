"""kill -9 of a process that runs batch stages in worker processes leaves none of them behind (issue 22):
the forkserver and each worker ask the kernel for SIGKILL when their parent dies (flows.runtime.die_with_parent);
the `processes` task runner's workers (Prefect's ProcessPoolTaskRunner) exit when their parent has died
(flows.runtime.start_worker, the runner's initializer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

ROOT = Path(__file__).resolve().parents[1]
DRIVER = """
import os, sys, threading, time
from flows import workers
# started from a short-lived thread, as `creditflow process` does (workers.warm_in_background): the pool must
# outlive that thread and still die with the process
starter = threading.Thread(target=workers.warm, args=(2,))
starter.start(); starter.join(); time.sleep(1.0)
pids = {workers.run(2, os.getpid) for _ in range(8)}
print(" ".join(map(str, sorted(pids))), flush=True)
time.sleep(120)
"""
# a flow on the `processes` task runner, killed while its pool is up (the flow holds it)
PROCESSES_DRIVER = """
import os, sys, time
from prefect import flow, task
from flows.config import load_config
from flows.runners import make_task_runner, worker_api

@task
def pid(i):
    time.sleep(0.3)
    return os.getpid()

@flow
def hold(n):
    print(" ".join(map(str, sorted(set(pid.map(range(n)).result())))), flush=True)
    time.sleep(120)

cfg = load_config(None, [], lake=sys.argv[1], task_runner="processes", max_workers=2)
with worker_api(cfg):
    hold.with_options(task_runner=make_task_runner(cfg))(8)
"""


def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.add(int(entry.name))
    return out


def _descendants(pid: int) -> set[int]:
    todo, seen = [pid], set()
    while todo:
        for child in _children(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_and_survivors(proc: subprocess.Popen, pids: set[int], wait_s: float = 10) -> list[int]:
    """SIGKILL `proc`, then wait up to `wait_s` for `pids` to end; the ones still alive."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("driver", ["forkserver", "processes"])
def test_workers_die_with_a_killed_parent(tmp_path, driver):
    code = DRIVER if driver == "forkserver" else PROCESSES_DRIVER
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "lake")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        worker_pids = {int(p) for p in proc.stdout.readline().split()}
        assert worker_pids, "the driver reported no worker process"
        tree = _descendants(proc.pid)
        assert worker_pids <= tree and proc.pid not in worker_pids  # the driver's worker processes
        if driver == "processes":  # Prefect's own API server (a child too) is Prefect's to stop: the workers
            tree = worker_pids
        assert not kill_and_survivors(proc, tree), "processes outlived their killed parent"
    finally:
        if proc.poll() is None:
            proc.kill()
