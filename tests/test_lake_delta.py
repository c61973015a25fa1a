"""The Delta lake (#25) on a local folder: the same `Lake` API as hive Parquet (a property test runs one
sequence of writes on both and compares every read), atomic idempotent part writes, versions and time travel,
the format decided by what is on disk, the per-connection DuckDB catalog (no stored paths), and migration of a
hive-Parquet lake without re-ingesting."""

from __future__ import annotations

import pickle
import shutil

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_foundation_lake import _steps, _traj
from typer.testing import CliRunner

pytest.importorskip("deltalake")

from flows.cli import app  # noqa: E402
from schemas import TABLES  # noqa: E402
from warehouse.catalog import connect, query  # noqa: E402
from warehouse.delta_lake import DeltaLake  # noqa: E402
from warehouse.delta_migrate import migrate  # noqa: E402
from warehouse.lake import FORMAT_ENV, Lake, LakeError  # noqa: E402
from warehouse.rounds import batch_names, read_batch, write_round  # noqa: E402

runner = CliRunner()


def _hive(path):
    (path / "trajectories").mkdir(parents=True)  # a table folder without a Delta log: hive Parquet
    lake = Lake(path)
    assert type(lake) is Lake
    return lake


@pytest.fixture
def delta(tmp_path, monkeypatch):
    monkeypatch.setenv(FORMAT_ENV, "delta")
    return Lake(tmp_path / "dlake")


def test_format_follows_the_disk_and_the_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(FORMAT_ENV, raising=False)
    d = Lake(tmp_path / "d")
    assert isinstance(d, DeltaLake) and not (tmp_path / "d").exists()  # new: Delta; deciding creates nothing
    monkeypatch.setenv(FORMAT_ENV, "parquet")
    h = Lake(tmp_path / "h")
    assert type(h) is Lake  # a new lake in the hive layout when asked
    d.write_part("steps", 0, _steps(_traj()), part="b00000")
    assert isinstance(Lake(tmp_path / "d"), DeltaLake)  # the disk decides from now on
    monkeypatch.setenv(FORMAT_ENV, "delta")
    p = tmp_path / "p"
    (p / "steps" / "round=0").mkdir(parents=True)
    assert type(Lake(p)) is Lake  # an existing hive lake stays hive
    assert isinstance(pickle.loads(pickle.dumps(d)), DeltaLake)  # a worker gets the lake from its URI
    monkeypatch.delenv(FORMAT_ENV)
    assert type(pickle.loads(pickle.dumps(h))) is Lake  # ... in its format, whatever the worker's setting
    monkeypatch.setenv(FORMAT_ENV, "orc")
    with pytest.raises(LakeError, match="one of parquet, delta"):
        Lake(tmp_path / "x")


def test_a_new_delta_lake_says_so_before_its_first_commit(tmp_path, monkeypatch):
    """delta-rs writes a table's data files before its log: a killed first write leaves a table folder with no
    `_delta_log`, which alone would read as a hive lake; the `_format` marker says delta first."""
    monkeypatch.delenv(FORMAT_ENV, raising=False)
    d = Lake(tmp_path / "d")
    d.write_part("steps", 0, _steps(_traj()), part="b00000")
    assert (tmp_path / "d" / "_format").read_text().strip() == "delta"
    shutil.rmtree(tmp_path / "d" / "steps" / "_delta_log")  # as if the first commit never happened
    assert (tmp_path / "d" / "steps").is_dir()
    monkeypatch.setenv(FORMAT_ENV, "parquet")
    assert isinstance(Lake(tmp_path / "d"), DeltaLake)


def test_loaded_tables_are_kept_per_process_and_not_reused_for_a_remade_lake(tmp_path):
    """Every DeltaLake of one URI in a thread shares the loaded tables (the flow opens one per task); a lake
    deleted and made again at the same path by another thread is read afresh, not as the kept old table
    brought up to date with the new log's commits."""
    import threading

    traj = _traj()
    a = DeltaLake(tmp_path / "l")
    a.write_part("trajectories", 0, traj, part="x")
    b = DeltaLake(tmp_path / "l")
    assert b._open_tables() is a._open_tables() and "trajectories" in b._open_tables()
    assert b.read("trajectories", 0).num_rows == traj.num_rows

    def remake():
        shutil.rmtree(tmp_path / "l")
        c = DeltaLake(tmp_path / "l")
        for k in range(3):
            c.write_part("trajectories", 0, traj.slice(0, 1), part=f"y{k}")

    thread = threading.Thread(target=remake)
    thread.start()
    thread.join()
    assert a.part_names("trajectories", 0) == ["y0", "y1", "y2"]
    assert a.read("trajectories", 0).num_rows == 3
    # another writer's commit is seen by the kept table (its version's next commit file is there)
    other = threading.Thread(
        target=lambda: DeltaLake(tmp_path / "l").write_part("trajectories", 0, traj, "z")
    )
    other.start()
    other.join()
    assert a.part_names("trajectories", 0) == ["y0", "y1", "y2", "z"]
    assert a.count_rows("trajectories", 0) == 3 + traj.num_rows


