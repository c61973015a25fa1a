"""kill -9 of a process that runs a round leaves no Prefect API server behind (issue 33 item 8): the ephemeral
server Prefect starts (a uvicorn subprocess) is stopped by a reaper that outlives the killed process
(flows.runtime.reap_with_parent, hooked in by flows.runners.worker_api)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_flows_orphans import _alive, _descendants, kill_and_survivors

from flows.api_priority import API_APP

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ROOT = Path(__file__).resolve().parents[1]
# a flow the way `creditflow process` runs a round (flows.run.process_checked_round: worker_api, then the flow
# with the configured task runner), held while the API server is up
DRIVER = """
import os, sys, time
from prefect import flow, task
from flows.config import load_config
from flows.runners import make_task_runner, worker_api

@task
def pid(i):
    return os.getpid()

@flow
def hold(n):
    pid.map(range(n)).result()
    print("up", flush=True)
    time.sleep(120)

cfg = load_config(None, [], lake=sys.argv[1], task_runner=sys.argv[2], max_workers=2)
with worker_api(cfg):
    hold.with_options(task_runner=make_task_runner(cfg))(2)
"""


def _api_servers(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            args = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if API_APP.encode() in args:
            out.add(pid)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("task_runner", ["threads", "processes"])
def test_api_server_dies_with_a_killed_process(tmp_path, task_runner):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["CREDITFLOW_NO_SERVER"] = "1"  # never a managed server: the ephemeral one
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path / "lake"), task_runner],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    servers: set[int] = set()
    try:
        assert proc.stdout.readline().strip() == "up"
        servers = _api_servers(_descendants(proc.pid))
        assert servers, "the driver started no API server"
        survivors = kill_and_survivors(proc, servers, wait_s=30)
        assert not survivors, "the API server outlived its killed parent"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in servers:  # never leave one behind on a shared machine, pass or fail
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
