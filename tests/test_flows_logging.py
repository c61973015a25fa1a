"""Logs where Prefect users look (#26): the round's flow run is named `process <lake> round <n>` and tagged
with its methods and runner; stage summaries reach the API at INFO and degraded stages as warnings; the serve
watch starts a run only when the incoming folder has something new."""

from __future__ import annotations

import logging
import threading

import pytest
from test_flows_process import cfg_for, make_round

from flows.incoming import poll_incoming
from flows.process_round import process_round_flow
from warehouse.lake import Lake


@pytest.fixture
def run_logs_at_info():
    """The suite runs Prefect at WARNING (conftest); a real `creditflow` run leaves the run loggers at INFO."""
    loggers = [logging.getLogger(n) for n in ("prefect.flow_runs", "prefect.task_runs")]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
    yield
    for lg, level in zip(loggers, before, strict=True):
        lg.setLevel(level)


def _logs(flow_run_id) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs go to the API in batches

    with get_client(sync_client=True) as client:
        return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def test_round_run_is_named_tagged_and_logs_at_info(tmp_path, prefect_harness, run_logs_at_info):
    from prefect import get_client

    lake = Lake(tmp_path / "mylake")
    make_round(lake, round_=3, groups=4, batch_groups=2)
    cfg = cfg_for(lake, methods=["grpo", "dr_grpo"])
    state = process_round_flow(round_=3, config=cfg, return_state=True)
    assert state.is_completed()
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(state.state_details.flow_run_id)
    assert run.name == "process mylake round 3"
    assert {"method:grpo", "method:dr_grpo", "runner:threads"} <= set(run.tags)
    logs = _logs(run.id)
    messages = [(log.level, log.message) for log in logs]
    assert any(level == 20 and m.startswith("round 3: ") and "trajectories" in m for level, m in messages)
    assert any(level == 20 and m.startswith("stage credit: 2 batches") for level, m in messages)
    assert any(level == 20 and m.startswith("credit b0000") for level, m in messages), messages


def test_degraded_stage_is_a_warning_in_the_run_log(prefect_harness, run_logs_at_info):
    from prefect import flow, task

    from flows.process_round import _log_batch

    @task
    def stage():
        _log_batch(
            {
                "stage": "annotate",
                "batch": "b00001",
                "trajectories": 2,
                "tokens": 10,
                "seconds": 0.1,
                "warnings": ["endpoint down: rules used"],
            }
        )

    @flow
    def degraded():
        stage()

    state = degraded(return_state=True)
    logs = _logs(state.state_details.flow_run_id)
    assert any(log.level == 30 and "annotate b00001 degraded: endpoint down" in log.message for log in logs)
    assert any(log.level == 20 and log.message.startswith("annotate b00001: 2 trajectories") for log in logs)


def test_serve_watch_starts_runs_only_for_new_entries(tmp_path):
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    cfg = cfg_for(
        Lake(tmp_path / "lake"),
        methods=["grpo"],
        sets=[f"serve.incoming={incoming}", "serve.settle_s=0"],
    )
    runs: list[str] = []
    done = {"value": False}

    def trigger():
        runs.append("run")
        return len(runs)

    class NoWait(threading.Event):  # the poll interval (>= 1 s) passes at once
        def wait(self, timeout=None):
            return self.is_set()

    stop = NoWait()
    assert poll_incoming(cfg, trigger, lambda _r: done["value"], stop, max_polls=20) == 0  # idle: no runs
    (incoming / "drop.jsonl").write_text("{}\n")
    # one run for the drop, none while it is still going
    assert poll_incoming(cfg, trigger, lambda _r: done["value"], stop, max_polls=20) == 1
    (incoming / "drop.jsonl").rename(tmp_path / "moved.jsonl")  # what the incoming flow does with it
    done["value"] = True
    assert poll_incoming(cfg, trigger, lambda _r: done["value"], stop, max_polls=20) == 0
    assert runs == ["run"]
    stop.set()
    assert poll_incoming(cfg, trigger, lambda _r: True, stop) == 0  # a set stop ends the watch
