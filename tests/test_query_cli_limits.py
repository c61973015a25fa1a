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
