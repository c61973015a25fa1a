"""`creditflow query` (#33 item 11): `--out FILE` without `--format` writes the format its suffix names (an
unknown suffix is one line on stderr); a runaway query stops at `--timeout` and `--memory-limit` with one line."""

import json

import pyarrow.parquet as pq
import pytest
from test_cli_conventions import _one_line, _run, _small_lake


@pytest.fixture
def small_lake(lake):
    _small_lake(lake)
    return lake


@pytest.mark.parametrize("suffix", ["csv", "json", "parquet"])
def test_out_without_format_writes_the_suffixs_format(capsys, small_lake, tmp_path, suffix):
    target = tmp_path / f"result.{suffix}"
    sql = "select traj_id, reward from trajectories order by traj_id"
    code, out, err = _run(capsys, "query", "--lake", small_lake.root, "--out", target, sql)
    assert code == 0, err
    assert target.exists() and "1 rows" in out
    if suffix == "parquet":
        assert pq.read_table(target).column("traj_id").to_pylist() == ["t0"]
    elif suffix == "json":
        assert [r["traj_id"] for r in json.loads(target.read_text())] == ["t0"]
    else:
        assert target.read_text().splitlines()[0].replace('"', "") == "traj_id,reward"


def test_out_with_an_unknown_suffix_is_one_line(capsys, small_lake, tmp_path):
    target = tmp_path / "result.txt"
    code, _, err = _run(capsys, "query", "--lake", small_lake.root, "--out", target, "select 1")
    assert code != 0
    assert "result.txt" in _one_line(err)
    assert not target.exists()


RUNAWAY = "select count(*) from range(1000000000000) a, range(1000) b"


def test_a_query_past_its_timeout_stops_with_one_line(capsys, small_lake):
    code, _, err = _run(capsys, "query", "--lake", small_lake.root, "--timeout", "0.5", RUNAWAY)
    assert code != 0
    assert "time limit (0.5 s)" in _one_line(err) and "--timeout" in err


def test_a_query_past_its_memory_limit_stops_with_one_line(capsys, small_lake):
    sql = "select list(i) from range(200000000) t(i)"  # one list of 1.6 GB: nothing to spill
    code, _, err = _run(capsys, "query", "--lake", small_lake.root, "--memory-limit", "64MB", sql)
    assert code != 0
    assert "memory limit 64MB" in _one_line(err)


def test_the_query_timeout_is_the_query_functions_too(small_lake):
    from warehouse.catalog import QueryTimeout, query

    with pytest.raises(QueryTimeout, match="0.5 s"):
        query(small_lake.root, RUNAWAY, timeout_s=0.5)
    assert query(small_lake.root, "select count(*) AS n from trajectories", timeout_s=60).to_pylist() == [
        {"n": 1}
    ]


@pytest.mark.parametrize("how", ["query", "connect"])
def test_duckdbs_temp_folder_is_not_readable(small_lake, tmp_path, monkeypatch, how):
    """DuckDB spills to `.tmp` under the working directory by default, and SQL could read files there."""
    import duckdb

    from warehouse.catalog import connect, query

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "secret.csv").write_text("token\nhunter2\n")
    for sql in ("select * from read_text('.tmp/secret.csv')", "select * from read_csv('.tmp/secret.csv')"):
        with pytest.raises(duckdb.PermissionException):
            if how == "query":
                query(small_lake.root, sql)
            else:
                connect(small_lake.root).sql(sql).fetchall()
