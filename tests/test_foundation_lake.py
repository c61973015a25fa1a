"""Lake layout, atomic and idempotent writes, schema validation and the DuckDB catalog."""

import math
import os

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from flows.cli import app
from schemas import TABLES, SchemaError
from schemas import steps as steps_schema
from schemas import trajectories as traj_schema
from warehouse.catalog import query
from warehouse.lake import FORMAT_ENV, FORMATS, Lake
from warehouse.rounds import batch_names, read_batch, write_round


def _traj(n_groups=3, samples=2):
    rows = []
    for g in range(n_groups):
        for s in range(samples):
            rows.append(
                dict(traj_id=f"g{g}s{s}", group_id=f"g{g}", sample_idx=s, reward=float(s), source="t")
            )
    return pa.Table.from_pylist(rows)


def _steps(traj: pa.Table):
    rows = []
    for tid in traj.column("traj_id").to_pylist():
        rows.append(
            dict(
                traj_id=tid,
                step_idx=0,
                role="user",
                turn=None,
                content="hi",
                is_error=False,
                token_ids=[1, 2],
                logprobs=None,
                token_offsets=[0, 1],
            )
        )
        rows.append(
            dict(
                traj_id=tid,
                step_idx=1,
                role="assistant",
                turn=1,
                content="yo!",
                is_error=False,
                token_ids=[3, 4, 5],
                token_offsets=[0, 1, 2],
                logprobs=[-0.1, -0.2, -0.3],
            )
        )
    return pa.Table.from_pylist(rows)


def test_every_table_has_docs_for_every_field():
    assert set(TABLES) >= {
        "trajectories",
        "steps",
        "spans",
        "nodes",
        "edges",
        "counterfactuals",
        "advantages",
        "train_batch",
        "quarantine",
    }
    for spec in TABLES.values():
        missing = [f.name for f in spec.schema if f.name not in spec.docs]
        assert not missing, (spec.name, missing)


def test_validate_names_first_bad_field_and_row():
    traj = _traj().append_column("round", pa.array([0] * 6, pa.int32()))
    bad = traj.set_column(
        traj.column_names.index("reward"), "reward", pa.array([0.0, 1.0, math.nan, 1, 0, 1])
    )
    with pytest.raises(SchemaError) as err:
        traj_schema.validate(bad)
    assert err.value.field == "reward" and err.value.row == 2
    dup = traj.set_column(
        traj.column_names.index("traj_id"), "traj_id", pa.array(["a", "b", "c", "a", "e", "f"])
    )
    with pytest.raises(SchemaError) as err:
        traj_schema.validate(dup)
    assert err.value.field == "traj_id" and err.value.row == 3


def test_steps_validation_catches_length_mismatch_role_and_turn():
    steps = _steps(_traj(1, 1)).append_column("round", pa.array([0, 0], pa.int32()))
    steps_schema.validate(steps)
    rows = steps.to_pylist()
    rows[1]["logprobs"] = [-0.1]
    with pytest.raises(SchemaError, match="logprobs") as err:
        steps_schema.validate(pa.Table.from_pylist(rows, schema=steps_schema.SCHEMA))
    assert err.value.row == 1
    rows = steps.to_pylist()
    rows[0]["role"] = "robot"
    with pytest.raises(SchemaError, match="role"):
        steps_schema.validate(pa.Table.from_pylist(rows, schema=steps_schema.SCHEMA))
    rows = steps.to_pylist()
    rows[1]["turn"] = None
    with pytest.raises(SchemaError, match="turn"):
        steps_schema.validate(pa.Table.from_pylist(rows, schema=steps_schema.SCHEMA))


def test_conform_takes_a_conformed_table_as_it_is_and_checks_it_all_the_same():
    """A writer's own table, built in its table's schema (the advantages, a run-log row), is not rebuilt; its
    checks still run, and a table with derived columns still gets them computed from their sources."""
    traj = traj_schema.SPEC.conform(_traj().append_column("round", pa.array([0] * 6, pa.int32())))
    assert traj_schema.SPEC.conform(traj) is traj
    assert traj_schema.validate(traj) is traj
    tagged = traj.replace_schema_metadata({b"k": b"v"})  # the same fields, other metadata: rebuilt
    assert traj_schema.SPEC.conform(tagged).schema.equals(traj_schema.SCHEMA, check_metadata=True)
    ids = traj.schema.get_field_index("traj_id")  # a null in a required field of a conformed table: caught
    nulled = traj.set_column(ids, traj.schema.field(ids), pa.array(["a", None, "c", "d", "e", "f"]))
    with pytest.raises(SchemaError) as err:
        traj_schema.validate(nulled)
    assert err.value.field == "traj_id" and err.value.row == 1
    steps = steps_schema.SPEC.conform(
        _steps(_traj(1, 1)).append_column("round", pa.array([0, 0], pa.int32()))
    )
    derived = next(iter(steps_schema.SPEC.derived))
    wrong = steps.set_column(
        steps.schema.get_field_index(derived),
        steps.schema.field(derived),
        pa.nulls(steps.num_rows, steps.schema.field(derived).type),
    )
    assert steps_schema.SPEC.conform(wrong).column(derived).equals(steps.column(derived))


