"""The run log's spool on a Delta lake (warehouse/runlog.py) and the statistics pass's kept reads
(flows/batch.py): fewer Delta commits per batch and one read of a batch where a method takes a round statistic,
with the same run log and the same advantages as before."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flows import batch as fb
from flows.batch import finish_round, round_batches, round_statistics, run_stage
from pipeline.config import Config
from pipeline.credit import process
from pipeline.credit.batch import CreditBatch
from pipeline.credit.methods import gae as gae_method
from pipeline.credit.process import statistics_json
from pipeline.stages import get_stage
from pipeline.synth import SynthSettings, generate
from warehouse.lake import Lake
from warehouse.rounds import write_round
from warehouse.runlog import (
    TABLE,
    flush_stage_runs,
    prune_stale_parts,
    read_stage_runs,
    record_stage_run,
    spool_dir,
)


def delta_lake(tmp_path: Path, monkeypatch, name: str = "lake") -> Lake:
    monkeypatch.setenv("CREDITFLOW_LAKE_FORMAT", "delta")
    lake = Lake(tmp_path / name)
    assert lake.format == "delta"
    return lake


def hive_lake(tmp_path: Path, monkeypatch, name: str = "hive") -> Lake:
    monkeypatch.setenv("CREDITFLOW_LAKE_FORMAT", "parquet")
    lake = Lake(tmp_path / name)
    assert lake.format == "parquet"
    return lake


def version(lake: Lake) -> int:
    t = lake._table(TABLE)  # type: ignore[attr-defined]
    return -1 if t is None else t.version()


def rows(lake: Lake, round_: int = 0) -> dict[tuple[str, str], float]:
    runs = read_stage_runs(lake, round_)
    return {
        (s, b): sec
        for s, b, sec in zip(
            runs.column("stage").to_pylist(),
            runs.column("batch").to_pylist(),
            runs.column("seconds").to_pylist(),
            strict=True,
        )
    }


def test_delta_rows_are_spooled_and_committed_together(tmp_path, monkeypatch):
    lake = delta_lake(tmp_path, monkeypatch)
    for i, (stage, batch) in enumerate([("credit_stats", "b0"), ("credit_stats", "b1"), ("credit", "b0")]):
        record_stage_run(lake, 0, stage, batch, seconds=float(i), tokens=10 * i)
    assert version(lake) == -1  # no commit yet: the rows are in the spool
    assert len(list(spool_dir(lake, 0).glob("*.arrow"))) == 3
    assert rows(lake) == {("credit_stats", "b0"): 0.0, ("credit_stats", "b1"): 1.0, ("credit", "b0"): 2.0}
    assert version(lake) == 1  # the three rows: one commit (version 0: the table's creation, empty)
    assert not list(spool_dir(lake, 0).glob("*.arrow"))
    assert flush_stage_runs(lake, 0) == 0 and version(lake) == 1  # nothing spooled: no commit
    # a stage run again replaces its row; the others stay
    record_stage_run(lake, 0, "credit", "b0", seconds=7.0)
    record_stage_run(lake, 0, "credit", "b1", seconds=8.0)
    assert flush_stage_runs(lake, 0) == 2 and version(lake) == 2
    assert rows(lake) == {
        ("credit_stats", "b0"): 0.0,
        ("credit_stats", "b1"): 1.0,
        ("credit", "b0"): 7.0,
        ("credit", "b1"): 8.0,
    }
    assert len(lake.parts(TABLE, 0)) == 4  # one part per (stage, batch), as before


def test_the_later_of_two_spooled_rows_wins(tmp_path, monkeypatch):
    lake = delta_lake(tmp_path, monkeypatch)
    record_stage_run(lake, 0, "credit", "b0", seconds=1.0)
    record_stage_run(lake, 0, "credit", "b0", seconds=2.0)
    assert rows(lake) == {("credit", "b0"): 2.0}


def test_a_flush_killed_before_removing_its_files_commits_the_same_rows_again(tmp_path, monkeypatch):
    lake = delta_lake(tmp_path, monkeypatch)
    record_stage_run(lake, 0, "credit", "b0", seconds=1.0, warnings=["endpoint down"])
    record_stage_run(lake, 0, "export", "b0", seconds=2.0)
    saved = tmp_path / "saved"
    shutil.copytree(spool_dir(lake, 0), saved)
    first = read_stage_runs(lake, 0).sort_by("stage")
    shutil.copytree(saved, spool_dir(lake, 0), dirs_exist_ok=True)  # as if killed before the unlink
    assert flush_stage_runs(lake, 0) == 2
    again = read_stage_runs(lake, 0).sort_by("stage")
    assert again.equals(first)
    assert again.column("warnings").to_pylist() == [["endpoint down"], []]


def test_an_unreadable_spool_file_is_skipped(tmp_path, monkeypatch, caplog):
    lake = delta_lake(tmp_path, monkeypatch)
    record_stage_run(lake, 0, "credit", "b0", seconds=1.0)
    record_stage_run(lake, 0, "credit", "b1", seconds=2.0)
    cut = sorted(spool_dir(lake, 0).glob("credit.b1~*.arrow"))[0]
    cut.write_bytes(cut.read_bytes()[:20])  # a machine crash cut it short
    assert rows(lake) == {("credit", "b0"): 1.0}
    assert "unreadable spool file" in caplog.text
    assert not list(spool_dir(lake, 0).glob("*.arrow"))


def test_rounds_are_spooled_apart(tmp_path, monkeypatch):
    lake = delta_lake(tmp_path, monkeypatch)
    record_stage_run(lake, 0, "credit", "b0", seconds=1.0)
    record_stage_run(lake, 1, "credit", "b0", seconds=2.0)
    assert rows(lake, 1) == {("credit", "b0"): 2.0}
    assert len(list(spool_dir(lake, 0).glob("*.arrow"))) == 1  # round 0's row waits for its own flush
    assert rows(lake, 0) == {("credit", "b0"): 1.0}


def test_prune_sees_spooled_rows_of_a_vanished_batch(tmp_path, monkeypatch):
    lake = delta_lake(tmp_path, monkeypatch)
    record_stage_run(lake, 0, "credit", "b0", seconds=1.0)
    record_stage_run(lake, 0, "credit", "b9", seconds=2.0)
    assert prune_stale_parts(lake, 0, [TABLE], ["b0"]) == 1
    assert rows(lake) == {("credit", "b0"): 1.0}


def test_hive_and_remote_lakes_write_each_row_as_its_part(tmp_path, monkeypatch):
    lake = hive_lake(tmp_path, monkeypatch)
    record_stage_run(lake, 0, "credit", "b0", seconds=1.0)
    assert not (lake.root / "_flow" / "runlog").exists()
    assert [lake.part_name(p) for p in lake.parts(TABLE, 0)] == ["credit.b0"]
    assert rows(lake) == {("credit", "b0"): 1.0}


def test_a_read_only_lake_reads_the_committed_rows(tmp_path, monkeypatch):
    lake = delta_lake(tmp_path, monkeypatch)
    record_stage_run(lake, 0, "credit", "b0", seconds=1.0)
    flush_stage_runs(lake, 0)
    record_stage_run(lake, 0, "credit", "b1", seconds=2.0)

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    for write in ("write_parts", "replace_partition"):  # (the flush's writer, and the one it used before)
        monkeypatch.setattr(lake, write, refuse)
    assert rows(lake) == {("credit", "b0"): 1.0}  # a reader is not stopped
    with pytest.raises(PermissionError):
        flush_stage_runs(lake, 0)  # a writer's flush is
    assert len(list(spool_dir(lake, 0).glob("*.arrow"))) == 1  # kept for the next flush


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.sampled_from(["credit", "export"]), st.sampled_from(["b0", "b1", "b2"]), st.booleans()),
        min_size=1,
        max_size=8,
    )
)
def test_the_log_holds_the_last_row_of_each_stage_and_batch(tmp_path_factory, monkeypatch, ops):
    """Whatever the order of records and flushes: the log holds each (stage, batch)'s last row, and a flush
    makes at most one commit."""
    lake = delta_lake(tmp_path_factory.mktemp("p"), monkeypatch)
    want: dict[tuple[str, str], float] = {}
    for i, (stage, batch, flush) in enumerate(ops):
        record_stage_run(lake, 0, stage, batch, seconds=float(i))
        want[(stage, batch)] = float(i)
        if flush:
            before = version(lake)
            flush_stage_runs(lake, 0)
            assert version(lake) == before + (2 if before < 0 else 1)  # a new table: its creation first
    assert rows(lake) == want


# ---- the statistics pass's kept reads ----------------------------------------------------------------


def synth_lake(tmp_path: Path, monkeypatch, fmt: str, name: str, overflow: bool = False) -> Lake:
    monkeypatch.setenv("CREDITFLOW_LAKE_FORMAT", fmt)
    lake = Lake(tmp_path / name)
    traj, steps = generate(SynthSettings(groups=6, samples=4, turns=4, tokens=30, seed=3, round=0))
    if overflow:  # one group's rewards past SAFE_MAGNITUDE: left out by both passes (quarantined_groups)
        group = traj.column("group_id")[0]
        reward = pc.if_else(pc.equal(traj.column("group_id"), group), 1e300, traj.column("reward"))
        traj = traj.set_column(traj.schema.get_field_index("reward"), "reward", reward)
    write_round(lake, 0, traj, steps, batch_groups=2)
    return lake


def credit_round(lake: Lake, method: str, stages: dict | None = None) -> pa.Table:
    """The round as a plain caller runs it: statistics pass, credit per batch, the run log's flush."""
    cfg = Config(lake=str(lake.root), methods=[method], stages=stages or {})
    batches = round_batches(lake, 0)
    stats = round_statistics(lake, 0, cfg, batches)
    for b in batches:
        run_stage(lake, 0, b, get_stage("credit"), cfg, round_stats=statistics_json(stats) if stats else None)
    finish_round(lake, 0)
    adv = lake.read("advantages", 0)
    return adv.sort_by([("method", "ascending"), ("traj_id", "ascending"), ("step_idx", "ascending")])


