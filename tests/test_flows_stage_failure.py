"""A stage that fails in `creditflow process` is one line on stderr naming the stage, its batch and the error
(issue 33 item 11: it was Prefect's tracebacks, 161 lines); `--debug` shows the tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a round whose credit stage raises, processed by the CLI in a process of its own (Prefect's terminal logging as
# `creditflow` sets it up)
DRIVER = """
import sys
from flows.cli import app
sys.path.insert(0, "tests")
from test_flows_process import make_round
import flows.process_round as pr
from warehouse.lake import Lake

make_round(Lake(sys.argv[1]), round_=0, groups=4, batch_groups=2)
real = pr.run_stage

def failing(lake_root, round_, batch, stage, *rest):
    if stage.name == "credit":
        raise RuntimeError("boom in the credit stage")
    return real(lake_root, round_, batch, stage, *rest)

pr.run_stage = failing  # the thread runner's stages run in this process (flow.processes=false)
app([*sys.argv[2:], "process", "--lake", sys.argv[1], "--round", "0", "--methods", "grpo",
     "--set", "flow.processes=false"])
"""


def _process(tmp_path: Path, *cli_args: str) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(CREDITFLOW_NO_SERVER="1", PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL="WARNING")
    env.pop("CREDITFLOW_DEBUG", None)
    res = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "lake"), *cli_args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # no line is filtered: Prefect's "Failed to initialize plugins" import race is gone (flows.run.prepare)
    return res.returncode, [ln for ln in res.stderr.splitlines() if ln.strip()]


@pytest.mark.slow
def test_a_failing_stage_is_one_line_naming_it(tmp_path):
    code, lines = _process(tmp_path)
    assert code == 1
    assert len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith("error: stage credit on batch b0000")
    assert "RuntimeError: boom in the credit stage" in lines[0]


@pytest.mark.slow
def test_debug_shows_the_stages_traceback(tmp_path):
    code, lines = _process(tmp_path, "--debug")
    assert code == 1
    assert any(ln.startswith("Traceback") for ln in lines)
    assert any("boom in the credit stage" in ln for ln in lines)


def test_the_clis_stage_note_is_the_flows():
    from flows.batch import STAGE_NOTE as FLOW_STAGE_NOTE
    from flows.cli import STAGE_NOTE

    assert STAGE_NOTE == FLOW_STAGE_NOTE


def test_prefects_drain_warnings_stay_off_the_terminal():
    """Prefect's queue services warn "Still processing items" when they drain with items queued (a loaded
    machine): noise on the terminal wherever it happens (it made the one error line two), kept at DEBUG."""
    import logging

    from flows.run import _RunFailuresOnce

    def record(name: str, msg: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    keep = _RunFailuresOnce().filter
    drain = record("EventsWorker", "Still processing items: 8 items remaining...")
    assert not keep(drain)
    assert not keep(record("APILogWorker", "Still processing items: 2 items remaining..."))
    assert keep(record("EventsWorker", "Service 'EventsWorker' failed with 3 pending items."))
    assert keep(record("prefect.other", "Still processing items: 8 items remaining..."))
    logger = logging.getLogger("EventsWorker")
    before = logger.level
    try:
        logger.setLevel(logging.DEBUG)  # --log-level debug
        assert keep(drain)
    finally:
        logger.setLevel(before)