def test_a_kept_table_is_loaded_again_after_a_checkpoint(tmp_path, monkeypatch):
    """delta-rs grows a kept table's snapshot by one record batch per commit and never merges them, so every
    commit through it cost more (15 -> 137 ms over 1,200 commits): the lake loads the table again, from the
    checkpoint, once its log passed one, whether by its own commits or another writer's, and keeps it between."""
    import warehouse.delta_lake as dl

    monkeypatch.setattr(dl, "CHECKPOINT_EVERY", 4)
    traj = _traj()
    lake = DeltaLake(tmp_path / "l")
    lake.write_part("trajectories", 0, traj, part="p1")  # version 1 (0: the table's creation)
    kept = lake._table("trajectories")
    for k in range(2, 4):  # versions 2-3: the same table throughout
        lake.write_part("trajectories", 0, traj, part=f"p{k}")
        assert lake._table("trajectories") is kept
    lake.write_part("trajectories", 0, traj, part="p4")  # version 4: a checkpoint's
    again = lake._table("trajectories")
    assert again is not kept and again.version() == 4
    assert lake.part_names("trajectories", 0) == [f"p{k}" for k in range(1, 5)]
    for k in range(5, 8):
        DeltaLake(tmp_path / "l").write_part(
            "trajectories", 0, traj, part=f"p{k}"
        )  # the same thread's kept one
    assert lake._table("trajectories") is again  # versions 5-7: no checkpoint passed

    def other_writer():  # another thread keeps its own tables: its commits reach ours through the log
        w = DeltaLake(tmp_path / "l")
        for k in range(8, 10):
            w.write_part("trajectories", 0, traj, part=f"p{k}")

    import threading

    thread = threading.Thread(target=other_writer)
    thread.start()
    thread.join()
    last = lake._table("trajectories")
    assert last is not again and last.version() == 9  # brought up to date past version 8: loaded again
    assert lake.count_rows("trajectories", 0) == 9 * traj.num_rows


def test_part_writes_are_idempotent_versioned_and_travel_in_time(delta):
    traj = _traj()
    v0 = delta.write_part("trajectories", 0, traj, part="x") and delta.last_versions["trajectories"]
    delta.write_part("trajectories", 0, traj, part="x")  # the same part again: replaced, not appended
    assert delta.read("trajectories", 0).num_rows == traj.num_rows
    delta.write_part("trajectories", 0, traj.slice(0, 2), part="x")
    assert delta.read("trajectories", 0).num_rows == 2
    assert delta.read("trajectories", 0, as_of={"trajectories": v0}).num_rows == traj.num_rows
    token = delta.version()
    assert token == f"trajectories={delta.last_versions['trajectories']}"
    delta.replace_partition("trajectories", 0, {"y": traj})
    assert delta.read("trajectories", 0, as_of=token).num_rows == 2
    assert query(delta, "SELECT count(*) AS n FROM trajectories", as_of=token).to_pylist() == [{"n": 2}]
    assert query(delta, "SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": traj.num_rows}]
    with pytest.raises(LakeError, match="no version"):
        delta.read("trajectories", 0, as_of={"trajectories": 99})