@pytest.mark.parametrize("fmt", ["delta", "parquet"])
@pytest.mark.parametrize("method", ["gae", "turn_ppo", "gdpo"])
def test_kept_reads_give_the_same_advantages(tmp_path, monkeypatch, fmt, method):
    monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
    kept = synth_lake(tmp_path, monkeypatch, fmt, "kept")
    plain = synth_lake(tmp_path, monkeypatch, fmt, "plain")
    served: list[tuple[str, list[str] | None]] = []
    real = fb.read_batch

    def counted(lake, table, round_, batch, columns=None):
        if table in ("trajectories", "steps"):
            served.append((table, columns))
        return real(lake, table, round_, batch, columns=columns)

    monkeypatch.setattr(fb, "read_batch", counted)
    built = []
    real_build = CreditBatch.from_arrow.__func__  # type: ignore[attr-defined]

    def counted_build(cls, *args, **kwargs):
        built.append(kwargs.get("round_stats"))
        return real_build(cls, *args, **kwargs)

    monkeypatch.setattr(CreditBatch, "from_arrow", classmethod(counted_build))
    got = credit_round(kept, method)
    assert not fb._kept and not process._kept_batches  # every kept read and batch was used by credit
    n = len(round_batches(kept, 0))
    # each batch's trajectories and steps read once (the statistics pass reads credit's columns too: credit's
    # read is served whole), and its credit batch built once, by the statistics pass
    assert sum(t == "trajectories" for t, _ in served) == n
    steps = [c for t, c in served if t == "steps"]
    assert len(steps) == n and all(c is not None and "turn" in c and "n_tokens" in c for c in steps), steps
    assert built == [None] * n
    monkeypatch.setenv(fb.READ_CACHE_ENV, "0")  # the recompute path: read and built again by credit
    built.clear()
    want = credit_round(plain, method)
    assert len(built) == 2 * n and all(b is not None for b in built[n:])
    assert got.num_rows == want.num_rows > 0
    assert got.drop_columns(["_part"] if "_part" in got.column_names else []).equals(
        want.drop_columns(["_part"] if "_part" in want.column_names else [])
    )
    runs = read_stage_runs(kept, 0)
    assert sorted(set(runs.column("stage").to_pylist())) == ["credit", "credit_stats"]


