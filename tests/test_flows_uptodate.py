"""The no-op fast path of `creditflow process` (#21.5, flows/uptodate.py): a round processed with the same
inputs, settings and code is reported from the lake without starting Prefect, and writes nothing; any change
(a re-ingested batch, a --set, a code change, a deleted or stale part, a degraded stage, a run in progress)
falls through to the flow, which then does the work."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.config import load_config
from flows.run import run_process
from flows.uptodate import UP_TO_DATE, cache_record_valid, not_up_to_date
from pipeline.synth import SynthSettings, generate
from warehouse.lake import Lake
from warehouse.rounds import read_batch, write_round

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["grpo", "grpo+c3", "gae"]  # an annotation stage, the statistics pass, credit, export


def _cfg(lake: Lake, sets=()):
    return load_config(None, ["flow.progress=false", *sets], lake=str(lake.root), methods=METHODS)


def _files(lake: Lake) -> dict[str, tuple[str, int]]:
    """Every file of the lake (but the round locks, truncated by each holder): content hash and mtime."""
    out = {}
    for p in sorted(lake.root.rglob("*")):
        if p.is_file() and "locks" not in p.parts:
            out[str(p.relative_to(lake.root))] = (
                hashlib.sha256(p.read_bytes()).hexdigest(),
                p.stat().st_mtime_ns,
            )
    return out


def _fast(cfg) -> dict:
    return run_process(cfg, 0, quiet=True, fast=True)


def _processed(tmp_path) -> tuple[Lake, object]:
    lake = Lake(tmp_path / "lake")
    traj, steps = generate(SynthSettings(groups=4, samples=4, turns=4, tokens=40, seed=3))
    write_round(lake, 0, traj, steps, batch_groups=2)
    cfg = _cfg(lake)
    first = _fast(cfg)  # nothing processed yet: the flow runs
    assert "up_to_date" not in first and first["this_run"]["credit"]["cached"] == 0
    return lake, cfg


@pytest.mark.slow
def test_unchanged_round_is_served_from_the_lake_and_changes_fall_through(tmp_path, prefect_harness):
    lake, cfg = _processed(tmp_path)
    assert not_up_to_date(lake, 0, cfg) is None
    before = _files(lake)
    again = _fast(cfg)
    assert again["up_to_date"] and again["state"] == "Completed"
    assert again["this_run"]["credit"] == {"batches": 2, "cached": 2, "warnings": []}
    assert again["rows"]["advantages"] > 0 and again["batches"] == 2
    assert _files(lake) == before  # nothing written: outputs byte-identical, not even rewritten

    # a changed setting: the flow runs (credit recomputes), then the round is up to date again
    changed = _cfg(lake, ["gae.gamma=0.9"])
    assert "credit" in (not_up_to_date(lake, 0, changed) or "")
    out = _fast(changed)
    assert "up_to_date" not in out and out["this_run"]["credit"]["cached"] == 0
    assert not_up_to_date(lake, 0, changed) is None
    assert _fast(changed)["up_to_date"]

    # a re-ingested batch (same rows, a new part): that batch's stages run again
    batch = "b00001"
    lake.write_part("steps", 0, read_batch(lake, "steps", 0, batch), part=batch)
    assert batch in (not_up_to_date(lake, 0, changed) or "")
    out = _fast(changed)
    assert "up_to_date" not in out and out["this_run"]["credit_stats"]["cached"] == 1
    assert _fast(changed)["up_to_date"]

    # a deleted output part: the flow rebuilds it
    name = lake.part_name(lake.parts("train_batch", 0)[0])
    assert lake.delete_part_names("train_batch", 0, [name]) == 1
    assert "missing" in (not_up_to_date(lake, 0, changed) or "")
    out = _fast(changed)
    assert "up_to_date" not in out and lake.has_part("train_batch", 0, name)
    assert _fast(changed)["up_to_date"]


@pytest.mark.slow
def test_code_change_degraded_stage_stale_part_and_busy_round_fall_through(
    tmp_path, prefect_harness, monkeypatch
):
    import flows.caching
    from warehouse.locks import lock_path
    from warehouse.runlog import record_stage_run

    lake, cfg = _processed(tmp_path)
    assert not_up_to_date(lake, 0, cfg) is None

    # a new code version (a release, or an edited stage source) changes every key
    with monkeypatch.context() as m:
        m.setattr(flows.caching, "_package_version", lambda: "99.0")
        assert "changed" in (not_up_to_date(lake, 0, cfg) or "")
    assert not_up_to_date(lake, 0, cfg) is None

    # another process holds the round: the check is never asked (it runs under the round's lock, taken in one
    # place: flows.run.process_checked_round), the run stops naming the holder (or waits: --wait)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            f"f = open({str(lock_path(lake, 0))!r}, 'a+')\n"
            "fcntl.flock(f.fileno(), fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        from flows.run import process_checked_round
        from warehouse.locks import RoundBusy

        asked: list[int] = []
        with pytest.raises(RoundBusy, match="round 0 of .* is being processed by"):
            process_checked_round(cfg, lake, 0, served=lambda: asked.append(1) or None)
        assert not asked
    finally:
        holder.kill()
        holder.wait()

    # a part of a batch the round no longer holds: the flow would prune it
    spans = read_batch(lake, "spans", 0, lake.part_name(lake.parts("trajectories", 0)[0]))
    lake.write_part("spans", 0, spans, part="b99999")
    assert "b99999" in (not_up_to_date(lake, 0, cfg) or "")
    lake.delete_part_names("spans", 0, ["b99999"])

    # a stage whose last run degraded (warnings): an LLM stage's result is never served as final (the flow asks
    # again); a stage without a model serves its warnings from the cache, as the flow does (one rule for both:
    # flows.caching.would_run)
    from pipeline.stages import BatchStage

    batch = lake.part_name(lake.parts("trajectories", 0)[0])
    record_stage_run(lake, 0, "detect", batch, seconds=0.0, warnings=["endpoint down"])
    assert "degraded" not in (not_up_to_date(lake, 0, cfg) or "")
    with monkeypatch.context() as m:
        m.setattr(BatchStage, "calls_llm", lambda self, config: self.name == "detect")
        assert f"detect {batch}: its last run degraded (warnings)" in (not_up_to_date(lake, 0, cfg) or "")


def test_cache_records_as_prefect_writes_them(tmp_path):
    """cache_record_valid agrees with Prefect's own ResultStore on records Prefect writes: present, expired,
    without its result file."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore
    from prefect.serializers import JSONSerializer

    cache, results = tmp_path / "cache", tmp_path / "cache" / "results"
    results.mkdir(parents=True)
    store = ResultStore(
        metadata_storage=LocalFileSystem(basepath=str(cache)),
        result_storage=LocalFileSystem(basepath=str(results)),
        serializer=JSONSerializer(),
    )
    now = dt.datetime.now(dt.UTC)
    store.write({"stage": "credit"}, key="fresh")
    store.write({"stage": "credit"}, key="later", expiration=now + dt.timedelta(hours=1))
    store.write({"stage": "credit"}, key="expired", expiration=now - dt.timedelta(seconds=1))
    store.write({"stage": "credit"}, key="lost")
    (results / "lost").unlink()
    for key, want in [
        ("fresh", True),
        ("later", True),
        ("expired", False),
        ("lost", False),
        ("absent", False),
    ]:
        assert cache_record_valid(cache, key, results) is want, key
        if key != "lost":  # Prefect's exists() reads only the record; the fast path also wants the result
            assert store.exists(key) is want, key
    (cache / "garbled").write_text("{not json")
    assert not cache_record_valid(cache, "garbled", results)


