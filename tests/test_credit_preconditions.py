"""Issue 24: method preconditions checked before a round starts. The pure check (pipeline.credit.preconditions)
on hand-made step flags, and `check_preconditions` (what `creditflow process` runs first) on a lake holding the
real FireAct round, which has no verifier scores and no critic values."""

import numpy as np
import pytest

from pipeline.config import Config
from pipeline.credit.preconditions import REQUIREMENTS, unmet


def flags(rows):
    import polars as pl

    cols = ("traj_id", "role", "n_tokens", "has_verifier_score", "has_values", "has_logprobs")
    return pl.DataFrame([dict(zip(cols, r, strict=True)) for r in rows])


STEPS = flags(
    [
        ("a", "user", 5, False, False, False),
        ("a", "assistant", 7, True, False, True),
        ("b", "user", 5, False, False, False),
        ("b", "assistant", 7, False, False, True),  # no verifier score
        ("b", "assistant", 0, False, False, False),  # no tokens: nothing to credit, nothing needed
        ("c", "assistant", 3, True, True, True),
    ]
)


def test_unmet_names_method_column_and_trajectories():
    got = unmet(["grpo", "tcpo+c3", "gae", "grpo+c3"], STEPS, Config())
    assert [(u.method, u.stage, u.column, u.trajectories, u.total) for u in got] == [
        ("tcpo+c3", "tcpo", "verifier_score", ("b",), 3),
        ("gae", "gae", "values", ("a", "b"), 3),
    ]
    line = got[0].line()
    assert line.startswith("tcpo+c3: tcpo needs per-turn verifier scores") and "steps.verifier_score" in line
    assert "1 of 3 trajectories lack it: b" in line and "\n" not in line


def test_a_setting_that_handles_the_gap_lifts_the_requirement():
    cfg = Config(stages={"tcpo": {"missing_score": "zero"}})
    assert unmet(["tcpo"], STEPS, cfg) == []
    assert unmet(["grpo", "rloo", "grpo+c3"], STEPS, Config()) == []


def test_only_the_needed_flags_are_queried():
    from pipeline.credit.preconditions import required_columns

    assert required_columns(["grpo", "grpo+iapo+c3", "rloo"], Config()) == set()  # no query at all
    assert required_columns(["grpo", "tcpo", "gae+c3"], Config()) == {"verifier_score", "values"}
    assert required_columns(["gae_pr", "turn_ppo"], Config()) == {"values"}


def test_step_flags_by_hand_and_a_column_the_table_lacks():
    import pyarrow as pa

    from pipeline.credit.preconditions import step_flags

    steps = pa.table(
        {
            "traj_id": ["a", "a", "b"],
            "role": ["user", "assistant", "assistant"],
            "token_offsets": pa.array([[0, 1], [2, 3, 4], []], pa.list_(pa.int32())),
            "verifier_score": pa.array([None, 0.5, None], pa.float64()),
        }
    )
    got = step_flags(steps, {"verifier_score", "values"}).to_pydict()  # `values`: in no part of an older lake
    assert got["n_tokens"] == [2, 3, 0]
    assert got["has_verifier_score"] == [False, True, False]
    assert got["has_values"] == [False, False, False]
    assert set(got) == {"traj_id", "role", "n_tokens", "has_verifier_score", "has_values"}


def test_every_declared_stage_is_a_registered_method():
    from pipeline.credit.registry import ESTIMATORS, REFINERS

    assert set(REQUIREMENTS) <= set(ESTIMATORS) | set(REFINERS)


def test_methods_declare_their_requirements_where_they_are_registered():
    import pipeline.credit  # noqa: F401  (registers the methods)
    from pipeline.credit.registry import ESTIMATORS

    def needing(column):
        return {n for n, s in ESTIMATORS.items() if any(r.column == column for r in s.requires)}

    tcpo_family = {"tcpo", "tcpo_random_cf", "tcpo_all_cf", "tcpo_retro_hin", "tcpo_retro"}
    assert needing("verifier_score") == tcpo_family | {"delta_reward", "turn_reward", "traj_reward"}
    assert needing("values") == {"gae", "gae_pr", "turn_ppo"}


