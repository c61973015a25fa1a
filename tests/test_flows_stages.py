"""Flows pass stages as their declarations (pipeline.stages.BatchStage): what a stage reads and writes, its
cache key's code version, the summary's lists and the degraded-batch check all come from the declaration
(issue 35)."""

from __future__ import annotations

import pickle
import shutil

import pytest

from pipeline.config import Config
from pipeline.stages import get_stage, load_stages, method_part


def test_reads_and_writes_live_on_the_stage():
    """Hand-computed parts of one batch for a round of two methods, one of them with the C3 refiner."""
    cfg = Config(methods=["grpo", "grpo+c3"])
    credit, export, detect = get_stage("credit"), get_stage("export"), get_stage("detect")
    assert credit.reads("b00001", cfg) == [("spans", "b00001", "spans")]
    assert credit.writes("b00001", cfg.methods) == [
        ("advantages", "b00001.grpo", "advantages[grpo]"),
        ("advantages", "b00001.grpo-c3", "advantages[grpo+c3]"),
    ]
    assert credit.inputs("b00001", cfg) == [
        ("trajectories", "b00001"),
        ("steps", "b00001"),
        ("spans", "b00001"),
    ]
    assert export.reads("b2", cfg) == [
        ("advantages", "b2.grpo", "advantages[grpo]"),
        ("advantages", "b2.grpo-c3", "advantages[grpo+c3]"),
    ]
    assert export.outputs("b2", ["gae"]) == [("train_batch", "b2.gae")]
    assert detect.writes("b0", cfg.methods) == [("spans", "b0", "spans")] and detect.reads("b0", cfg) == []
    assert method_part("b0", "a b/c+d") == "b0.a_b_c-d"  # the lake's file-name alphabet


def test_a_stage_travels_by_name():
    """To a worker process (pickle) a stage goes as its name and comes back as the registry's declaration (its
    functions, lambdas included, stay where they are declared); a task run is named by it."""
    for stage in load_stages().values():
        assert pickle.loads(pickle.dumps(stage)) is stage
        assert f"{stage}-b0" == f"{stage.name}-b0"


def test_code_version_hashes_the_stage_sources_only(tmp_path, monkeypatch):
    """A stage's cache key holds the hash of its own sources: an edit of pipeline/stages.py or flows/batch.py
    (the declarations' module, the flow's) re-runs no stage; an edit of the stage's package does."""
    import flows.caching as caching

    stage = get_stage("detect")
    before = caching.code_version(stage)
    assert not {"pipeline/stages.py", "flows/batch.py"} & set(stage.code_paths())
    copy = tmp_path / "tree"
    for rel in stage.code_paths():
        src = caching.ROOT / rel
        if src.is_dir():
            shutil.copytree(src, copy / rel)
        else:
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, copy / rel)
    for rel in ("pipeline/stages.py", "flows/batch.py"):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_text((caching.ROOT / rel).read_text() + '\n"""an edited docstring"""\n')
    monkeypatch.setattr(caching, "ROOT", copy)
    caching._source_hash.cache_clear()
    try:
        assert caching.code_version(stage) == before
        module = copy / stage.code_paths()[0]
        target = module if module.is_file() else sorted(module.rglob("*.py"))[0]
        target.write_text(target.read_text() + "\n# changed\n")
        caching._source_hash.cache_clear()
        assert caching.code_version(stage) != before
    finally:
        caching._source_hash.cache_clear()


def test_summary_lists_come_from_the_declarations():
    from flows.summary import declared_stages, output_tables

    names = [s.name for s in declared_stages()]
    assert names == ["detect", "annotate", "counterfactual", "credit_stats", "credit", "export"]
    assert set(output_tables()) == {t for s in load_stages().values() for t in s.tables()}
    assert (
        output_tables().index("spans")
        < output_tables().index("advantages")
        < output_tables().index("train_batch")
    )


@pytest.mark.parametrize("fmt", ["delta", "parquet"])
def test_degraded_batches_ask_the_lake_for_its_run_log_parts(fmt, tmp_path, monkeypatch):
    """A stage's degraded batches (run-log rows with warnings) on both lake formats: the parts are the lake's
    own (on Delta, no hand-built part-*.parquet path names a file)."""
    from flows.caching import degraded_batches, would_run
    from warehouse.lake import FORMAT_ENV, Lake
    from warehouse.runlog import record_stage_run

    monkeypatch.setenv(FORMAT_ENV, fmt)
    lake = Lake(tmp_path / "lake")
    stage = get_stage("counterfactual")
    record_stage_run(lake, 0, stage.name, "b0", seconds=0.1, warnings=["endpoint down: hindsight used"])
    record_stage_run(lake, 0, stage.name, "b1", seconds=0.1)
    record_stage_run(lake, 0, "credit", "b2", seconds=0.1, warnings=["other stage"])
    assert lake.format == fmt
    assert degraded_batches(lake, 0, stage, ["b0", "b1", "b2"]) == {"b0"}
    assert degraded_batches(lake, 0, get_stage("credit"), ["b0", "b1"]) == set()
    # the flow's and the up-to-date check's one "would run" decision: outputs missing first
    cfg = Config(lake=str(lake.root), methods=["tcpo"])
    assert would_run(lake, 0, stage, ["b0", "b1"], cfg) == {
        "b0": "output part(s) missing",
        "b1": "output part(s) missing",
    }
