"""process_round_flow: same output as the plain per-batch functions, caching (a finished round re-runs with
no work; deleted outputs and changed settings/inputs are recomputed), the warning state when the LLM
endpoint is down, the Ray runner bit for bit, and `creditflow stats`."""

from __future__ import annotations

import os
import socket

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from flows.batch import round_stages, run_batch_plain
from flows.config import load_config
from flows.process_round import WARNING_STATE
from flows.run import run_process
from pipeline.synth import SynthSettings, generate
from warehouse.lake import Lake, lake_path
from warehouse.rounds import batch_names, write_round

RULE_METHODS = ["grpo", "grpo+c3", "grpo+iapo"]


def make_round(
    lake: Lake, round_: int = 0, groups: int = 8, batch_groups: int = 2, seed: int = 0
) -> list[str]:
    # 6 turns: enough successes that groups have mixed rewards (non-zero GRPO advantages)
    traj, steps = generate(
        SynthSettings(groups=groups, samples=4, turns=6, tokens=40, seed=seed, round=round_)
    )
    return write_round(lake, round_, traj, steps, batch_groups=batch_groups)


def cfg_for(lake: Lake, methods=RULE_METHODS, sets=(), **fields):
    return load_config(
        None,
        ["flow.progress=false", "flow.retry_delay_s=0", *sets],
        lake=str(lake.root),
        methods=list(methods),
        **fields,
    )


def sorted_table(lake: Lake, table: str, round_: int = 0) -> pa.Table:
    keys = {
        "advantages": ["method", "traj_id", "step_idx"],
        "train_batch": ["method", "traj_id"],
        "spans": ["traj_id", "step_idx", "token_start", "rule"],
        "nodes": ["traj_id", "turn"],
        "edges": None,
    }[table]
    t = lake.read(table, round_)
    if keys is None:
        keys = [
            c
            for c in t.column_names
            if pa.types.is_string(t.schema.field(c).type) or pa.types.is_integer(t.schema.field(c).type)
        ]
    return t.sort_by([(k, "ascending") for k in keys])


def assert_same_tables(a: Lake, b: Lake, tables=("advantages", "train_batch", "spans", "nodes", "edges")):
    for table in tables:
        ta, tb = sorted_table(a, table), sorted_table(b, table)
        assert ta.num_rows > 0, table
        assert ta.equals(tb), f"{table} differs"


def mtimes(lake: Lake, table: str) -> dict[str, int]:
    """Each part's identity (file, size, mtime; on Delta: its data files from the log): unchanged when unwritten."""
    return {p.name: lake.part_stat(table, 0, lake.part_name(p)) for p in lake.parts(table, 0)}


def test_flow_matches_plain_functions_and_reruns_cached(tmp_path, prefect_harness):
    flow_lake, plain_lake = Lake(tmp_path / "flow"), Lake(tmp_path / "plain")
    batches = make_round(flow_lake)
    make_round(plain_lake)
    assert len(batches) == 4

    cfg = cfg_for(flow_lake)
    summary = run_process(cfg, 0, quiet=True)
    assert summary["state"] == "Completed"
    assert list(summary["this_run"]) == ["detect", "annotate", "credit", "export"]
    assert [s.name for s in round_stages(cfg)] == list(summary["this_run"])
    assert all(r["batches"] == 4 and r["cached"] == 0 for r in summary["this_run"].values())
    assert summary["trajectories"] == 32 and summary["rows"]["train_batch"] == 32 * len(RULE_METHODS)
    assert summary["stages"]["credit"]["batches"] == 4

    plain_cfg = cfg_for(plain_lake)
    for b in batch_names(plain_lake, 0):
        run_batch_plain(plain_lake, 0, b, plain_cfg)
    assert_same_tables(flow_lake, plain_lake)
    adv = flow_lake.read("advantages", 0)
    assert pc.max(pc.list_flatten(adv.column("token_adv"))).as_py() > 0  # a real comparison, not of zeros

    # a finished round: every batch stage is served from the cache, no part is rewritten
    before = {t: mtimes(flow_lake, t) for t in ("spans", "advantages", "train_batch", "stage_runs")}
    again = run_process(cfg, 0, quiet=True)
    assert all(r["cached"] == 4 for r in again["this_run"].values()), again["this_run"]
    assert {t: mtimes(flow_lake, t) for t in before} == before

    # a deleted output part is rebuilt (only that batch's credit and export run again)
    victim = flow_lake.part_name(flow_lake.parts("advantages", 0)[0])
    assert flow_lake.delete_part_names("advantages", 0, [victim]) == 1
    third = run_process(cfg, 0, quiet=True)
    assert flow_lake.has_part("advantages", 0, victim)
    assert third["this_run"]["credit"]["cached"] == 3 and third["this_run"]["export"]["cached"] == 3
    assert third["this_run"]["detect"]["cached"] == 4
    assert_same_tables(flow_lake, plain_lake)

    # changed credit settings: credit and export run again, the annotation stages stay cached
    changed = run_process(cfg_for(flow_lake, sets=["grpo.eps=0.001"]), 0, quiet=True)
    assert changed["this_run"]["credit"]["cached"] == 0 and changed["this_run"]["export"]["cached"] == 0
    assert changed["this_run"]["detect"]["cached"] == 4 and changed["this_run"]["annotate"]["cached"] == 4