@pytest.mark.parametrize("stages", [{}, {"gae": {"gamma": 0.99, "lam": 0.95}}])
def test_gae_is_estimated_once_per_batch_on_the_kept_path(tmp_path, monkeypatch, stages):
    """The statistics pass's Eq. 1-4 (gae_advantages) kept with the batch: credit whitens it instead of
    estimating again; the same advantages as the recompute path (lam = 1 and lam < 1). At gamma = lam = 1 (the
    defaults) the moments come from the steps' value moments: the kept statistics pass estimates Eq. 1-4 for
    credit alone, and the recompute path's statistics pass estimates nothing."""
    telescoped = not stages
    calls: list[bool] = []
    real = gae_method.gae_advantages

    def counted(*args, **kwargs):
        calls.append(bool(kwargs.get("moments")))
        return real(*args, **kwargs)

    monkeypatch.setattr(gae_method, "gae_advantages", counted)
    monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
    kept = synth_lake(tmp_path, monkeypatch, "parquet", "kept")
    n = len(round_batches(kept, 0))
    held: list[int] = []
    real_batch = process.process_batch

    def counted_batch(*args, **kwargs):
        held.append(process.kept_bytes())
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(process, "process_batch", counted_batch)
    got = credit_round(kept, "gae", stages)
    assert calls == [not telescoped] * n  # the statistics pass's only: credit estimated nothing
    assert held[0] > held[-1] > 0  # the kept estimates are counted against the bound, and go once used
    calls.clear()
    monkeypatch.setenv(fb.READ_CACHE_ENV, "0")
    plain = synth_lake(tmp_path, monkeypatch, "parquet", "plain")
    want = credit_round(plain, "gae", stages)
    assert calls == ([] if telescoped else [True] * n) + [False] * n  # both passes estimate (lam < 1)
    assert got.num_rows == want.num_rows > 0 and got.equals(want)