def test_two_writers_creating_a_table_at_once_write_its_part_once(tmp_path, monkeypatch):
    """Two writers (two machines' first advantages part) write the same part of a table neither has created:
    the part holds one write's rows. delta-rs commits a new table's data with its creation, and the writer that
    lost that race committed its data as the next version without removing the other's: the rows were there
    twice (both processes of tests/test_lake_s3.py's two-process run then stopped at export)."""
    import threading

    monkeypatch.setenv(FORMAT_ENV, "delta")
    Lake(tmp_path / "dlake").write_part("trajectories", 0, _traj(), part="seed")  # the lake exists
    traj = _traj(n_groups=3)
    tables = [f"t{i}" for i in range(12)]
    barrier = threading.Barrier(2)

    def writer():
        lake = Lake(tmp_path / "dlake")  # each its own loaded tables (its own process's view)
        for name in tables:
            barrier.wait()
            lake.write_part(name, 0, traj, part="b00000")

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lake = Lake(tmp_path / "dlake")
    assert {name: lake.read(name, 0).num_rows for name in tables} == {name: traj.num_rows for name in tables}


def test_an_empty_part_is_a_part(delta):
    """A stage that produced no rows for a batch has run: its part is there (and is not recomputed)."""
    empty = _traj().slice(0, 0)
    delta.write_part("trajectories", 3, empty, part="e")
    assert delta.has_part("trajectories", 3, "e") and delta.rounds("trajectories") == []
    assert delta.part_stat("trajectories", 3, "e")[1] == 0
    delta.write_part("trajectories", 3, _traj(), part="e")
    assert delta.has_part("trajectories", 3, "e") and delta.part_stat("trajectories", 3, "e")[1] > 0
    assert delta.delete_parts("trajectories", 3) == 1 and not delta.has_part("trajectories", 3, "e")


def test_several_parts_of_a_batch_are_one_commit(delta):
    """write_parts (a stage's parts of a batch, one per method) is one Delta commit on the table: the parts are
    replaced together, the table's other parts stay, and an empty part among them is a part."""
    traj = _traj(n_groups=3)

    def rows(part: str) -> int:
        return read_batch(delta, "trajectories", 0, part).num_rows

    delta.write_part("trajectories", 0, traj, part="b0.keep")
    delta.write_parts("trajectories", 0, {"b1.grpo": traj, "b1.gae": traj.slice(0, 2)})
    before = delta.last_versions["trajectories"]
    delta.write_parts("trajectories", 0, {"b1.grpo": traj.slice(0, 1), "b1.gae": traj.slice(0, 0)})
    assert delta.last_versions["trajectories"] == before + 1  # one commit for both parts
    assert rows("b1.grpo") == 1 and rows("b1.gae") == 0
    assert delta.has_part("trajectories", 0, "b1.gae")  # empty: still a part
    assert rows("b0.keep") == traj.num_rows  # not among them: untouched
    delta.write_parts("trajectories", 0, {"b1.gae": traj})  # an empty part written again with rows
    assert rows("b1.gae") == traj.num_rows
    assert [delta.part_name(p) for p in delta.parts("trajectories", 0)] == ["b0.keep", "b1.gae", "b1.grpo"]
    assert delta.read("trajectories", 0).num_rows == 2 * traj.num_rows + 1


def test_big_parts_are_a_commit_each(delta, monkeypatch):
    """Parts whose Arrow sizes add up past WRITE_GROUP_BYTES go in several commits (delta-rs buffers a commit's
    data whole): the same parts on disk, a commit per group."""
    import warehouse.delta_lake as dl

    traj = _traj(n_groups=3)
    parts = {"b1.a": traj, "b1.b": traj.slice(0, 2), "b1.c": traj.slice(0, 1)}
    delta.write_part("trajectories", 0, traj, part="b0")
    monkeypatch.setattr(dl, "WRITE_GROUP_BYTES", traj.nbytes + traj.slice(0, 2).nbytes)  # a + b, then c
    before = delta.last_versions["trajectories"]
    delta.write_parts("trajectories", 0, parts)
    assert delta.last_versions["trajectories"] == before + 2
    monkeypatch.setattr(dl, "WRITE_GROUP_BYTES", 1)  # each its own commit
    delta.write_parts("trajectories", 0, parts)
    assert delta.last_versions["trajectories"] == before + 5
    for name, table in parts.items():
        assert read_batch(delta, "trajectories", 0, name).num_rows == table.num_rows
    assert [delta.part_name(p) for p in delta.parts("trajectories", 0)] == ["b0", "b1.a", "b1.b", "b1.c"]