@pytest.fixture(params=FORMATS)
def lake(request, tmp_path, monkeypatch):
    """The lake tests here run on both formats: Delta (a new lake's default) and hive Parquet (an existing
    lake, or CREDITFLOW_LAKE_FORMAT=parquet)."""
    monkeypatch.setenv(FORMAT_ENV, request.param)
    store = Lake(tmp_path / "lake")
    assert store.format == request.param
    return store


def test_write_twice_gives_same_rows_once(lake):
    traj = _traj()
    steps = _steps(traj)
    write_round(lake, 0, traj, steps, batch_groups=2)
    write_round(lake, 0, traj, steps, batch_groups=2)
    assert batch_names(lake, 0) == ["b00000", "b00001"]
    back = lake.read("trajectories", 0)
    assert back.num_rows == traj.num_rows
    assert sorted(back.column("traj_id").to_pylist()) == sorted(traj.column("traj_id").to_pylist())
    # a batch holds whole groups
    b0 = read_batch(lake, "trajectories", 0, "b00000")
    assert set(b0.column("group_id").to_pylist()) == {"g0", "g1"}
    n = query(lake, "select count(*) as n, count(distinct traj_id) as d from steps").to_pylist()[0]
    assert n == {"n": 12, "d": 6}


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_part_is_atomic_and_replaces(tmp_path, monkeypatch, fmt):
    monkeypatch.setenv(FORMAT_ENV, fmt)
    lake = Lake(tmp_path / "lake")
    assert lake.format == fmt
    traj = _traj()
    lake.write_part("trajectories", 1, traj, part="x")
    lake.write_part("trajectories", 1, traj.slice(0, 2), part="x")
    assert lake.read("trajectories", 1).num_rows == 2
    assert [lake.part_name(p) for p in lake.parts("trajectories", 1)] == ["x"]
    assert lake.count_rows("trajectories", 1) == 2
    assert not list(lake.root.rglob(".tmp-*"))  # no temp files left behind
    if fmt == "parquet":  # the hive layout: one file per part, replaced in place
        files = os.listdir(lake.partition_dir("trajectories", 1))
        assert files == ["part-x.parquet"], files


def test_read_columns_across_parts_written_before_a_column_existed(lake):
    """A part written before a column was added reads it as nulls beside newer parts; a column no part has is a
    clear error naming the table and the column."""
    old = pa.table({"traj_id": ["a", "b"], "n": [1, 2]})
    new = pa.table({"traj_id": ["c"], "n": [3], "extra": [0.5]})
    lake.write_part("experiments", 0, old, part="p0")
    lake.write_part("experiments", 0, new, part="p1")
    back = lake.read("experiments", 0, columns=["traj_id", "extra"])
    assert back.column_names == ["traj_id", "extra"]
    assert sorted(zip(back.column("traj_id").to_pylist(), back.column("extra").to_pylist(), strict=True)) == [
        ("a", None),
        ("b", None),
        ("c", 0.5),
    ]
    with pytest.raises(KeyError, match="table 'experiments': no column 'nope'"):
        lake.read("experiments", 0, columns=["traj_id", "nope"])


def test_failed_write_leaves_previous_partition_intact(lake):
    traj = _traj()
    lake.replace_partition("trajectories", 0, traj)
    bad = traj.set_column(traj.column_names.index("reward"), "reward", pa.array([math.nan] * 6))
    with pytest.raises(SchemaError):
        lake.replace_partition("trajectories", 0, bad)
    assert lake.read("trajectories", 0).num_rows == 6
    assert not [p for p in lake.table_dir("trajectories").iterdir() if p.name.startswith(".")]


def test_empty_tables_are_queryable_views(lake):
    out = query(lake, "select count(*) as n from spans")
    assert out.to_pylist() == [{"n": 0}]
    cols = query(lake, "select * from advantages limit 0").column_names
    assert {"method", "token_adv", "components", "round"} <= set(cols)