def test_a_kept_batch_leaves_out_the_same_overflowing_group(tmp_path, monkeypatch):
    """The statistics pass's kept credit batch has the overflowing group left out, as credit's own build does:
    same advantages, same quarantined_groups note, on the kept path and the recompute path."""
    monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
    kept = synth_lake(tmp_path, monkeypatch, "parquet", "kept", overflow=True)
    got = credit_round(kept, "gae")
    assert not process._kept_batches
    monkeypatch.setenv(fb.READ_CACHE_ENV, "0")
    plain = synth_lake(tmp_path, monkeypatch, "parquet", "plain", overflow=True)
    want = credit_round(plain, "gae")
    assert 0 < got.num_rows < kept.read("steps", 0).num_rows  # the group's steps have no advantages
    assert got.equals(want)

    def notes(lake):
        runs = read_stage_runs(lake, 0)
        cols = [runs.column(c).to_pylist() for c in ("stage", "batch", "notes")]
        return sorted((b, dict(n)) for s, b, n in zip(*cols, strict=True) if s == "credit")

    assert notes(kept) == notes(plain) and any(n.get("gae.quarantined_groups") == 1.0 for _, n in notes(kept))


def test_a_rewritten_part_is_never_served_from_the_kept_reads(tmp_path, monkeypatch):
    monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
    lake = synth_lake(tmp_path, monkeypatch, "parquet", "lake")
    b = round_batches(lake, 0)[0]
    first = fb._read(
        lake, "steps", 0, b, columns=["traj_id", "token_ids"], keep=True, budget=fb._cache_budget()
    )
    assert len(fb._kept) == 1
    path = lake.partition_dir("steps", 0) / f"part-{b}.parquet"
    steps = lake.read("steps", 0, parts=[path])
    lake.write_part("steps", 0, steps.slice(0, 3).drop_columns(["round"]), part=b)  # the batch re-ingested
    again = fb._read(lake, "steps", 0, b, columns=["traj_id", "token_ids"])
    assert again.num_rows == 3 != first.num_rows
    fb._kept.clear()