def test_round_reads_and_the_catalog_match_hive_parquet(delta, tmp_path):
    hive = _hive(tmp_path / "hive")
    traj = _traj(n_groups=5)
    for lake in (delta, hive):
        write_round(lake, 0, traj, _steps(traj), batch_groups=2)
        write_round(lake, 1, traj.slice(0, 4), _steps(traj.slice(0, 4)), batch_groups=2)
    assert batch_names(delta, 0) == batch_names(hive, 0) == ["b00000", "b00001", "b00002"]
    for b in batch_names(hive, 0):
        assert read_batch(delta, "steps", 0, b).equals(read_batch(hive, "steps", 0, b))
    sql = "SELECT round, count(*) AS n, sum(len(token_ids)) AS t FROM steps GROUP BY round ORDER BY round"
    assert query(delta, sql).equals(query(hive, sql))
    assert query(delta, "SELECT count(*) AS n FROM spans").to_pylist() == [{"n": 0}]


def test_the_delta_catalog_is_read_only(delta, tmp_path):
    traj = _traj()
    write_round(delta, 0, traj, _steps(traj))
    before = delta.version()
    for sql in (
        "COPY (SELECT 1) TO 'x.csv'",
        "SELECT * FROM read_text('/etc/passwd')",
        "INSTALL httpfs",
        "CREATE TEMP VIEW trajectories AS SELECT 1",
        "DROP VIEW trajectories",
    ):
        with pytest.raises(duckdb.Error):
            query(delta, sql)
    con = connect(delta)
    try:
        for sql in ("SELECT * FROM read_text('/etc/passwd')", "SET enable_external_access = true"):
            with pytest.raises(duckdb.Error):
                con.execute(sql)
    finally:
        con.close()
    assert delta.version() == before


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_no_stored_paths_a_copied_lake_reads_its_own_files(tmp_path, monkeypatch, fmt):
    """#25: a copy of a lake with round 1 deleted returned round 1 from the original through catalog.duckdb."""
    monkeypatch.setenv(FORMAT_ENV, fmt)
    lake = Lake(tmp_path / "a")
    assert lake.format == fmt
    traj = _traj()
    for r in (0, 1):
        write_round(lake, r, traj, _steps(traj))
    query(lake, "SELECT 1")
    shutil.copytree(lake.root, tmp_path / "b")
    copy = Lake(tmp_path / "b")
    assert copy.format == fmt
    for table in ("trajectories", "steps", "quarantine"):
        if fmt == "parquet":  # the hive layout: the round's folder goes
            shutil.rmtree(tmp_path / "b" / table / "round=1", ignore_errors=True)
        else:  # Delta: a commit in the copy's own log
            copy.replace_partition(table, 1, {})
    rounds = query(tmp_path / "b", "SELECT DISTINCT round FROM trajectories ORDER BY round")
    assert rounds.column("round").to_pylist() == [0]
    original = query(lake, "SELECT DISTINCT round FROM trajectories ORDER BY round")
    assert original.column("round").to_pylist() == [0, 1]


def test_migrate_converts_a_hive_lake_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv(FORMAT_ENV, "parquet")
    hive = Lake(tmp_path / "lake")
    assert type(hive) is Lake
    traj = _traj(n_groups=4)
    write_round(hive, 0, traj, _steps(traj), batch_groups=2)
    sql = "SELECT round, count(*) AS n, sum(reward) AS r FROM trajectories GROUP BY round"
    before, parts = query(hive, sql), batch_names(hive, 0)
    res = runner.invoke(app, ["lake", "migrate", "--lake", str(hive.root)])
    assert res.exit_code == 0, res.output
    after = Lake(tmp_path / "lake")
    assert isinstance(after, DeltaLake)
    assert query(after, sql).equals(before) and batch_names(after, 0) == parts
    assert not list((tmp_path / "lake").glob(".migrate-*")) and not list((tmp_path / "lake").glob(".old-*"))
    with pytest.raises(LakeError, match="already delta"):
        migrate(tmp_path / "lake")
    info = runner.invoke(app, ["lake", "info", "--lake", str(hive.root)])
    assert info.exit_code == 0 and "delta" in info.output and "trajectories=" in info.output


_names = st.sampled_from(["b0", "b1", "b2"])
_op = st.one_of(
    st.tuples(st.just("part"), st.integers(0, 2), _names, st.integers(0, 6)),
    st.tuples(
        st.just("replace"), st.integers(0, 2), st.lists(_names, max_size=3, unique=True), st.integers(0, 6)
    ),
    st.tuples(st.just("delete"), st.integers(0, 2), _names, st.just(0)),
    st.tuples(  # several parts at once (a stage's parts of a batch, one per method): one commit on Delta
        st.just("parts"), st.integers(0, 2), st.lists(_names, max_size=3, unique=True), st.integers(0, 6)
    ),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=6))
