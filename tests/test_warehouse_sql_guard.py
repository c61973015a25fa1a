"""`creditflow query` / `warehouse.catalog.query` is read-only for real (#22): the escapes a red team tried
are refused with one line, the lake is unchanged, and the views still work."""

import hashlib

import duckdb
import pytest
from test_foundation_lake import _steps, _traj
from typer.testing import CliRunner

from flows.cli import app
from warehouse.catalog import QueryRefused, check_read_only, connect, query
from warehouse.rounds import write_round


@pytest.fixture
def filled(lake):
    traj = _traj()
    write_round(lake, 0, traj, _steps(traj), batch_groups=8)
    query(lake, "SELECT 1")  # builds the catalog once, so the snapshots below compare like with like
    return lake


def _snapshot(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "catalog.duckdb"
    }


def _escapes(lake, outside):
    part = lake.table_dir("trajectories") / "round=0" / "part-zzz.parquet"
    return {
        "copy into the lake": f"COPY (SELECT * FROM trajectories LIMIT 1) TO '{part}'",
        "copy outside": f"COPY (SELECT 1) TO '{outside / 'out.csv'}'",
        "read_text passwd": "SELECT * FROM read_text('/etc/passwd')",
        "read_csv shadow": "SELECT * FROM read_csv('/etc/shadow')",
        "glob root": "SELECT * FROM glob('/root/*')",
        "read outside file": f"SELECT * FROM read_text('{outside / 'secret.txt'}')",
        "dotdot out of the lake": f"SELECT * FROM read_text('{lake.table_dir('steps')}/../../outside/secret.txt')",
        "url": "SELECT * FROM 'https://example.com/x.parquet'",
        "install": "INSTALL httpfs",
        "force install": "FORCE INSTALL httpfs",
        "load": "LOAD httpfs",
        "attach": f"ATTACH '{outside / 'x.duckdb'}' AS x",
        "attach in lake": f"ATTACH '{lake.root / 'x.duckdb'}' AS x",
        "set external access": "SET enable_external_access = true",
        "reset lock": "RESET lock_configuration",
        "set dirs": "SET allowed_directories = ['/']",
        "pragma": "PRAGMA enable_profiling",
        "create view": "CREATE OR REPLACE VIEW trajectories AS SELECT 1 AS x",
        "create temp": "CREATE TEMP TABLE t AS SELECT 1",
        "insert": "INSERT INTO trajectories SELECT * FROM trajectories",
        "drop": "DROP VIEW trajectories",
        "export": f"EXPORT DATABASE '{lake.root / 'exp'}'",
        "explain analyze copy": f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{part}'",
        "select then copy": f"SELECT 1; COPY (SELECT 1) TO '{part}'",
    }


def test_every_escape_is_refused_and_the_lake_is_unchanged(filled, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret\n")
    before = _snapshot(filled.root)
    n = query(filled, "SELECT count(*) AS n FROM trajectories").to_pylist()
    for name, sql in _escapes(filled, outside).items():
        with pytest.raises(duckdb.Error) as info:
            query(filled, sql)
        assert "\n" not in str(info.value), name
        assert "secret" not in str(info.value) or "secret.txt" in str(info.value), name
    assert _snapshot(filled.root) == before
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert query(filled, "SELECT count(*) AS n FROM trajectories").to_pylist() == n


def test_refusals_name_the_statement():
    with pytest.raises(QueryRefused, match="COPY statements are refused"):
        check_read_only("COPY (SELECT 1) TO 'x.parquet'")
    with pytest.raises(QueryRefused, match="INSTALL"):
        check_read_only("INSTALL httpfs")
    with pytest.raises(QueryRefused, match="LOAD"):
        check_read_only("LOAD httpfs")
    with pytest.raises(QueryRefused, match="empty"):
        check_read_only("  ;  ")
    for ok in (
        "SELECT 1",
        "FROM trajectories",
        "SHOW TABLES",
        "DESCRIBE steps",
        "EXPLAIN SELECT 1",
        "VALUES (1)",
    ):
        check_read_only(ok)


def test_the_connection_itself_is_locked(filled, tmp_path):
    """Below the statement check: a connection from `connect` cannot reach files outside the lake, load
    extensions or unlock itself, even for statements the check would have refused."""
    con = connect(filled)
    try:
        for sql in (
            "SET enable_external_access = true",
            "SET allowed_directories = ['/']",
            "SET autoinstall_known_extensions = true",
            f"COPY (SELECT 1) TO '{tmp_path / 'x.csv'}'",
            "SELECT * FROM read_text('/etc/passwd')",
            "LOAD httpfs",
            f"ATTACH '{tmp_path / 'y.duckdb'}'",
        ):
            with pytest.raises(duckdb.Error):
                con.execute(sql)
        settings = dict(
            con.execute(
                "SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
                "'lock_configuration', 'autoinstall_known_extensions', 'autoload_known_extensions')"
            ).fetchall()
        )
        assert settings == {
            "enable_external_access": "false",
            "lock_configuration": "true",
            "autoinstall_known_extensions": "false",
            "autoload_known_extensions": "false",
        }
    finally:
        con.close()
    assert not list(tmp_path.glob("x.csv")) and not list(tmp_path.glob("y.duckdb"))


def test_views_still_work_on_the_locked_connection(filled):
    assert query(filled, "SELECT count(*) AS n FROM steps").to_pylist()[0]["n"] > 0
    assert query(filled, "SELECT count(*) AS n FROM spans").to_pylist() == [{"n": 0}]  # an empty table
    names = set(query(filled, "SHOW TABLES").column(0).to_pylist())
    assert {"trajectories", "steps", "advantages"} <= names
    assert query(filled, "EXPLAIN SELECT * FROM trajectories").num_rows >= 1


@pytest.mark.parametrize(
    "sql",
    [
        "COPY (SELECT * FROM trajectories) TO 'LAKE/trajectories/round=0/part-zzz.parquet'",
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM glob('/root/*')",
        "INSTALL httpfs",
        "SET enable_external_access = true",
        "DROP VIEW trajectories",
        "SELEC 1",
        "SELECT * FROM no_such_table",
    ],
)
def test_cli_refuses_with_one_line_on_stderr(filled, sql):
    before = _snapshot(filled.root)
    res = CliRunner().invoke(
        app, ["query", "--lake", str(filled.root), sql.replace("LAKE", str(filled.root))]
    )
    assert res.exit_code != 0
    assert res.exception is None or isinstance(res.exception, SystemExit)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.output
    assert _snapshot(filled.root) == before