def test_the_kept_reads_are_bounded(tmp_path, monkeypatch):
    lake = synth_lake(tmp_path, monkeypatch, "parquet", "lake")
    b = round_batches(lake, 0)[0]
    monkeypatch.delenv(fb.READ_CACHE_ENV, raising=False)
    fb._read(lake, "steps", 0, b, columns=["traj_id", "token_ids"], keep=True, budget=fb._cache_budget())
    assert not fb._kept  # off by default (READ_CACHE_MB 0: at the scale it cost more than it saved)
    # a light round (credit reads no per-token list: GDPO) keeps by default, within its own small bound; the
    # variable, where set, bounds every round
    assert fb._cache_budget(light=True) == fb.LIGHT_READ_CACHE_MB * 2**20 > 0 == fb._cache_budget(light=False)
    monkeypatch.setenv(fb.READ_CACHE_ENV, "0")  # off
    assert fb._cache_budget(light=True) == 0
    fb._read(lake, "steps", 0, b, columns=["traj_id", "token_ids"], keep=True, budget=fb._cache_budget())
    assert not fb._kept
    monkeypatch.setenv(fb.READ_CACHE_ENV, str(1 / 2**20))  # one byte: the batch does not fit, it is not kept
    fb._read(lake, "steps", 0, b, columns=["traj_id", "token_ids"], keep=True, budget=fb._cache_budget())
    assert not fb._kept
    monkeypatch.setenv(fb.READ_CACHE_ENV, "64")
    fb._read(lake, "steps", 0, b, columns=["traj_id", "token_ids"], keep=True, budget=fb._cache_budget())
    assert len(fb._kept) == 1
    # credit asks for more columns than were kept: the rest is read from disk, in the order asked
    got = fb._read(lake, "steps", 0, b, columns=["turn", "traj_id", "token_ids"])
    want = lake.read(
        "steps",
        0,
        columns=["turn", "traj_id", "token_ids"],
        parts=[lake.partition_dir("steps", 0) / f"part-{b}.parquet"],
    )
    assert got.column_names == ["turn", "traj_id", "token_ids"] and got.equals(want)
    assert not fb._kept
    assert pc.sum(pc.list_value_length(got.column("token_ids"))).as_py() > 0


def test_a_kept_column_subset_is_not_served_to_a_read_of_every_column(tmp_path, monkeypatch):
    monkeypatch.setenv(fb.READ_CACHE_ENV, "256")
    lake = synth_lake(tmp_path, monkeypatch, "parquet", "lake")
    b = round_batches(lake, 0)[0]
    fb._read(lake, "steps", 0, b, columns=["traj_id", "token_ids"], keep=True, budget=fb._cache_budget())
    whole = fb._read(lake, "steps", 0, b)  # a stage that reads every column (detect)
    assert "turn" in whole.column_names and len(fb._kept) == 1  # read from disk; the kept read stays
    fb._read(lake, "trajectories", 0, b, keep=True, budget=fb._cache_budget())
    assert fb._read(lake, "trajectories", 0, b).equals(
        lake.read("trajectories", 0, parts=[lake.partition_dir("trajectories", 0) / f"part-{b}.parquet"])
    )
    fb._kept.clear()


