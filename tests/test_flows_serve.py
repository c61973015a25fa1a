"""Scheduling: the incoming-folder flow (ingest + process each new drop, move it to done/, idempotent), the
deployments `creditflow serve` builds, process-pending, round_loop_flow without and with trainer hooks, and
the example config."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_flows_faults import write_chat_files
from test_flows_process import cfg_for, make_round
from typer.testing import CliRunner

from flows.cli import app
from flows.config import load_config
from flows.incoming import incoming_flow, pending_rounds, process_pending_flow
from flows.round_loop import HOOKS, register_round_hook, round_loop_flow
from warehouse.incoming import read_ledger
from warehouse.lake import Lake

ROOT = Path(__file__).resolve().parents[1]


def test_incoming_folder_ingests_and_processes_each_new_round_once(tmp_path, prefect_harness):
    incoming = tmp_path / "incoming"
    write_chat_files(incoming / "batch-a", n_files=1)
    write_chat_files(incoming / "drop_round=5", n_files=1)
    (incoming / "broken.jsonl").write_bytes(b"\xff\xfe")
    lake = Lake(tmp_path / "lake")
    cfg = cfg_for(lake, methods=["grpo", "grpo+c3"], sets=[f"serve.incoming={incoming}", "serve.settle_s=0"])

    done = incoming_flow(cfg)
    assert {k: v["round"] for k, v in done.items()} == {"batch-a": 0, "drop_round=5": 5, "broken.jsonl": 6}
    assert done["batch-a"]["status"] == "Completed" and done["drop_round=5"]["status"] == "Completed"
    assert done["broken.jsonl"]["status"].startswith("failed")
    assert sorted(p.name for p in (incoming / "done").iterdir()) == ["batch-a", "drop_round=5"]
    assert [p.name for p in (incoming / "failed").iterdir()] == ["broken.jsonl"]
    assert lake.read("advantages", 0).num_rows == 2 * lake.read("steps", 0).num_rows
    assert lake.read("advantages", 5).num_rows > 0
    assert pending_rounds(cfg) == []

    # idempotent: nothing new, nothing done; a new drop gets the next free round
    assert incoming_flow(cfg) == {}
    write_chat_files(incoming / "batch-b", n_files=1)
    again = incoming_flow(cfg)
    assert {k: v["round"] for k, v in again.items()} == {
        "batch-b": 7
    }  # after round 6 (the failed drop keeps its round)
    assert set(read_ledger(lake)) == {"batch-a", "drop_round=5", "broken.jsonl", "batch-b"}


def test_serve_once_cli_and_deployments(tmp_path, prefect_harness):
    from flows.commands.serve import build_deployments

    incoming = tmp_path / "in"
    write_chat_files(incoming / "r", n_files=1)
    lake = tmp_path / "lake"
    result = CliRunner().invoke(
        app,
        [
            "serve",
            "--once",
            "--lake",
            str(lake),
            "--incoming",
            str(incoming),
            "--methods",
            "grpo",
            "--set",
            "serve.settle_s=0",
            "--set",
            "flow.progress=false",
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "round 0: Completed" in result.output
    assert (incoming / "done" / "r").exists()

    cfg = load_config(None, [], lake=str(lake))
    cfg = cfg.model_copy(
        update={"serve": cfg.serve.model_copy(update={"cron": "*/30 * * * *", "incoming": str(incoming)})}
    )
    deployments = build_deployments(cfg)
    assert [d.name for d in deployments] == ["process-pending", "incoming"]
    assert deployments[0].schedules[0].schedule.cron == "*/30 * * * *"
    assert not deployments[1].schedules  # `serve` starts it for new entries only (poll_incoming)
    assert "method:grpo" in deployments[1].tags
    assert deployments[1].parameters["config"]["lake"] == str(lake)
    nothing = CliRunner().invoke(app, ["serve", "--lake", str(lake)])
    assert nothing.exit_code == 2


def test_process_pending_and_round_loop(tmp_path, prefect_harness):
    lake = Lake(tmp_path / "lake")
    make_round(lake, round_=0, groups=4, batch_groups=2)
    make_round(lake, round_=1, groups=4, batch_groups=2, seed=1)
    cfg = cfg_for(lake, methods=["grpo"])
    assert pending_rounds(cfg) == [0, 1]
    assert process_pending_flow(cfg.model_dump(mode="json")) == {0: "Completed", 1: "Completed"}
    assert pending_rounds(cfg) == [] and process_pending_flow(cfg) == {}

    # no trainer: the loop is process-only (here all cached)
    out = round_loop_flow(cfg, start_round=0, rounds=2)
    assert [o["round"] for o in out] == [0, 1] and all("collect" not in o and "train" not in o for o in out)
    assert out[0]["process"]["this_run"]["credit"]["cached"] == 2

    # a trainer's hooks: collect writes the round, train sees the advantages
    calls = []

    def collect(config, round_):
        make_round(Lake(config.lake), round_=round_, groups=4, batch_groups=2, seed=round_)
        calls.append(("collect", round_))
        return {"trajectories": 16}

    def train(config, round_):
        calls.append(("train", round_, Lake(config.lake).read("advantages", round_).num_rows > 0))
        return {"loss": 0.0}

    register_round_hook("collect", collect)
    register_round_hook("train", train)
    try:
        out = round_loop_flow(cfg, start_round=2, rounds=1)
    finally:
        HOOKS.clear()
    assert calls == [("collect", 2), ("train", 2, True)]
    assert out[0]["trajectories"] == 16 and out[0]["loss"] == 0.0 and out[0]["process_state"] == "Completed"


def test_round_loop_resumes_from_the_trainer_status(tmp_path, prefect_harness):
    """The one loop's resume logic: a round the trainer's `status` reports done is skipped (no collect,
    process or train), one it reports processed skips process only; setup's config is the one the hooks get,
    and teardown runs once, also when a hook fails."""
    lake = Lake(tmp_path / "lake")
    cfg = cfg_for(lake, methods=["grpo"])
    calls: list = []
    logs: list[str] = []

    def setup(config, log):
        calls.append("setup")
        return config.model_copy(update={"batch_groups": 7})

    def status(config, round_):
        return {
            "policy": f"p{round_}",
            "done": "checkpoint c0 exists" if round_ == 0 else None,
            "processed": "advantages exist" if round_ == 1 else None,
        }

    def collect(config, round_):
        assert config.batch_groups == 7
        calls.append(("collect", round_))
        if round_ == 3:
            raise RuntimeError("collect failed")
        make_round(Lake(config.lake), round_=round_, groups=4, batch_groups=2, seed=round_)
        return {}

    def train(config, round_):
        calls.append(("train", round_, Lake(config.lake).parts("advantages", round_) != []))
        return {"train_s": 0.0}

    for name, fn in [
        ("setup", setup),
        ("status", status),
        ("collect", collect),
        ("train", train),
        ("teardown", lambda: calls.append("teardown")),
    ]:
        register_round_hook(name, fn)
    try:
        rows = round_loop_flow(cfg, start_round=0, rounds=3, log=logs.append)
        assert calls == [
            "setup",
            ("collect", 1),
            ("train", 1, False),
            ("collect", 2),
            ("train", 2, True),
            "teardown",
        ]
        assert rows[0] == {"round": 0, "policy": "p0", "skipped": True}
        assert rows[1]["process_s"] == 0.0 and "process" not in rows[1]
        assert rows[2]["process_state"] == "Completed" and rows[2]["policy"] == "p2"
        assert "[loop] round 0: checkpoint c0 exists, skipped" in logs
        assert "[loop] round 1: advantages exist, process skipped" in logs
        calls.clear()
        with pytest.raises(RuntimeError, match="collect failed"):
            round_loop_flow(cfg, start_round=3, rounds=1, log=logs.append)
        assert calls == ["setup", ("collect", 3), "teardown"]
    finally:
        HOOKS.clear()


def test_example_config_is_valid_and_maps_flags():
    cfg = load_config(
        ROOT / "config.example.yaml",
        ["flow.retries=1", "serve.cron=0 * * * *", "tcpo.gamma=0.5"],
        task_runner="ray",
        max_workers=4,
    )
    assert cfg.task_runner == "ray" and cfg.max_workers == 4 and cfg.flow.retries == 1
    assert cfg.serve.cron == "0 * * * *" and cfg.settings_named("tcpo").gamma == 0.5
    assert set(cfg.methods) == {"grpo", "grpo+c3", "grpo+iapo", "tcpo"}
