"""`creditflow lake vacuum` / `lake compact` (#25): on a Delta lake vacuum removes the files only versions older
than the retention need (and unreferenced leftovers), refuses a retention below Delta's default without --force,
and reports files and bytes; on a hive lake it removes dead writers' temporary files and says that is all;
compact merges a partition's files (delta-rs optimize) and the data reads the same. The S3 case is in
tests/test_lake_s3.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

pytest.importorskip("deltalake")

from flows.cli import app  # noqa: E402
from warehouse.lake import FORMAT_ENV, Lake  # noqa: E402

runner = CliRunner()


def _delta_lake(tmp_path, monkeypatch) -> Lake:
    monkeypatch.setenv(FORMAT_ENV, "delta")
    lake = Lake(tmp_path / "lake")
    assert lake.format == "delta"
    return lake


def _files(lake: Lake, table: str) -> set[str]:
    root = lake.root / table
    return {str(p.relative_to(root)) for p in root.rglob("*.parquet")}


def _round(lake: Lake) -> None:
    from pipeline.synth import SynthSettings, generate
    from warehouse.rounds import write_round

    traj, steps = generate(SynthSettings(groups=2, samples=2, turns=2, tokens=8, seed=0, round=0))
    write_round(lake, 0, traj, steps, batch_groups=2)


def _rewritten(lake: Lake) -> tuple[int, set[str]]:
    """A round whose trajectories part is written again with one row: the first write's file is referenced only
    by the older versions. Returns (the version before, the files no current version references)."""
    _round(lake)
    (part,) = lake.parts("trajectories", 0)
    first, version = _files(lake, "trajectories"), lake._table("trajectories").version()
    rows = lake.read("trajectories", 0, parts=[part])
    lake.write_part("trajectories", 0, rows.slice(0, 1), part=lake.part_name(part))
    return version, first


def test_vacuum_keeps_recent_versions_and_refuses_a_short_retention(tmp_path, monkeypatch):
    lake = _delta_lake(tmp_path, monkeypatch)
    v0, old = _rewritten(lake)
    before = _files(lake, "trajectories")
    res = runner.invoke(app, ["lake", "vacuum", "--lake", str(lake.root)])  # default: 7 days
    assert res.exit_code == 0, res.output
    assert "removed 0 files" in res.output and _files(lake, "trajectories") == before
    res = runner.invoke(app, ["lake", "vacuum", "--lake", str(lake.root), "--retain-hours", "0"])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--force" in lines[0] and "as-of" in lines[0], res.output
    assert _files(lake, "trajectories") == before
    # the old version still reads (time travel) until a vacuum removes its file
    assert lake.read("trajectories", 0, as_of={"trajectories": v0}).num_rows == 4


def test_vacuum_forced_dry_run_then_removes_exactly_the_old_files(tmp_path, monkeypatch):
    lake = _delta_lake(tmp_path, monkeypatch)
    v0, old = _rewritten(lake)
    orphan = (
        next(iter((lake.root / "trajectories").glob("round=0/_part=*"))) / "part-orphan-of-killed.parquet"
    )
    orphan.write_bytes(b"x" * 1000)
    gone = old | {str(orphan.relative_to(lake.root / "trajectories"))}
    size = sum(os.path.getsize(lake.root / "trajectories" / f) for f in gone)
    args = ["lake", "vacuum", "--lake", str(lake.root), "--retain-hours", "0", "--force"]
    res = runner.invoke(app, [*args, "--dry-run"])
    assert res.exit_code == 0, res.output
    assert f"would remove {len(gone)} files" in res.output and orphan.exists()
    from warehouse.maintenance import human_bytes

    assert human_bytes(size) in res.output, (size, res.output)
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert f"removed {len(gone)} files" in res.output
    assert not orphan.exists() and not (old & _files(lake, "trajectories"))
    assert lake.read("trajectories", 0).num_rows == 1  # the current version reads
    with pytest.raises(Exception):  # noqa: B017 - delta-rs's own error: version 0's file is gone
        lake.read("trajectories", 0, as_of={"trajectories": v0})


def test_vacuum_on_a_hive_lake_removes_dead_writers_temp_files(tmp_path, monkeypatch):
    monkeypatch.setenv(FORMAT_ENV, "parquet")
    lake = Lake(tmp_path / "lake")
    _round(lake)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    folder = lake.partition_dir("trajectories", 0)
    stale = folder / f".tmp-{int(dead.stdout)}-0123abcd-part-q.parquet"
    stale.write_bytes(b"y" * 300)
    live = folder / f".tmp-{os.getpid()}-0123abcd-part-r.parquet"  # this process: a live writer's
    live.write_bytes(b"z")
    res = runner.invoke(app, ["lake", "vacuum", "--lake", str(lake.root)])
    assert res.exit_code == 0, res.output
    assert "removed 1 files, 300 B" in res.output and "all vacuum" in res.output
    assert not stale.exists() and live.exists() and lake.read("trajectories", 0).num_rows == 4
    res = runner.invoke(app, ["lake", "compact", "--lake", str(lake.root)])
    assert res.exit_code == 2 and "needs a Delta lake" in res.output


def test_compact_merges_a_partitions_files(tmp_path, monkeypatch):
    from deltalake import write_deltalake

    lake = _delta_lake(tmp_path, monkeypatch)
    _round(lake)
    table = lake._table("trajectories")
    again = table.to_pyarrow_dataset().to_table()  # the part's rows again: a second file in its partition
    write_deltalake(table, again, mode="append")
    assert len(lake._table("trajectories").file_uris()) == 2
    rows = lake.read("trajectories", 0).sort_by("traj_id")
    assert rows.num_rows == 8
    res = runner.invoke(app, ["lake", "compact", "--lake", str(lake.root), "--dry-run"])
    assert res.exit_code == 0 and "would remove 2 files" in res.output, res.output
    res = runner.invoke(app, ["lake", "compact", "--lake", str(lake.root)])
    assert res.exit_code == 0 and "removed 2 files" in res.output, res.output
    assert len(lake._table("trajectories").file_uris()) == 1
    assert lake.read("trajectories", 0).sort_by("traj_id").equals(rows)


def test_the_cli_default_retention_is_the_libraries():
    from flows.commands.lake import DEFAULT_RETAIN_HOURS
    from warehouse import maintenance

    assert DEFAULT_RETAIN_HOURS == maintenance.DEFAULT_RETAIN_HOURS
