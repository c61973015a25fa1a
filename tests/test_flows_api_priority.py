"""flows/api_priority.py: while a round's stages fill every CPU, the run's own Prefect API server runs under
SCHED_IDLE, and goes back to the normal policy afterwards; a server this process did not start, a config that
turns it off and a process that could not undo it are left alone; every task run is still recorded."""

from __future__ import annotations

import os
import time

import pytest
from test_flows_process import RULE_METHODS, cfg_for, make_round

from flows import api_priority, progress
from flows.run import run_process
from warehouse.lake import Lake

linux_sched = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies only")


def _policies_during_stages(monkeypatch) -> list[set[int]]:
    """The API server's thread policies each time the flow reports a finished batch stage."""
    seen: list[set[int]] = []
    report = progress.report

    def spy(*args, **kwargs):
        if args and args[0] == "batch":
            pid = api_priority.own_api_pid()
            seen.append(api_priority.thread_policies(pid) if pid else set())
        return report(*args, **kwargs)

    monkeypatch.setattr(progress, "report", spy)
    return seen


@linux_sched
def test_own_api_runs_idle_while_the_stages_fill_the_cpus(tmp_path, prefect_harness, monkeypatch):
    if not api_priority.can_leave_idle():
        pytest.skip(
            "this process may not move a thread back from SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE < 20)"
        )
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    monkeypatch.setattr("flows.execution.stages_fill_cpus", lambda workers: True)
    lake = Lake(tmp_path / "lake")
    batches = make_round(lake)
    seen = _policies_during_stages(monkeypatch)
    summary = run_process(cfg_for(lake, max_workers=2), 0, quiet=True)

    pid = api_priority.own_api_pid()
    assert pid is not None  # the harness's server: started by this process, named by PREFECT_API_URL
    stages = len(summary["this_run"])
    assert len(seen) == stages * len(batches)
    assert all(policies == {os.SCHED_IDLE} for policies in seen), seen
    assert api_priority.thread_policies(pid) == {os.SCHED_OTHER}  # back to normal after the stages
    assert summary["api_idle_during_stages"] is True

    # the server caught up: every task run of this round's flow run is recorded, completed
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        newest = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["process lake round 0"])),
            sort=FlowRunSort.START_TIME_DESC,
            limit=1,
        )[0]
        this_run = FlowRunFilter(id=FlowRunFilterId(any_=[newest.id]))
        while True:
            runs = client.read_task_runs(flow_run_filter=this_run)
            if len(runs) == stages * len(batches) + 1 and all(
                r.state_type.value == "COMPLETED" for r in runs
            ):
                break
            assert time.monotonic() < deadline, [(r.name, r.state_type) for r in runs]
            time.sleep(0.5)


@linux_sched
@pytest.mark.parametrize("case", ["config-off", "spare-cpu", "cannot-undo"])
def test_own_api_left_alone(tmp_path, prefect_harness, monkeypatch, case):
    """flow.api_idle=false, a CPU to spare beside the workers, or no permission to undo SCHED_IDLE: the
    server keeps the normal policy throughout."""
    monkeypatch.setattr("flows.execution.stages_fill_cpus", lambda workers: case != "spare-cpu")
    if case == "cannot-undo":
        monkeypatch.setattr(api_priority, "can_leave_idle", lambda: False)
    lake = Lake(tmp_path / "lake")
    make_round(lake, groups=4)
    seen = _policies_during_stages(monkeypatch)
    sets = ["flow.api_idle=false"] if case == "config-off" else []
    summary = run_process(cfg_for(lake, methods=RULE_METHODS[:1], sets=sets, max_workers=2), 0, quiet=True)
    assert seen and all(policies == {os.SCHED_OTHER} for policies in seen), seen
    assert summary["api_idle_during_stages"] is False


@linux_sched
def test_a_server_this_process_did_not_start_is_never_touched(prefect_harness):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    assert api_priority.own_api_pid() is not None
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert api_priority.own_api_pid() is None
        with api_priority.api_waits_for_idle_cpu() as pid:
            assert pid is None


@linux_sched
def test_nested_stage_phases_restore_the_policy_when_the_last_ends(prefect_harness):
    """Two rounds in one process (threads of a long-lived server): the first to finish keeps the server
    idle for the other; the last one restores it."""
    if not api_priority.can_leave_idle():
        pytest.skip("this process may not move a thread back from SCHED_IDLE")
    pid = api_priority.own_api_pid()
    with api_priority.api_waits_for_idle_cpu() as outer:
        assert outer == pid and api_priority.thread_policies(pid) == {os.SCHED_IDLE}
        with api_priority.api_waits_for_idle_cpu() as inner:
            assert inner == pid
        assert api_priority.thread_policies(pid) == {os.SCHED_IDLE}
    assert api_priority.thread_policies(pid) == {os.SCHED_OTHER}


def test_stages_fill_cpus_counts_the_usable_cpus(monkeypatch):
    monkeypatch.setattr(api_priority, "usable_cpus", lambda: 2)
    assert api_priority.stages_fill_cpus(2) and api_priority.stages_fill_cpus(3)
    assert not api_priority.stages_fill_cpus(1)
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.undo()
        assert api_priority.usable_cpus() == len(os.sched_getaffinity(0))