def test_registration_is_loud():
    import pipeline.credit  # noqa: F401
    from pipeline.credit.registry import ESTIMATORS, estimator

    def grpo(ctx, settings):  # another function under a registered name
        return None

    with pytest.raises(ValueError, match="registered twice"):
        estimator("grpo")(grpo)
    with pytest.raises(ValueError, match="COMPONENT_FIELDS"):
        estimator("brand_new", components=("a_hat", "not_a_component"))(grpo)
    with pytest.raises(ValueError, match="declares no components"):  # components= is mandatory
        estimator("brand_new")(grpo)
    assert (
        "brand_new" not in ESTIMATORS and ESTIMATORS["grpo"].fn.__module__ == "pipeline.credit.methods.grpo"
    )


def test_a_component_the_estimator_does_not_declare_is_an_error():
    """A result's components are those its chain declares: one it does not declare fails the batch, naming
    it (a schema that lacked it dropped it silently before)."""
    from credit_rounds import random_round

    from pipeline.credit.batch import CreditBatch
    from pipeline.credit.registry import ESTIMATORS, MethodError, estimator, run_methods
    from pipeline.credit.result import CreditResult

    def undeclared(ctx, settings):
        return CreditResult.per_step(
            ctx, np.zeros(ctx.n_steps), {"a_hat": np.zeros(ctx.n_steps), "w": np.zeros(ctx.n_steps)}
        )

    estimator("test_undeclared", components=("a_hat",))(undeclared)
    try:
        ctx = CreditBatch.from_arrow(*random_round(1, max_groups=2, max_group_size=2, max_steps=3))
        with pytest.raises(MethodError, match=r"components \['w'\] it does not declare"):
            run_methods(ctx, ["test_undeclared"])
    finally:
        ESTIMATORS.pop("test_undeclared")


@pytest.fixture
def fireact_lake(tmp_path, real_data):
    """A lake whose round 0 is the shipped FireAct file: no verifier scores, no critic values."""
    from pipeline.ingest import ingest
    from warehouse.lake import Lake
    from warehouse.rounds import write_round

    path = next((real_data / "fireact_hotpotqa").glob("*.json"))
    res = ingest("react", [(path.name, path.read_text())])
    lake = Lake(tmp_path / "lake")
    write_round(lake, 0, res.trajectories, res.steps)
    return lake


def test_process_stops_before_any_work_with_one_line(fireact_lake):
    from flows.run import check_preconditions

    lake = fireact_lake
    cfg = Config(lake=str(lake.root), methods=["grpo", "tcpo", "gae+c3"])
    with pytest.raises(SystemExit) as exc:
        check_preconditions(cfg, lake, 0)
    msg = str(exc.value)
    assert "\n" not in msg and "tcpo: tcpo needs per-turn verifier scores" in msg
    assert "gae+c3: gae needs critic values (steps.values); 500 of 500 trajectories lack it" in msg
    assert "--skip-unmet" in msg
    assert not lake.parts("advantages", 0)  # nothing was computed
    kept, skipped = check_preconditions(cfg, lake, 0, skip_unmet=True)
    assert kept.methods == ["grpo"] and skipped == [
        "tcpo: need per-turn verifier scores (or tcpo.missing_score=zero) (steps.verifier_score), "
        "missing on 500 of 500 trajectories",
        "gae+c3: need critic values (steps.values), missing on 500 of 500 trajectories",
    ]
    # methods that lack the same input share one line
    cfg3 = cfg.model_copy(update={"methods": ["grpo", "gae", "gae+c3", "tcpo"]})
    _, grouped = check_preconditions(cfg3, lake, 0, skip_unmet=True)
    assert grouped[0].startswith("gae, gae+c3: need critic values") and len(grouped) == 2
    with pytest.raises(SystemExit, match="no method left"):
        check_preconditions(cfg.model_copy(update={"methods": ["tcpo"]}), lake, 0, skip_unmet=True)


