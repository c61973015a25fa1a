"""`creditflow ingest` end to end: files -> lake -> `creditflow query`; re-ingest is idempotent; --strict."""

import json

import pytest
from typer.testing import CliRunner

from flows.cli import app
from warehouse.lake import FORMAT_ENV, FORMATS, Lake

runner = CliRunner()
TAU2 = "tau2_bench/qwen2.5-7b_airline_1trial.json"


def _query(lake, sql):
    out = runner.invoke(app, ["query", sql, "--lake", str(lake), "--format", "json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_ingest_tau2_bench_into_lake_and_query(real_data, tmp_path, monkeypatch):
    monkeypatch.delenv(FORMAT_ENV, raising=False)
    src = real_data / TAU2
    if not src.exists():
        pytest.skip("tau2-bench sample not shipped")
    lake = tmp_path / "lake"
    args = [
        "ingest",
        str(src),
        "--format",
        "tau2-bench",
        "--lake",
        str(lake),
        "--round",
        "2",
        "--batch-groups",
        "16",
    ]  # default SmolLM2 tokenizer (fewer tokens than bytes)
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    for word in ("records read", "trajectories", "tokens", "quarantined", str(lake.resolve())):
        assert word in out.output
    # 50 groups in parts of 16 groups: 4 aligned parts
    store = Lake(lake)
    assert store.format == "delta"  # a new lake is Delta (CREDITFLOW_LAKE_FORMAT unset)
    names = ["b00000", "b00001", "b00002", "b00003"]
    assert [store.part_name(p) for p in store.parts("trajectories", 2)] == names
    assert [store.part_name(p) for p in store.parts("steps", 2)] == names

    def counts():
        return _query(
            lake,
            "SELECT (SELECT count(*) FROM trajectories) AS t, "
            "(SELECT count(DISTINCT group_id) FROM trajectories) AS g, "
            "(SELECT count(*) FROM steps) AS s, "
            "(SELECT count(*) FROM steps WHERE role = 'tool' AND is_error) AS e, "
            "(SELECT count(*) FROM quarantine) AS q, "
            "(SELECT min(round) FROM trajectories) AS r",
        )[0]

    first = counts()
    assert first == {"t": 50, "g": 50, "s": 1682, "e": 79, "q": 0, "r": 2}
    # the same input again: the same rows, once
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    assert counts() == first
    dup = _query(
        lake,
        "SELECT count(*) AS n FROM (SELECT traj_id, step_idx FROM steps GROUP BY 1, 2 HAVING count(*) > 1)",
    )
    assert dup == [{"n": 0}]


def test_ingest_quarantine_and_strict(tmp_path):
    good = {
        "traj_id": "a",
        "reward": 1.0,
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
    }
    src = tmp_path / "in"
    src.mkdir()
    (src / "r.jsonl").write_text(
        json.dumps(good) + "\n{broken\n" + json.dumps({**good, "traj_id": "b", "reward": None}) + "\n"
    )
    (src / "notes.txt").write_text("not an input")
    lake = tmp_path / "lake"
    base = [
        "ingest",
        str(src),
        "--format",
        "chat-jsonl",
        "--lake",
        str(lake),
        "--round",
        "0",
        "--tokenizer",
        "bytes",
    ]
    out = runner.invoke(app, base)
    assert out.exit_code == 0, out.output
    assert "malformed_json" in out.output and "missing_field" in out.output
    q = _query(lake, "SELECT reason, location, raw FROM quarantine ORDER BY location")
    assert [r["location"] for r in q] == ["line 2", "line 3"] and q[0]["raw"] == "{broken"
    assert _query(lake, "SELECT traj_id FROM trajectories") == [{"traj_id": "a"}]

    out = runner.invoke(app, [*base, "--strict"])
    assert out.exit_code == 1
    # clean input with --strict: success, and the old quarantine rows are gone
    (src / "r.jsonl").write_text(json.dumps(good) + "\n")
    out = runner.invoke(app, [*base, "--strict"])
    assert out.exit_code == 0, out.output
    assert _query(lake, "SELECT count(*) AS n FROM quarantine") == [{"n": 0}]


@pytest.mark.parametrize("fmt", FORMATS)
def test_ingest_parquet_from_a_lake_export(tmp_path, monkeypatch, fmt):
    """A lake is an ingest source as it is now: a Delta lake's folders also hold the files of the versions its
    round replaced, which are not read."""
    monkeypatch.setenv(FORMAT_ENV, fmt)
    good = {
        "traj_id": "a",
        "group_id": "g",
        "reward": 0.5,
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
    }
    first = tmp_path / "lake1"
    for reward in (0.25, 0.5):  # round 0 ingested, then replaced
        (tmp_path / "r.jsonl").write_text(json.dumps({**good, "reward": reward}) + "\n")
        args = ["ingest", str(tmp_path / "r.jsonl"), "-f", "chat-jsonl", "--lake", str(first), "--round", "0"]
        assert runner.invoke(app, [*args, "--tokenizer", "bytes"]).exit_code == 0
    assert Lake(first).format == fmt
    second = tmp_path / "lake2"
    out = runner.invoke(
        app,
        [
            "ingest",
            str(first),
            "-f",
            "parquet",
            "--lake",
            str(second),
            "--round",
            "7",
            "--tokenizer",
            "bytes",
        ],
    )
    assert out.exit_code == 0, out.output
    rows = _query(second, "SELECT traj_id, round, reward FROM trajectories")
    assert rows == [{"traj_id": "a", "round": 7, "reward": 0.5}]


def test_ingest_errors(tmp_path):
    out = runner.invoke(
        app,
        [
            "ingest",
            str(tmp_path / "missing.json"),
            "-f",
            "react",
            "--round",
            "0",
            "--lake",
            str(tmp_path / "l"),
        ],
    )
    assert out.exit_code == 2
    out = runner.invoke(app, ["ingest", str(tmp_path), "-f", "no-such-format", "--round", "0"])
    assert out.exit_code == 2
