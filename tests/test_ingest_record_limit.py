"""Ingest's per-record size limit (#33.9): a record over `--max-record-bytes` is quarantined unread with the
stable reason `record_too_large`, its raw the record's first 64 KiB (truncated, said in its detail); the other
records of the file are ingested with their line numbers; a JSON document over the limit is one such row;
0 lifts the limit. (Memory, before and after: bench/ingest_record_limit.py.)"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from flows.cli import app
from warehouse.ingest_run import RECORD_TOO_LARGE, ingest_sources
from warehouse.lake import Lake
from warehouse.sources import RAW_HEAD_BYTES

runner = CliRunner()


def _record(i: int, content: str = "ok") -> str:
    return json.dumps(
        {
            "traj_id": f"t{i}",
            "group_id": "g",
            "reward": 1.0,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}],
        }
    )


def test_a_jsonl_record_over_the_limit_is_quarantined_unread(tmp_path):
    src = tmp_path / "r.jsonl"
    big = _record(1, "x" * 300_000)
    src.write_text("\n".join([_record(0), big, _record(2)]) + "\n")
    lake = tmp_path / "lake"
    args = ["ingest", str(src), "--format", "chat-jsonl", "--lake", str(lake), "--round", "0"]
    res = runner.invoke(app, [*args, "--tokenizer", "bytes", "--max-record-bytes", "100000"])
    assert res.exit_code == 0, res.output
    store = Lake(lake)
    assert sorted(store.read("trajectories", 0).column("traj_id").to_pylist()) == ["t0", "t2"]
    (row,) = store.read("quarantine", 0).to_pylist()
    assert row["reason"] == RECORD_TOO_LARGE and row["location"] == "line 2"
    assert row["raw"] == big[:RAW_HEAD_BYTES] and len(big) > RAW_HEAD_BYTES
    assert row["detail"].startswith(f"{len(big)} bytes, over the record limit of 100000 bytes")
    assert f"first {RAW_HEAD_BYTES} bytes, truncated" in row["detail"]
    # no limit: the record is read like any other
    res = runner.invoke(app, [*args, "--tokenizer", "bytes", "--max-record-bytes", "0"])
    assert res.exit_code == 0, res.output
    assert Lake(lake).read("trajectories", 0).num_rows == 3 and Lake(lake).read("quarantine", 0).num_rows == 0


def test_a_json_document_over_the_limit_is_one_row(tmp_path):
    doc = tmp_path / "doc.json"
    doc.write_text(json.dumps([json.loads(_record(i, "y" * 500)) for i in range(20)]))
    small = tmp_path / "small.jsonl"
    small.write_text(_record(99) + "\n")
    run = ingest_sources(
        [str(doc), str(small)], "chat-jsonl", 0, str(tmp_path / "lake"), "bytes", 8, max_record_bytes=4096
    )
    assert run.result.trajectories.column("traj_id").to_pylist() == ["t99"]
    (row,) = run.result.quarantine.to_pylist()
    assert (row["reason"], row["location"], row["source_file"]) == (RECORD_TOO_LARGE, "file", str(doc))
    assert row["raw"] == doc.read_text()[:RAW_HEAD_BYTES]
    assert run.result.stats["records_read"] == 2