def test_a_lake_whose_steps_never_held_the_column_reads_it_as_missing(tmp_path, real_data, monkeypatch):
    """An older (hive) lake: its steps parts have no `values` column at all (not a null one)."""
    import pyarrow.parquet as pq

    from flows.run import check_preconditions
    from pipeline.ingest import ingest
    from warehouse.lake import FORMAT_ENV, Lake
    from warehouse.rounds import write_round

    monkeypatch.setenv(FORMAT_ENV, "parquet")
    path = next((real_data / "fireact_hotpotqa").glob("*.json"))
    res = ingest("react", [(path.name, path.read_text())])
    lake = Lake(tmp_path / "lake")
    write_round(lake, 0, res.trajectories, res.steps)
    assert lake.format == "parquet"
    for part in lake.parts("steps", 0):
        table = pq.read_table(part)
        pq.write_table(table.drop_columns(["values"]), part)
    cfg = Config(lake=str(lake.root), methods=["grpo", "gae"])
    kept, skipped = check_preconditions(cfg, lake, 0, skip_unmet=True)
    assert kept.methods == ["grpo"]
    assert skipped == ["gae: need critic values (steps.values), missing on 500 of 500 trajectories"]


def test_a_column_no_part_holds_is_never_read_to_find_out(tmp_path, real_data, monkeypatch):
    """The older-lake check takes the parts' schemas (Lake.columns), not reads: one read of the steps, of
    the held columns only (before: a read with `values` that failed, then one read per required column)."""
    import pyarrow.parquet as pq

    from flows.run import round_step_flags
    from pipeline.ingest import ingest
    from warehouse.lake import FORMAT_ENV, Lake
    from warehouse.rounds import write_round

    monkeypatch.setenv(FORMAT_ENV, "parquet")
    path = next((real_data / "fireact_hotpotqa").glob("*.json"))
    res = ingest("react", [(path.name, path.read_text())])
    lake = Lake(tmp_path / "lake")
    write_round(lake, 0, res.trajectories, res.steps)
    for part in lake.parts("steps", 0):
        pq.write_table(pq.read_table(part).drop_columns(["values"]), part)
    reads = []
    real_read = lake.read
    monkeypatch.setattr(lake, "read", lambda *a, **k: reads.append(k.get("columns")) or real_read(*a, **k))
    got = round_step_flags(lake, 0, {"values", "verifier_score"})
    assert reads == [["traj_id", "role", "token_offsets", "verifier_score"]]
    assert got.column_names == ["traj_id", "role", "n_tokens", "has_values", "has_verifier_score"]
    assert not any(got.column("has_values").to_pylist()) and got.num_rows == res.steps.num_rows


def test_cli_process_one_line_and_nonzero_exit(fireact_lake):
    from typer.testing import CliRunner

    from flows.cli import app

    lake = fireact_lake
    out = CliRunner().invoke(
        app, ["process", "--lake", str(lake.root), "--round", "0", "--methods", "grpo,tcpo"]
    )
    assert out.exit_code != 0
    # SystemExit(message): Python prints the message as one line on stderr; CliRunner keeps it as the exception
    text = out.output + str(out.exception)
    assert "tcpo: tcpo needs per-turn verifier scores" in text and "500 of 500 trajectories" in text
    assert "Traceback" not in out.output and not lake.parts("advantages", 0)


@pytest.mark.slow
def test_skip_unmet_computes_the_others_and_records_the_skipped(tmp_path, real_data, prefect_harness):
    import pyarrow.compute as pc

    from flows.run import run_process
    from flows.summary import round_summary
    from pipeline.ingest import ingest
    from warehouse.catalog import query
    from warehouse.lake import Lake
    from warehouse.rounds import write_round

    path = next((real_data / "fireact_hotpotqa").glob("*.json"))
    res = ingest("react", [(path.name, path.read_text())])
    trajs = res.trajectories.slice(0, 60)
    steps = res.steps.filter(pc.is_in(res.steps["traj_id"], value_set=trajs["traj_id"]))
    lake = Lake(tmp_path / "lake")
    write_round(lake, 0, trajs, steps)
    cfg = Config(lake=str(lake.root), methods=["grpo", "tcpo"])
    summary = run_process(cfg, 0, quiet=True, skip_unmet=True)
    assert summary["methods"] == "grpo"
    assert summary["skipped (unmet preconditions)"].startswith("tcpo: need per-turn verifier scores")
    methods = query(lake, "SELECT DISTINCT method FROM advantages WHERE round = 0")["method"].to_pylist()
    assert methods == ["grpo"]
    after = round_summary(lake, 0)  # what `creditflow stats` prints
    assert after["stages"]["preconditions"]["warnings"] == 1
    assert after["notes"]["preconditions.skipped_methods"] == 1