def test_derived_tables_come_from_the_stage_declarations():
    """What the flow prunes of vanished batches: every table a batch stage writes, and the run log."""
    from flows.uptodate import derived_tables

    written = {"spans", "nodes", "edges", "counterfactuals", "credit_stats", "advantages", "train_batch"}
    assert set(derived_tables()) == written | {"stage_runs"}


@pytest.mark.slow
def test_cli_noop_starts_no_prefect(tmp_path, prefect_harness):
    """The real command on a processed round: the up-to-date line, exit 0, and Prefect never imported."""
    lake, _ = _processed(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CREDITFLOW_NO_SERVER": "1"}
    env.pop("PREFECT_API_URL", None)
    args = ["process", "--lake", str(lake.root), "--round", "0", "--methods", ",".join(METHODS)]
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "from flows.cli import app; app()", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    assert UP_TO_DATE.format(round=0) in out.stdout
    assert "credit by method" in out.stdout
    modules = {
        ln.rsplit("|", 1)[1].strip() for ln in out.stderr.splitlines() if ln.startswith("import time:")
    }
    assert not {m for m in modules if m.split(".")[0] in ("prefect", "torch", "ray", "dask")}
    print(f"no-op process: {wall:.2f} s")


@pytest.mark.slow
def test_hive_lake_needs_its_catalog_file(tmp_path, prefect_harness, monkeypatch):
    """On a hive lake the flow rebuilds LAKE/catalog.duckdb at the end of a run: a round whose catalog file is
    missing (or older than its last stage run) is not up to date."""
    from warehouse.catalog import CATALOG_FILE

    monkeypatch.setenv("CREDITFLOW_LAKE_FORMAT", "parquet")
    lake, cfg = _processed(tmp_path)
    assert lake.format == "parquet"
    assert not_up_to_date(lake, 0, cfg) is None and _fast(cfg)["up_to_date"]
    (lake.root / CATALOG_FILE).unlink()
    assert "catalog" in (not_up_to_date(lake, 0, cfg) or "")
    assert "up_to_date" not in _fast(cfg)
    assert (lake.root / CATALOG_FILE).exists() and _fast(cfg)["up_to_date"]