def test_reingested_round_is_recomputed_and_stale_parts_pruned(tmp_path, prefect_harness):
    lake = Lake(tmp_path / "lake")
    make_round(lake, batch_groups=2)
    cfg = cfg_for(lake, methods=["grpo"])
    run_process(cfg, 0, quiet=True)
    assert len(lake.parts("advantages", 0)) == 4
    # same round re-ingested with other data and fewer, larger batches
    make_round(lake, batch_groups=4, seed=1)
    second = run_process(cfg, 0, quiet=True)
    assert second["this_run"]["credit"]["cached"] == 0
    assert sorted(p.name for p in lake.parts("advantages", 0)) == [
        "part-b00000.grpo.parquet",
        "part-b00001.grpo.parquet",
    ]
    other = Lake(tmp_path / "other")
    make_round(other, batch_groups=4, seed=1)
    for b in batch_names(other, 0):
        run_batch_plain(other, 0, b, cfg_for(other, methods=["grpo"]))
    assert_same_tables(lake, other, tables=("advantages", "train_batch"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_llm_endpoint_down_completes_with_warnings(tmp_path, prefect_harness):
    lake = Lake(tmp_path / "lake")
    make_round(lake, groups=4, batch_groups=2)
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    cfg = cfg_for(
        lake,
        methods=["grpo", "tcpo"],
        sets=[
            f"llm.endpoints=[{url}]",
            "llm.max_retries=0",
            "llm.timeout_s=2",
            "llm.cache=false",
            "llm.model=m",
        ],
    )
    summary = run_process(cfg, 0, quiet=True)
    assert summary["state"] == WARNING_STATE
    assert summary["warnings"] and all(w.startswith("counterfactual:") for w in summary["warnings"])
    assert summary["stages"]["counterfactual"]["warnings"] >= 2
    fallbacks = {k: v for k, v in summary["notes"].items() if "fallback" in k}
    assert fallbacks and sum(fallbacks.values()) > 0
    # the round is complete: every method of every batch, tcpo on its hindsight fallback
    adv = lake.read("advantages", 0)
    assert set(adv.column("method").to_pylist()) == {"grpo", "tcpo"}
    assert adv.num_rows == 2 * lake.read("steps", 0).num_rows


def test_worker_processes_match_threads_only(tmp_path, prefect_harness, monkeypatch):
    """flow.processes: the batch stages run in worker processes with the same output as in the flow's threads;
    a worker is another process, sees this process's environment as of the call, and its errors arrive here."""
    from flows import workers

    threads, procs = Lake(tmp_path / "threads"), Lake(tmp_path / "procs")
    make_round(threads)
    make_round(procs)
    run_process(cfg_for(threads, sets=["flow.processes=false"], max_workers=2), 0, quiet=True)
    summary = run_process(cfg_for(procs, sets=["flow.processes=true"], max_workers=2), 0, quiet=True)
    assert summary["state"] == "Completed" and all(r["batches"] == 4 for r in summary["this_run"].values())
    assert_same_tables(threads, procs)
    assert not workers._pools  # shut down with the flow run

    assert workers.use_processes(cfg_for(procs, max_workers=2))  # auto: on with two workers
    assert workers.use_processes(cfg_for(procs, max_workers=1))  # one worker too: off the flow's threads
    assert not workers.use_processes(cfg_for(procs, sets=["flow.processes=false"], max_workers=2))
    assert not workers.use_processes(cfg_for(procs, task_runner="ray", max_workers=2))
    try:
        assert workers.run(1, os.getpid) != os.getpid()
        monkeypatch.setenv("CREDITFLOW_PROBE", "set after the pool started")
        assert workers.run(1, os.getenv, "CREDITFLOW_PROBE") == "set after the pool started"
        with pytest.raises(ValueError, match="invalid literal"):
            workers.run(1, int, "not a number")
        with pytest.raises(RuntimeError, match="worker process died while running _exit"):
            workers.run(1, os._exit, 3)
        assert workers.run(1, os.getpid) != os.getpid()  # the broken pool was replaced
    finally:
        workers.shutdown()


def test_worker_processes_warm_in_background(tmp_path):
    """`creditflow process` starts the worker processes from a thread before the API comes up: a config that
    uses them gets a warm pool, one that does not starts nothing."""
    import threading

    from flows import workers

    lake = Lake(tmp_path / "lake")

    def warm_threads():
        return [t for t in threading.enumerate() if t.name == "creditflow-warm"]

    workers.warm_in_background(cfg_for(lake, sets=["flow.processes=false"], max_workers=2))
    assert not warm_threads() and not workers._pools
    try:
        workers.warm_in_background(cfg_for(lake, sets=["flow.processes=true"], max_workers=1))
        for t in warm_threads():
            t.join(timeout=60)
        assert 1 in workers._pools and workers.run(1, os.getpid) != os.getpid()
    finally:
        workers.shutdown()


def test_worker_death_names_an_unguarded_main_script(monkeypatch):
    """Started from a plain script, the error says why workers may die: they import that script."""
    import sys
    import types

    from flows import workers

    script = types.ModuleType("__main__")
    script.__file__, script.__spec__ = "/somewhere/train.py", None
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert "/somewhere/train.py" in workers._script_hint() and "__name__" in workers._script_hint()
    script.__spec__ = types.SimpleNamespace(name="train")  # python -m train, a console script: no hint
    assert workers._script_hint() == ""


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["processes", "ray", "dask"])
def test_process_runner_matches_thread_runner(tmp_path, prefect_harness, runner):
    """Prefect's ProcessPoolTaskRunner, Ray and Dask: the same tables as the thread runner, bit for bit."""
    if runner != "processes":
        pytest.importorskip({"ray": "prefect_ray", "dask": "prefect_dask"}[runner])
    threads, other = Lake(tmp_path / "threads"), Lake(tmp_path / runner)
    make_round(threads)
    make_round(other)
    run_process(cfg_for(threads), 0, quiet=True)
    if runner == "ray":
        _process_in_own_process(other, tmp_path, runner)
    else:
        summary = run_process(cfg_for(other, task_runner=runner, max_workers=2), 0, quiet=True)
        assert summary["task_runner"] == runner and summary["state"] == "Completed"
        assert all(r["batches"] == 4 for r in summary["this_run"].values())
    assert_same_tables(threads, other)
    # bit for bit: each advantages part holds the same data (read through the lake: hive files or Delta parts)
    pairs = list(zip(threads.parts("advantages", 0), other.parts("advantages", 0), strict=True))
    assert len(pairs) == 4 * len(RULE_METHODS)
    for a, b in pairs:
        assert a.name == b.name
        assert threads.read("advantages", 0, parts=[a]).equals(other.read("advantages", 0, parts=[b]))
    # the cache (policy, records, results) works from Prefect's worker processes too
    if runner == "processes":
        again = run_process(cfg_for(other, task_runner=runner, max_workers=2), 0, quiet=True)
        assert all(r["cached"] == r["batches"] == 4 for r in again["this_run"].values())


def _own_api_env(home) -> dict[str, str]:
    """This environment for a `creditflow` command with no Prefect server: its own ephemeral API in `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    return env


def _process_command(lake: Lake, *options: str) -> list[str]:
    import sys
    from pathlib import Path

    creditflow = str(Path(sys.executable).parent / "creditflow")
    command = [creditflow, "process", "--lake", str(lake.root), "--round", "0"]
    return [*command, "--methods", ",".join(RULE_METHODS), "--set", "flow.progress=false", *options]


def _process_in_own_process(lake: Lake, tmp_path, runner: str) -> None:
    """`creditflow process --task-runner RUNNER` as a command of its own. Ray keeps its authentication mode
    (RAY_AUTH_MODE, read once per process) for the life of the process: after the token-authenticated
    two-node cluster of tests/test_flows_cluster.py, a throwaway local Ray (authentication off) started in the
    pytest process had its workers' calls to the driver refused (OwnerDiedError in a clean-clone CI run)."""
    import re
    import subprocess

    env = {**_own_api_env(tmp_path / "prefect-home"), "COLUMNS": "200"}
    env = {k: v for k, v in env.items() if not k.startswith("RAY_")}
    cmd = _process_command(
        lake, "--task-runner", runner, "--max-workers", "2", "--set", "flow.retry_delay_s=0"
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"task runner\s*│\s*{runner}\b", proc.stdout), proc.stdout[-3000:]
    stage_rows = re.findall(r"^│ (\w+)\s*│\s*(\d+) │", proc.stdout, flags=re.M)
    assert stage_rows and all(n == "4" for _, n in stage_rows), proc.stdout[-3000:]


def test_stats_command_prints_summary_from_lake(tmp_path, prefect_harness):
    from typer.testing import CliRunner

    from flows.cli import app

    lake = Lake(tmp_path / "lake")
    make_round(lake, groups=4, batch_groups=2)
    run_process(cfg_for(lake), 0, quiet=True)
    result = CliRunner().invoke(
        app, ["stats", "--lake", str(lake.root), "--round", "0"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    for word in (
        "trajectories",
        "spans",
        "nodes / edges",
        "quarantined records",
        "detect",
        "annotate",
        "credit",
        "export",
        str(lake.partition_dir("advantages", 0)),
        "credit by method",
    ):
        assert word in result.output, word
    missing = CliRunner().invoke(app, ["stats", "--lake", str(lake.root), "--round", "7"])
    assert missing.exit_code != 0
    # processing a round that is not there: one clear line naming the round and the rounds present, no flow run
    absent = CliRunner().invoke(
        app, ["process", "--lake", str(lake.root), "--round", "7", "--methods", "grpo"]
    )
    assert absent.exit_code == 1
    assert "round 7 has no trajectories" in absent.output and "rounds there: 0" in absent.output
    assert "Traceback" not in absent.output and not lake.parts("stage_runs", 7)


def test_file_url_lake(tmp_path, prefect_harness):
    lake = Lake(tmp_path / "lake")
    make_round(lake, groups=4, batch_groups=2)
    assert Lake(f"file://{lake.root}").root == lake.root
    cfg = load_config(None, ["flow.progress=false"], lake=f"file://{lake.root}", methods=["grpo"])
    summary = run_process(cfg, 0, quiet=True)
    assert summary["rows"]["advantages"] == lake.read("steps", 0).num_rows
    assert Lake("s3://bucket/lake").format == "delta"  # object storage: a Delta lake (tests/test_lake_s3.py)
    with pytest.raises(ValueError, match="not a local folder"):
        lake_path("ftp://host/lake")
    assert os.path.isdir(lake.partition_dir("train_batch", 0))


def test_llm_stages_retry_with_exponential_backoff(tmp_path):
    from flows.caching import BatchStageCache
    from flows.process_round import _stage_task
    from pipeline.stages import get_stage

    lake = Lake(tmp_path / "lake")
    cfg = load_config(None, ["flow.retries=3", "flow.retry_delay_s=2"], lake=str(lake.root))
    llm_cfg = load_config(None, [], lake=str(lake.root), annotator="llm")
    assert get_stage("counterfactual").calls_llm(cfg) and not get_stage("detect").calls_llm(cfg)
    # the annotate stage calls a model only with the llm annotator (rules: no retries, may run in a worker process)
    assert get_stage("annotate").calls_llm(llm_cfg) and not get_stage("annotate").calls_llm(cfg)
    llm = _stage_task(cfg, lake, True)
    assert llm.retries == 3 and llm.retry_delay_seconds == [2.0, 4.0, 8.0]
    assert isinstance(llm.cache_policy, BatchStageCache) and llm.cache_policy.key_storage.startswith(
        str(lake.root)
    )
    plain = _stage_task(cfg, lake, False)
    assert plain.retries == 0
    uncached = _stage_task(load_config(None, ["flow.cache=false"], lake=str(lake.root)), lake, False)
    assert not isinstance(uncached.cache_policy, BatchStageCache)


@pytest.mark.slow
def test_own_ephemeral_api_records_every_task_run_without_heartbeats(tmp_path):
    """`creditflow process` with no PREFECT_API_URL: its own ephemeral API records task runs in batches and the
    flow sends no heartbeats (flows/runners.py); every task run is in Prefect's database once the command has
    exited (the recorder's last batch is written when the server stops), with its final state."""
    import sqlite3
    import subprocess

    lake = Lake(tmp_path / "lake")
    n_batches = len(make_round(lake))
    home = tmp_path / "prefect-home"
    env = _own_api_env(home)
    cmd = _process_command(lake)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = round_stages(cfg_for(lake))
    with sqlite3.connect(home / "prefect.db") as db:
        runs = db.execute(
            "SELECT task_run.name, task_run.state_type FROM task_run JOIN flow_run "
            "ON task_run.flow_run_id = flow_run.id WHERE flow_run.name = 'process lake round 0'"
        ).fetchall()
        heartbeats = db.execute(
            "SELECT count(*) FROM events WHERE event = 'prefect.flow-run.heartbeat'"
        ).fetchone()
    names = sorted(name for name, _ in runs)
    assert names == sorted([f"{s}-{b}" for s in stages for b in batch_names(lake, 0)] + ["stats-round-0"])
    assert len(names) == n_batches * len(stages) + 1
    assert {state for _, state in runs} == {"COMPLETED"}
    assert heartbeats == (0,)


def test_own_api_settings_leave_a_server_and_the_users_settings_alone(monkeypatch):
    """The heartbeat / recorder settings apply only to an API this process owns, and never over the user's."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE,
        temporary_settings,
    )

    from flows.runners import OWN_API_RECORDER_BATCH, _own_api_settings

    for key in (
        "PREFECT_API_URL",
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY",
        "PREFECT_RUNNER_HEARTBEAT_FREQUENCY",
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE",
    ):
        monkeypatch.delenv(key, raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        own = _own_api_settings()
        assert own[PREFECT_FLOWS_HEARTBEAT_FREQUENCY] is None
        assert own[PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE] == OWN_API_RECORDER_BATCH
        monkeypatch.setenv("PREFECT_RUNNER_HEARTBEAT_FREQUENCY", "60")  # the legacy name counts as the user's
        monkeypatch.setenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", "5")
        assert set(_own_api_settings()) == set(own) - {
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
            PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE,
        }
    with temporary_settings(updates={PREFECT_API_URL: "http://prefect.example:4200/api"}):
        assert _own_api_settings() == {}


def test_stage_runs_record_the_cache_key_prefect_computed(tmp_path, prefect_harness, monkeypatch):
    """The stage task takes its cache key from Prefect's transaction (BatchStageCache computed it a moment
    before from the same inputs) instead of hashing the inputs a second time; the key it records is the one
    the inputs give."""
    import flows.process_round as pr
    from flows.caching import stage_cache_key
    from pipeline.stages import get_stage
    from warehouse.runlog import read_stage_runs

    lake = Lake(tmp_path / "lake")
    batches = make_round(lake)
    cfg = cfg_for(lake)

    def again(*args, **kwargs):
        raise AssertionError("the task body hashed the inputs again")

    monkeypatch.setattr(pr, "stage_cache_key", again)
    run_process(cfg, 0, quiet=True)
    runs = read_stage_runs(lake, 0).to_pylist()
    assert len(runs) == len(batches) * len(round_stages(cfg))
    for run in runs:
        stage = get_stage(run["stage"])
        assert run["cache_key"] == stage_cache_key(str(lake.root), 0, run["batch"], stage, cfg), run


def test_settings_scope_builds_the_derived_settings_once(monkeypatch):
    """`settings_scope` is `temporary_settings` with the derived Settings kept: the same updates on the same
    settings reuse it, updates already in effect enter no scope, and leaving restores the settings before."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, Settings, get_current_settings

    from flows.runners import settings_scope

    built = []
    copy = Settings.copy_with_update
    monkeypatch.setattr(Settings, "copy_with_update", lambda self, **kw: built.append(kw) or copy(self, **kw))
    base = get_current_settings()
    with settings_scope({PREFECT_LOCAL_STORAGE_PATH: "/tmp/creditflow-a"}) as a:
        assert str(PREFECT_LOCAL_STORAGE_PATH.value()) == "/tmp/creditflow-a"
        with settings_scope({PREFECT_LOCAL_STORAGE_PATH: "/tmp/creditflow-a"}) as inner:
            assert inner is a
    assert get_current_settings() is base
    with settings_scope({PREFECT_LOCAL_STORAGE_PATH: "/tmp/creditflow-a"}) as again:
        assert again is a
        with settings_scope({PREFECT_LOCAL_STORAGE_PATH: "/tmp/creditflow-b"}) as b:
            assert str(PREFECT_LOCAL_STORAGE_PATH.value()) == "/tmp/creditflow-b" and b is not a
        assert str(PREFECT_LOCAL_STORAGE_PATH.value()) == "/tmp/creditflow-a"
    assert len(built) == 2
    assert str(PREFECT_LOCAL_STORAGE_PATH.value()) == str(PREFECT_LOCAL_STORAGE_PATH.value_from(base))

    # a long-lived process that sees many lakes keeps only the newest derived settings
    from flows import runners

    for i in range(runners.SETTINGS_SCOPES_KEPT + 3):
        with settings_scope({PREFECT_LOCAL_STORAGE_PATH: f"/tmp/creditflow-{i}"}):
            pass
    assert len(runners._scopes) == runners.SETTINGS_SCOPES_KEPT


class _HeartbeatEngine:
    """What prefect.flow_engine._send_heartbeats reads of a flow run engine: heartbeats on (30 s, Prefect's
    minimum), a run with no state yet (the thread keeps beating), its heartbeats counted."""

    heartbeat_seconds = 30
    flow_run = None

    def __init__(self) -> None:
        import logging
        import threading

        self.logger = logging.getLogger("test.heartbeats")
        self.sent = threading.Event()

    def _build_heartbeat_event_template(self):
        return {"prefect.resource.id": "prefect.flow-run.test"}, []

    def _emit_flow_run_heartbeat(self, resource, related) -> None:
        self.sent.set()


def test_flow_run_end_does_not_wait_for_the_heartbeat_thread(monkeypatch):
    """Importing the flow module makes the sync flow engine leave its heartbeat thread unjoined (as Prefect's
    async engine does): a run's end no longer waits up to 1 s for the thread's sleep step. Heartbeats are still
    sent, the thread ends at its next step, and Prefect's own function joins (the contrast: the patch is what
    changed it)."""
    import threading

    import prefect.flow_engine as engine

    import flows.process_round as process_round

    send = engine._send_heartbeats
    assert getattr(send, "creditflow_unjoined", False)
    process_round.unjoined_heartbeats()  # once per process: a second call leaves it as it is
    assert engine._send_heartbeats is send
    joined: list[threading.Thread] = []
    monkeypatch.setattr(threading.Thread, "join", lambda self, timeout=None: joined.append(self))
    fake = _HeartbeatEngine()
    before = set(threading.enumerate())
    with engine._send_heartbeats(fake):  # type: ignore[arg-type]
        assert fake.sent.wait(30)  # the first heartbeat is sent as the run starts
        (thread,) = set(threading.enumerate()) - before
    assert joined == []
    with send.func(fake):  # type: ignore[attr-defined]  (Prefect's own: joins its thread)
        pass
    assert len(joined) == 1
    monkeypatch.undo()
    thread.join(5)  # the unjoined thread saw the stop event at its next 1 s step
    assert not thread.is_alive()


STAT_METHODS = ["grpo", "gae", "turn_ppo", "gdpo"]  # gae, turn_ppo, gdpo take a round statistic


def _count_stage_reads(monkeypatch) -> list[tuple[str, str, str, str]]:
    """(lake, stage, table, batch) of every trajectories / steps read from disk by the flow's batch stages."""
    import threading

    from flows import batch as fb
    from flows import process_round

    reads: list[tuple[str, str, str, str]] = []
    current = threading.local()
    real_read, real_stage = fb.read_batch, process_round.run_stage

    def counted(lake, table, round_, batch, columns=None):
        if table in ("trajectories", "steps"):
            reads.append((lake.root.name, getattr(current, "stage", "?"), table, batch))
        return real_read(lake, table, round_, batch, columns=columns)

    def staged(lake, round_, batch, stage, *args, **kwargs):
        current.stage = stage.name
        try:
            return real_stage(lake, round_, batch, stage, *args, **kwargs)
        finally:
            current.stage = "?"

    monkeypatch.setattr(fb, "read_batch", counted)
    monkeypatch.setattr(process_round, "run_stage", staged)
    return reads


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_a_threads_flow_reads_each_batch_once_for_statistics_and_credit(
    tmp_path, prefect_harness, monkeypatch, fmt
):
    """The flow's threads (flow.processes=false): each batch's statistics task keeps its trajectories and steps
    reads (and credit batch) for the batch's credit task, which reads neither again; the same advantages as
    with the kept reads off (CREDITFLOW_READ_CACHE_MB=0: credit reads each batch again); nothing is held after
    the round, also when credit was cached and took nothing."""
    from flows import batch as fb
    from pipeline.credit import process

    monkeypatch.setenv("CREDITFLOW_LAKE_FORMAT", fmt)
    kept, plain = Lake(tmp_path / "kept"), Lake(tmp_path / "plain")
    batches = make_round(kept, groups=4)
    make_round(plain, groups=4)
    assert len(batches) == 2
    reads = _count_stage_reads(monkeypatch)
    sets = ["flow.processes=false"]
    monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
    summary = run_process(cfg_for(kept, STAT_METHODS, sets, max_workers=2), 0, quiet=True)
    assert summary["state"] == "Completed" and summary["this_run"]["credit"]["batches"] == 2
    assert not fb._kept and not process._kept_batches and not fb._rounds  # all taken, nothing held

    def per_batch(lake: str) -> dict[str, list[tuple[str, str]]]:
        got: dict[str, list[tuple[str, str]]] = {b: [] for b in batches}
        for name, stage, table, b in reads:
            if name == lake and stage in ("credit_stats", "credit"):
                got[b].append((stage, table))
        return got

    once = [("credit_stats", "trajectories"), ("credit_stats", "steps")]
    assert per_batch("kept") == {b: once for b in batches}
    monkeypatch.setenv(fb.READ_CACHE_ENV, "0")
    run_process(cfg_for(plain, STAT_METHODS, sets, max_workers=2), 0, quiet=True)
    twice = once + [("credit", "trajectories"), ("credit", "steps")]
    assert per_batch("plain") == {b: twice for b in batches}
    assert_same_tables(kept, plain, tables=("advantages", "train_batch"))

    if (
        fmt == "parquet"
    ):  # the statistics parts gone, credit's current: the statistics tasks keep, credit is cached
        for part in kept.parts("credit_stats", 0):
            part.unlink()
        monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
        again = run_process(cfg_for(kept, STAT_METHODS, sets, max_workers=2), 0, quiet=True)
        assert again["this_run"]["credit_stats"]["cached"] == 0 and again["this_run"]["credit"]["cached"] == 2
        assert not fb._kept and not process._kept_batches and not fb._rounds  # dropped at the round's end
        assert_same_tables(kept, plain, tables=("advantages", "train_batch"))


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_kept_reads_off_take_no_part_identity(tmp_path, monkeypatch, fmt):
    """With the kept reads off (CREDITFLOW_READ_CACHE_MB=0, or unset where the statistics pass reads per-token
    lists: turn_ppo's), the statistics pass's reads take no part identity (`Lake.part_stat`: ~1 ms a part on a
    Delta lake, for nothing kept); with a budget they do and keep (#36)."""
    from flows import batch as fb

    monkeypatch.setenv("CREDITFLOW_LAKE_FORMAT", fmt)
    lake = Lake(tmp_path / "lake")
    batches = make_round(lake, groups=4)
    keys: list[tuple] = []  # the kept reads' part identities taken
    real = fb._part_key
    monkeypatch.setattr(fb, "_part_key", lambda *a: keys.append(a[1:]) or real(*a))
    monkeypatch.delenv(fb.READ_CACHE_ENV, raising=False)
    fb.round_statistics(lake, 0, cfg_for(lake, ["turn_ppo"], []), batches)
    assert not keys and not fb._kept
    cfg = cfg_for(lake, ["gae"], [])
    monkeypatch.setenv(fb.READ_CACHE_ENV, "0")
    fb.round_statistics(lake, 0, cfg, batches)
    assert not keys and not fb._kept
    monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
    lake.delete_parts("credit_stats", 0)
    fb.round_statistics(lake, 0, cfg, batches)
    assert {k[0] for k in keys} == {"trajectories", "steps"} and fb._kept
    fb._forget_kept()


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_the_default_keeps_only_small_reads(tmp_path, monkeypatch, fmt):
    """With CREDITFLOW_READ_CACHE_MB unset a plain caller's statistics pass keeps what it read plus credit's
    per-step columns, never a per-token list or a text (`flows.batch._keep_plan`): GDPO's credit then reads
    nothing again and takes the credit batch the pass built; gae's reads only the critic values (its per-token
    list) again, gigpo's the contents;
    turn_ppo's pass reads the values itself and keeps nothing. Nothing is held after; the advantages are those of
    the kept reads off (CREDITFLOW_READ_CACHE_MB=0: credit reads every batch again)."""
    from flows import batch as fb
    from pipeline.credit import process
    from pipeline.credit.process import statistics_json
    from pipeline.stages import get_stage

    monkeypatch.setenv("CREDITFLOW_LAKE_FORMAT", fmt)
    reads: list[tuple[str, tuple[str, ...] | None]] = []
    real = fb.read_batch

    def counted(lake, table, *args, columns=None, **kwargs):
        if table in ("trajectories", "steps"):
            reads.append((table, None if columns is None else tuple(columns)))
        return real(lake, table, *args, columns=columns, **kwargs)

    builds: list[int] = []
    real_build = process.CreditBatch.from_arrow.__func__
    monkeypatch.setattr(fb, "read_batch", counted)
    monkeypatch.setattr(
        process.CreditBatch,
        "from_arrow",
        classmethod(lambda cls, *a, **k: builds.append(1) or real_build(cls, *a, **k)),
    )

    def credit_round(lake: Lake, methods: list[str]) -> tuple[list, int]:
        """The round's statistics pass, then credit on every batch: (credit's reads, its batch builds)."""
        cfg = cfg_for(lake, methods)
        batches = fb.round_batches(lake, 0)
        stats = statistics_json(fb.round_statistics(lake, 0, cfg, batches))
        n_reads, n_builds = len(reads), len(builds)
        for b in batches:
            fb.run_stage(lake, 0, b, get_stage("credit"), cfg, round_stats=stats)
        assert not fb._kept and not process._kept_batches
        return reads[n_reads:], len(builds) - n_builds

    for methods, again in (
        (["gdpo"], []),
        (["gae"], [("steps", ("values",))]),
        (["gdpo", "gigpo"], [("steps", ("content",))]),  # (text: read again, not kept)
        (["turn_ppo"], None),  # (everything read again)
    ):
        kept, plain = Lake(tmp_path / f"kept-{methods[0]}"), Lake(tmp_path / f"plain-{methods[0]}")
        n = len(make_round(kept, groups=4))
        make_round(plain, groups=4)
        monkeypatch.delenv(fb.READ_CACHE_ENV, raising=False)
        got, built = credit_round(kept, methods)
        monkeypatch.setenv(fb.READ_CACHE_ENV, "0")
        off, off_built = credit_round(plain, methods)
        assert len(off) == 2 * n and off_built == n
        if again is None:
            assert got == off and built == n, methods
        else:
            assert got == again * n and built == (0 if methods == ["gdpo"] else n), methods
        assert_same_tables(kept, plain, tables=("advantages",))


def test_a_flow_rounds_kept_reads_outlive_a_plain_pass_and_go_with_its_round(tmp_path, monkeypatch):
    """What a flow's round keeps (flows.batch.keeping_round) is left alone by a plain statistics pass of another
    lake in the same process and by the flow's own barrier (round_statistics of the round), and dropped with
    the round; the plain pass's own kept reads and batches stay until its next pass."""
    from flows import batch as fb
    from pipeline.credit import process
    from pipeline.stages import get_stage

    monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
    a, b = Lake(tmp_path / "a"), Lake(tmp_path / "b")
    first = make_round(a, groups=4)[0]
    make_round(b, groups=4)
    cfg_a, cfg_b = cfg_for(a, ["gae"]), cfg_for(b, ["gae"])
    try:
        with fb.keeping_round(a, 0):
            assert fb.keeps_round(a.uri, 0) and not fb.keeps_round(b.uri, 0)
            fb.run_stage(a, 0, first, get_stage("credit_stats"), cfg_a, keep_reads=True)
            assert len(fb._kept) == 2 and len(process._kept_batches) == 1
            fb.round_statistics(b, 0, cfg_b)  # a plain caller: keeps its 2 batches, a's stay
            assert len(fb._kept) == 6 and len(process._kept_batches) == 3
            fb.round_statistics(a, 0, cfg_a)  # the flow's barrier: the second batch's pass, nothing dropped
            assert len(fb._kept) == 8 and len(process._kept_batches) == 4
        assert {k[0] for k in fb._kept} == {b.uri} and len(fb._kept) == 4 and len(process._kept_batches) == 2
        assert not fb.keeps_round(a.uri, 0) and (a.uri, 0) not in fb._owned
        fb.round_statistics(b, 0, cfg_b)  # every part current: the plain pass drops what it kept before
        assert not fb._kept and not process._kept_batches
    finally:
        fb._forget_kept()


def test_a_statistics_task_finishing_after_its_round_ended_keeps_nothing(tmp_path, monkeypatch):
    """A flow that fails while another batch's statistics task still runs in its thread ends its round first
    (keeping_round drops what is kept); that task's reads and credit batch are dropped when it returns."""
    import contextlib

    from flows import batch as fb
    from flows import process_round
    from pipeline.credit import process
    from pipeline.stages import get_stage

    monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
    lake = Lake(tmp_path / "lake")
    first = make_round(lake, groups=4)[0]
    cfg = cfg_for(lake, ["gae"], ["flow.processes=false", "flow.cache=false"])
    real = process_round.run_stage
    round_ = contextlib.ExitStack()
    seen: list[int] = []

    def the_round_ends_first(*args, **kwargs):
        round_.close()  # the flow's stages ended (failed) after this task started, before it kept anything
        out = real(*args, **kwargs)
        seen.append(len(fb._kept))
        return out

    monkeypatch.setattr(process_round, "run_stage", the_round_ends_first)
    monkeypatch.setattr(process_round, "_log_batch", lambda summary: None)
    try:
        round_.enter_context(fb.keeping_round(lake, 0))
        process_round.batch_stage_task.fn(lake.uri, 0, first, get_stage("credit_stats"), cfg)
        assert seen == [2]  # it kept its reads
        assert not fb._kept and not process._kept_batches and not fb._owned
    finally:
        round_.close()
        fb._forget_kept()


def test_a_runs_summary_leaves_out_stages_its_config_does_not_run(tmp_path, prefect_harness):
    """gae with whitening runs the statistics pass; run again without whitening it does not. The second run's
    summary (the flow's, then the up-to-date path's) leaves the first run's `credit_stats` rows out and names
    them under `earlier`; `creditflow stats` (the lake's state) still lists them."""
    from flows.summary import round_summary

    lake = Lake(tmp_path / "lake")
    make_round(lake, groups=4, batch_groups=2)
    first = run_process(cfg_for(lake, ["gae"]), 0, quiet=True)
    assert "credit_stats" in first["stages"] and first["earlier"] == []
    off = cfg_for(lake, ["gae"], ["gae.whiten=false"])
    second = run_process(off, 0, quiet=True, fast=False)
    assert "credit_stats" not in second["stages"] and "credit" in second["stages"]
    assert second["earlier"] == ["credit_stats"]
    again = run_process(off, 0, quiet=True, fast=True)  # up to date: the summary from the lake, no flow
    assert "credit_stats" not in again["stages"] and again["earlier"] == ["credit_stats"]
    assert "credit_stats" in round_summary(lake, 0)["stages"]