def test_query_command_formats(lake, tmp_path):
    traj = _traj()
    write_round(lake, 0, traj, _steps(traj), batch_groups=8)
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "query",
            "--lake",
            str(lake.root),
            "select group_id, count(*) n from trajectories group by 1 order by 1",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "g2" in res.output
    res = runner.invoke(
        app,
        [
            "query",
            "--lake",
            str(lake.root),
            "--format",
            "csv",
            "select traj_id from trajectories order by 1 limit 2",
        ],
    )
    assert res.output.splitlines() == ['"traj_id"', '"g0s0"', '"g0s1"']
    out = tmp_path / "r.parquet"
    res = runner.invoke(
        app,
        ["query", "--lake", str(lake.root), "--format", "parquet", "--out", str(out), "select * from steps"],
    )
    assert res.exit_code == 0 and out.exists()
    # read-only: writes are refused
    res = runner.invoke(app, ["query", "--lake", str(lake.root), "create table x as select 1"])
    assert res.exit_code == 2
    assert "read-only" in res.output.lower() or "read only" in res.output.lower()


def test_hive_parts_small_plain_large_zstd(tmp_path, monkeypatch):
    """A small part (a run-log row, a batch's statistics) is written without compression (#36: its file is
    mostly metadata; zstd made it larger and twice as slow to write), a large one with zstd and a dictionary
    for its top-level strings only: read back by pyarrow's own metadata, the rows as written."""
    import numpy as np
    import pyarrow.parquet as pq

    from warehouse.lake import SMALL_TABLE_BYTES

    monkeypatch.setenv(FORMAT_ENV, "parquet")
    lake = Lake(tmp_path / "lake")
    assert lake.format == "parquet"
    n = SMALL_TABLE_BYTES // 8 + 1  # float64 values and a string: past the bound
    small = pa.table({"traj_id": ["a"], "x": pa.array([1.0])})
    large = pa.table(
        {"traj_id": [f"t{i % 7}" for i in range(n)], "x": pa.array(np.arange(n, dtype=np.float64))}
    )
    assert small.nbytes < SMALL_TABLE_BYTES <= large.nbytes
    for name, t in (("small", small), ("large", large)):
        path = lake.write_part("experiments", 0, t, part=name)
        group = pq.ParquetFile(path).metadata.row_group(0)
        columns = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
        dictionary = {k for k, c in columns.items() if any("DICTIONARY" in e for e in c.encodings)}
        want = ({"UNCOMPRESSED"}, set()) if name == "small" else ({"ZSTD"}, {"traj_id"})
        assert ({c.compression for c in columns.values()}, dictionary) == want, name
        assert pq.read_table(path).equals(t)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_parts_with_a_bad_part_leaves_every_part_as_it_was(tmp_path, monkeypatch, fmt):
    """`write_parts` of several parts (#36: a round's statistics parts and run-log rows at once) where one
    fails validation raises naming the field, and changes no part: the good ones given with it are not written
    either (hive: every part is validated and written to its temporary file before the first rename; Delta:
    one commit), and no temporary file is left."""
    monkeypatch.setenv(FORMAT_ENV, fmt)
    lake = Lake(tmp_path / "lake")
    traj = _traj()
    lake.write_parts("trajectories", 0, {"a": traj.slice(0, 2), "b": traj.slice(2, 2)})
    bad = traj.set_column(traj.column_names.index("reward"), "reward", pa.array([math.nan] * 6))
    with pytest.raises(SchemaError, match="reward"):
        lake.write_parts("trajectories", 0, {"a": traj, "b": bad.slice(2, 4), "c": traj.slice(4, 2)})
    assert [lake.part_name(p) for p in lake.parts("trajectories", 0)] == ["a", "b"]
    assert sorted(lake.read("trajectories", 0).column("traj_id").to_pylist()) == sorted(
        traj.slice(0, 4).column("traj_id").to_pylist()
    )
    assert not list(lake.root.rglob(".tmp-*"))


def test_hive_write_parts_syncs_the_folder_once(tmp_path, monkeypatch):
    """A hive `write_parts` of N parts syncs each file and the partition folder once after the renames (it
    synced the folder once per part), and every part reads back whole; one part is `write_part` as before."""
    import warehouse.lake as lake_module

    monkeypatch.setenv(FORMAT_ENV, "parquet")
    synced: list[str] = []
    real = lake_module.fsync_dir
    monkeypatch.setattr(lake_module, "fsync_dir", lambda p: (synced.append(p.name), real(p))[1])
    lake = Lake(tmp_path / "lake")
    traj = _traj(n_groups=4)
    parts = {f"p{i}": traj.slice(2 * i, 2) for i in range(4)}
    lake.write_parts("trajectories", 0, parts)
    assert synced == ["round=0"]
    for name, table in parts.items():
        assert (
            read_batch(lake, "trajectories", 0, name).column("traj_id").to_pylist()
            == table.column("traj_id").to_pylist()
        )
    synced.clear()
    lake.write_parts("trajectories", 0, {"p0": traj.slice(0, 2)})
    assert synced == ["round=0"]
