"""Faults: `creditflow process` SIGKILLed mid-round resumes to the same result; a corrupt input file is
quarantined through ingest_flow while the rest is processed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from test_flows_process import assert_same_tables, cfg_for, make_round

from flows.batch import run_batch_plain
from flows.ingest import UNREADABLE, ingest_flow
from flows.run import run_process
from warehouse.lake import Lake
from warehouse.rounds import batch_names
from warehouse.runlog import read_stage_runs

METHODS = "grpo,grpo+c3,grpo+iapo"


@pytest.mark.slow
def test_sigkill_mid_round_resumes_to_the_same_result(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    lake, reference = Lake(tmp_path / "lake"), Lake(tmp_path / "reference")
    n = len(make_round(lake, groups=48, batch_groups=1))
    make_round(reference, groups=48, batch_groups=1)
    assert n == 48
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "COLUMNS": "120"}
    cmd = [
        str(Path(sys.executable).parent / "creditflow"),
        "process",
        "--lake",
        str(lake.root),
        "--round",
        "0",
        "--methods",
        METHODS,
        "--max-workers",
        "1",
        "--set",
        "flow.progress=false",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.time() + 240
        # let a few batches finish credit
        while len(lake.parts("advantages", 0)) < 9 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, (
            f"exited before any advantages part: {proc.stderr.read().decode()[-2000:]}"
        )
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI process and anything it started
    finally:
        proc.wait(timeout=30)
        proc.stderr.close()
    done_before = len(lake.parts("train_batch", 0))
    assert done_before < 3 * n, "the run finished before the kill"
    # every batch stage that finished writes its stage_runs row last (on Delta to the run log's spool, which
    # the reader commits), just before Prefect's cache record
    finished_before = read_stage_runs(lake, 0).num_rows

    summary = run_process(cfg_for(lake, methods=METHODS.split(",")), 0, quiet=True)
    credit = summary["this_run"]["credit"]
    assert credit["batches"] == n
    # batch stages finished before the kill are skipped (served from the cache): all of them but the one
    # (max_workers=1) that may have been between its stage_runs part and its cache record at the kill
    cached = sum(r["cached"] for r in summary["this_run"].values())
    assert finished_before >= 3 and cached >= finished_before - 1, (cached, finished_before)
    assert not list(lake.root.rglob(".tmp-*"))

    for b in batch_names(reference, 0):
        run_batch_plain(reference, 0, b, cfg_for(reference, methods=METHODS.split(",")))
    assert_same_tables(lake, reference)
    adv = pl.from_arrow(lake.read("advantages", 0).select(["method", "traj_id", "step_idx"]))
    assert adv.height == adv.unique().height == 3 * pl.from_arrow(lake.read("steps", 0)).height
    assert len(lake.parts("advantages", 0)) == 3 * n and len(lake.parts("train_batch", 0)) == 3 * n


def _chat_record(i: int, group: int) -> dict:
    return {
        "traj_id": f"t{i}",
        "group_id": f"q{group}",
        "reward": float(i % 2),
        "messages": [
            {"role": "user", "content": f"question {group}"},
            {"role": "assistant", "content": f"answer {i} to {group}", "verifier_score": 0.5},
        ],
    }


def write_chat_files(folder: Path, n_files: int = 2, per_file: int = 4) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(n_files):
        path = folder / f"rollouts-{f}.jsonl"
        recs = [_chat_record(f * per_file + i, f) for i in range(per_file)]
        path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        paths.append(path)
    return paths


def test_corrupt_input_file_is_quarantined_and_the_rest_processed(tmp_path, prefect_harness):
    src = tmp_path / "src"
    write_chat_files(src)
    (src / "corrupt.jsonl").write_bytes(b"\xff\xfe\x00garbage\x80\x81 not utf-8\n")
    with open(src / "rollouts-1.jsonl", "a") as fh:
        fh.write('{"traj_id": "broken", "messages": [\n')  # a malformed record in a good file
    lake = Lake(tmp_path / "lake")
    cfg = cfg_for(lake, methods=["grpo", "grpo+c3"])
    summary = ingest_flow([str(src)], "chat-jsonl", 0, cfg)
    # bad UTF-8 costs that record only (issue 22): the file is read, its one line quarantined verbatim
    assert summary["trajectories"] == 8 and summary["unreadable_files"] == 0
    q = lake.read("quarantine", 0).to_pylist()
    reasons = {Path(r["source_file"]).name: r["reason"] for r in q}
    assert not reasons["corrupt.jsonl"].startswith(UNREADABLE)
    assert any(r["source_file"].endswith("rollouts-1.jsonl") for r in q)
    corrupt = next(r for r in q if r["source_file"].endswith("corrupt.jsonl"))
    assert "garbage" in corrupt["raw"] and corrupt["stage"] == "ingest:chat-jsonl"  # a record of the file

    result = run_process(cfg, 0, quiet=True)
    assert result["quarantined"] == len(q) == 2
    assert result["rows"]["advantages"] == 2 * lake.read("steps", 0).num_rows


def test_ingest_flow_with_only_corrupt_files_fails_clearly(tmp_path, prefect_harness):
    src = tmp_path / "src"
    src.mkdir()
    (src / "bad.jsonl").write_bytes(b"\xff\xff\xff")
    lake = Lake(tmp_path / "lake")
    with pytest.raises(ValueError, match="no trajectory could be ingested"):
        ingest_flow([str(src)], "chat-jsonl", 3, cfg_for(lake))
    assert lake.read("quarantine", 3).num_rows == 1