def test_the_catalog_shows_a_killed_runs_spooled_rows(tmp_path, monkeypatch):
    """A run killed before its flush leaves its rows in the spool; `creditflow query` (the DuckDB catalog:
    stage_runs and the views over it) commits them before it registers the tables, as the other readers do.
    A query as of an earlier version reads that version and flushes nothing."""
    from warehouse.catalog import query

    lake = delta_lake(tmp_path, monkeypatch)
    record_stage_run(lake, 0, "credit", "b0", seconds=1.0, tokens=5)
    flush_stage_runs(lake, 0)
    before = lake.version()
    record_stage_run(lake, 0, "credit", "b1", seconds=2.0, tokens=7)  # then the run is killed: no flush
    record_stage_run(lake, 3, "export", "b0", seconds=4.0, tokens=1)
    assert len(list(spool_dir(lake, 0).glob("*.arrow"))) == 1
    old = query(str(lake.root), "SELECT batch FROM stage_runs ORDER BY batch", as_of=before)
    assert old.column("batch").to_pylist() == ["b0"]
    assert len(list(spool_dir(lake, 0).glob("*.arrow"))) == 1  # a query of the past commits nothing
    runs = query(str(lake.root), "SELECT round, stage, batch, tokens FROM stage_runs ORDER BY round, batch")
    assert runs.to_pylist() == [
        {"round": 0, "stage": "credit", "batch": "b0", "tokens": 5},
        {"round": 0, "stage": "credit", "batch": "b1", "tokens": 7},
        {"round": 3, "stage": "export", "batch": "b0", "tokens": 1},
    ]
    summary = query(str(lake.root), "SELECT round, stage, batches, tokens, seconds FROM stage_summary")
    assert summary.to_pylist() == [
        {"round": 0, "stage": "credit", "batches": 2, "tokens": 12, "seconds": 3.0},
        {"round": 3, "stage": "export", "batches": 1, "tokens": 1, "seconds": 4.0},
    ]
    assert not list(spool_dir(lake, 0).glob("*.arrow")) and not list(spool_dir(lake, 3).glob("*.arrow"))


def test_only_the_keeping_threads_statistics_pass_keeps_its_batch():
    traj, steps = generate(SynthSettings(groups=2, samples=2, turns=2, tokens=10, seed=1, round=0))
    cfg = Config(methods=["gae"])
    other: list[int] = []

    def statistics_pass() -> None:
        process.batch_statistics(traj, steps, ["gae"], cfg)
        other.append(len(process._kept_batches))

    with process.keeping_credit_batches():
        thread = threading.Thread(target=statistics_pass)  # a flow's thread runner, at the same time
        thread.start()
        thread.join()
        assert other == [0]
        process.batch_statistics(traj, steps, ["gae"], cfg)
    assert len(process._kept_batches) == 1
    process.batch_statistics(traj, steps, ["gae"], cfg)  # after the block: nothing more kept
    assert len(process._kept_batches) == 1
    process.forget_credit_batches()


def test_the_up_to_date_check_sees_a_spooled_row_of_a_batch_the_round_no_longer_holds(tmp_path, monkeypatch):
    """flows.uptodate.stale_parts (the fast path's "parts to prune") lists the run log's spooled rows too, without
    committing them: a row of a dropped batch still in the spool is work the flow would do (commit, then prune)."""
    from flows.uptodate import stale_parts
    from warehouse.runlog import spooled_parts

    lake = delta_lake(tmp_path, monkeypatch)
    record_stage_run(lake, 0, "credit", "b00000", seconds=0.1)
    flush_stage_runs(lake, 0)
    record_stage_run(lake, 0, "credit", "b00001", seconds=0.1)  # kept batch, spooled
    record_stage_run(lake, 0, "detect", "b00007", seconds=0.1)  # a batch the round no longer holds, spooled
    record_stage_run(lake, 0, "detect", "b00007", seconds=0.2)  # its later row: one part still
    spool = sorted(p.name for p in spool_dir(lake, 0).iterdir())
    assert spooled_parts(lake, 0) == ["credit.b00001", "detect.b00007"]
    assert stale_parts(lake, 0, ["b00000", "b00001"]) == ["stage_runs/detect.b00007"]
    # committed rows as before
    assert stale_parts(lake, 0, ["b00001", "b00007"]) == ["stage_runs/credit.b00000"]
    assert sorted(p.name for p in spool_dir(lake, 0).iterdir()) == spool  # read only: nothing committed
    assert spooled_parts(hive_lake(tmp_path, monkeypatch), 0) == []  # a hive lake writes each row as its part