def test_delta_and_hive_agree_on_any_sequence_of_writes(tmp_path_factory, ops):
    root = tmp_path_factory.mktemp("seq")
    hive, delta = _hive(root / "hive"), DeltaLake(root / "delta")
    traj = _traj(n_groups=4)
    for kind, round_, names, n in ops:
        for lake in (hive, delta):
            if kind == "part":
                lake.write_part("trajectories", round_, traj.slice(0, n), part=names)
            elif kind == "replace":
                lake.replace_partition("trajectories", round_, {x: traj.slice(0, n) for x in names})
            elif kind == "parts":  # sizes differ per part, an empty one among them where n is small
                lake.write_parts(
                    "trajectories", round_, {x: traj.slice(0, max(n - i, 0)) for i, x in enumerate(names)}
                )
            else:
                lake.delete_parts("trajectories", round_, prefix=names)
    for round_ in range(3):
        assert [delta.part_name(p) for p in delta.parts("trajectories", round_)] == [
            hive.part_name(p) for p in hive.parts("trajectories", round_)
        ]
        a, b = hive.read("trajectories", round_), delta.read("trajectories", round_)
        key = [("traj_id", "ascending")]
        assert a.sort_by(key).equals(b.sort_by(key)), (round_, ops)
        assert delta.count_rows("trajectories", round_) == a.num_rows
    assert delta.rounds("trajectories") == [
        r for r in hive.rounds("trajectories") if hive.read("trajectories", r).num_rows
    ]


def test_delta_parts_are_written_with_the_hive_lakes_parquet_options(tmp_path):
    """zstd, and a dictionary only for the top-level string columns (delta-rs builds one for every column by
    default, which made a large advantages part ~50% slower to write): read back by pyarrow's own metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lake = DeltaLake(tmp_path / "lake")
    t = pa.table(
        {
            "traj_id": ["a", "b"],
            "step_idx": pa.array([0, 1], pa.int32()),
            "token_adv": pa.array([[0.5, 1.0], [2.0]], pa.list_(pa.float32())),
        }
    )
    lake.write_part("experiments", 0, t, part="p")
    (path,) = (tmp_path / "lake" / "experiments").rglob("*.parquet")
    group = pq.ParquetFile(path).metadata.row_group(0)
    columns = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
    assert {c.compression for c in columns.values()} == {"ZSTD"}
    dictionary = {name for name, c in columns.items() if any("DICTIONARY" in e for e in c.encodings)}
    assert dictionary == {"traj_id"}, columns.keys()
    assert lake.read("experiments", 0).sort_by("traj_id").select(t.column_names).equals(t)


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_columns_are_what_read_accepts_from_the_schema_alone(tmp_path, fmt, monkeypatch):
    """Lake.columns (the older-lake check of the preconditions) names exactly the columns `read` accepts for a
    round: hive from the round's part footers (a column one part lacks is there, one no part of the round
    holds is not), Delta from the table's schema (a column another round brought reads as nulls). No column
    data is read: the footers and the log only (ParquetFile.read fails the test)."""
    lake = _hive(tmp_path / "l") if fmt == "parquet" else DeltaLake(tmp_path / "l")
    lake.write_part("extra", 0, pa.table({"x": [1, 2], "y": ["a", "b"]}), part="a")
    lake.write_part("extra", 0, pa.table({"x": [3], "z": [1.5]}), part="b")
    lake.write_part("extra", 1, pa.table({"x": [4], "w": [True]}), part="a")
    want = {"parquet": ["x", "y", "z", "round"], "delta": ["x", "y", "z", "round", "w"]}[fmt]
    assert lake.columns("extra", 0) == want
    assert lake.columns("extra", 1) == (["x", "w", "round"] if fmt == "parquet" else want)
    assert lake.columns("trajectories", 5) == list(TABLES["trajectories"].schema.names)  # no parts: its own
    parts = lake.parts("extra", 0)
    for c in ["x", "y", "z", "w", "round", "nope"]:
        try:
            got = lake.read("extra", 0, columns=[c], parts=parts)
        except KeyError:
            got = None
        assert (got is not None) == (c in want), c
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("column data read"))
    assert lake.columns("extra", 0, parts) == want
