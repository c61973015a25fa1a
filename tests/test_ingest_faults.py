"""Broken input is a quarantine row, never a traceback (#22): bad UTF-8 in one record of a folder, JSON nested
~1000 deep, unreadable Parquet / npz files, an object-dtype uid, a missing column, an adapter that raises;
through `creditflow ingest` where the files are read."""

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flows.cli import app
from pipeline.ingest import SourceRecord, StepDraft, TrajectoryDraft, ingest
from pipeline.ingest.core import skip_json_value
from pipeline.ingest.registry import ADAPTERS, adapter
from pipeline.tokenize import ByteTokenizer
from warehouse.lake import Lake
from warehouse.sources import read_table_sources

BYTES = ByteTokenizer()
DEEP = "[" * 1000 + "]" * 1000


def _line(traj_id, **extra):
    rec = {
        "traj_id": traj_id,
        "group_id": "g",
        "reward": 1.0,
        "messages": [{"role": "user", "content": "hé"}, {"role": "assistant", "content": "ok"}],
    }
    rec.update(extra)
    return json.dumps(rec, ensure_ascii=False)


def _cli_ingest(src, fmt, lake, *more):
    args = ["ingest", str(src), "--format", fmt, "--lake", str(lake), "--round", "0", "--tokenizer", "bytes"]
    out = CliRunner().invoke(app, [*args, *more])
    assert out.exit_code == 0, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)
    return Lake(lake)


def test_bad_utf8_quarantines_that_record_only(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_text("\n".join([_line("a1"), _line("a2")]) + "\n", encoding="utf-8")
    lines = [_line("b1").encode(), _line("b2").encode().replace(b"ok", b"o\xff\xfek"), _line("b3").encode()]
    (src / "b.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    lake = _cli_ingest(src, "chat-jsonl", tmp_path / "lake")
    assert sorted(lake.read("trajectories", 0).column("traj_id").to_pylist()) == ["a1", "a2", "b1", "b3"]
    q = lake.read("quarantine", 0).to_pylist()
    assert len(q) == 1 and q[0]["location"] == "line 2" and q[0]["reason"].startswith("invalid_utf8")
    assert q[0]["source_file"].endswith("b.jsonl") and "\\xff\\xfe" in q[0]["raw"]  # verbatim, escaped
    contents = lake.read("steps", 0).column("content").to_pylist()
    assert "hé" in contents  # good UTF-8 is still read as UTF-8


def test_lone_surrogate_escapes_are_quarantined():
    lines = [
        _line("ok"),
        _line("s1", group_id="x\ud800"),
        json.dumps(json.loads(_line("s2")) | {"traj_id": "s2\udc80"}),
    ]
    res = ingest("chat-jsonl", [("r.jsonl", "\n".join(lines))], tokenizer=BYTES)
    assert res.trajectories.column("traj_id").to_pylist() == ["ok"]
    assert [r.split(":")[0] for r in res.quarantine.column("reason").to_pylist()] == ["invalid_utf8"] * 2


def test_deep_nesting_in_every_json_container(real_data):
    res = ingest(
        "chat-jsonl", [("r.jsonl", "\n".join([_line("ok"), _line("deep")[:-1] + f', "x": {DEEP}}}']))]
    )
    assert res.trajectories.column("traj_id").to_pylist() == ["ok"]
    assert res.quarantine.column("reason").to_pylist() == ["malformed_json"]
    assert res.quarantine.column("detail").to_pylist() == ["nested too deep to parse"]
    # a JSON array of records (tau-bench) and an object of records (react): the deep record only
    tau = real_data / "tau_bench_v1" / "gpt-4o-airline.json"
    if not tau.exists():
        pytest.skip("tau-bench sample not shipped")
    first, second = json.loads(tau.read_text())[:2]
    text = "[" + ",".join([json.dumps(first), DEEP, json.dumps(second)]) + "]"
    res = ingest("tau-bench", [("t.json", text)], tokenizer=BYTES)
    assert res.stats["records_read"] == 3 and res.quarantine.column("location").to_pylist() == ["[1]"]
    assert res.trajectories.num_rows + res.quarantine.num_rows == 3
    text = '{"a": ' + DEEP + ', "b": ' + json.dumps({"x": 1}) + "}"
    res = ingest("react", [("r.json", text)], tokenizer=BYTES)
    assert res.quarantine.column("location").to_pylist()[0] == '["a"]'
    assert res.stats["records_read"] == 2


def test_skip_json_value_matches_brackets_outside_strings():
    text = '[["a]", "\\"]"], {"k": "}"}] , 1'
    assert skip_json_value(text, 0) == text.index(" , 1")
    assert skip_json_value('{"a": [1, {"b": "\\\\"}]}x', 0) == len('{"a": [1, {"b": "\\\\"}]}')


def _canonical():
    res = ingest("chat-jsonl", [("r.jsonl", "\n".join([_line("t1"), _line("t2")]))], tokenizer=BYTES)
    return res.trajectories.drop(["round"]), res.steps.drop(["round"])


def test_unreadable_and_column_faults_in_canonical_parquet(tmp_path):
    traj, steps = _canonical()
    good = tmp_path / "good"
    for name, table in (("trajectories", traj), ("steps", steps)):
        (good / name).mkdir(parents=True)
        pq.write_table(table, good / name / "part-0.parquet")
    broken = tmp_path / "broken"
    (broken / "trajectories").mkdir(parents=True)
    (broken / "steps").mkdir(parents=True)
    (broken / "trajectories" / "part-0.parquet").write_bytes(b"PAR1 not parquet at all PAR1")
    pq.write_table(steps, broken / "steps" / "part-0.parquet")
    truncated = tmp_path / "loose" / "x_trajectories.parquet"
    truncated.parent.mkdir()
    buf = io.BytesIO()
    pq.write_table(traj, buf)
    truncated.write_bytes(buf.getvalue()[:-20])
    pq.write_table(steps, tmp_path / "loose" / "x_steps.parquet")

    res = ingest("parquet", read_table_sources([good, broken, tmp_path / "loose"]), tokenizer=BYTES)
    assert res.trajectories.column("traj_id").to_pylist() == ["t1", "t2"]
    reasons = res.quarantine.column("reason").to_pylist()
    assert len(reasons) == 2 and all(r.startswith("unreadable_file") for r in reasons)
    assert res.stats["records_read"] == 4

    # a missing required column: each row names it; the other rows of other sources are kept
    no_group = traj.drop(["group_id"])
    no_content = steps.drop(["content"])
    res = ingest(
        "parquet",
        [
            ("a", {"trajectories": no_group, "steps": steps}),
            ("b", {"trajectories": traj, "steps": no_content}),
        ],
        tokenizer=BYTES,
    )
    assert res.trajectories.num_rows == 0
    assert sorted(res.quarantine.column("field").to_pylist()) == [
        "content",
        "content",
        "group_id",
        "group_id",
    ]
    assert res.trajectories.num_rows + res.quarantine.num_rows == res.stats["records_read"]
    # a column of the wrong type in one source: that source is quarantined, the other ingested
    bad_type = traj.set_column(traj.column_names.index("reward"), "reward", pa.array([[1.0], [2.0]]))
    other = traj.set_column(0, "traj_id", pa.array(["u1", "u2"]))
    other_steps = steps.set_column(
        0, "traj_id", pa.array(["u1" if t == "t1" else "u2" for t in steps["traj_id"].to_pylist()])
    )
    res = ingest(
        "parquet",
        [
            ("a", {"trajectories": bad_type, "steps": steps}),
            ("b", {"trajectories": other, "steps": other_steps}),
        ],
        tokenizer=BYTES,
    )
    assert res.trajectories.column("traj_id").to_pylist() == ["u1", "u2"]
    assert res.trajectories.num_rows + res.quarantine.num_rows == res.stats["records_read"]


def _verl(n=2):
    return {
        "responses": np.array([[5, 6, 7]] * n, np.int64),
        "response_mask": np.array([[1, 1, 0]] * n, np.int64),
        "token_level_scores": np.array([[0.0, 1.0, 0.0]] * n),
        "uid": np.array([f"u{i}" for i in range(n)]),
    }


def test_unreadable_npz_and_object_uid_through_the_cli(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    np.savez(src / "good.npz", **_verl())
    (src / "corrupt.npz").write_bytes(b"PK\x03\x04 not a zip")
    obj = _verl()
    obj["uid"] = np.array(["u0", None], dtype=object)  # pickled in the npz: read by the arrays-only unpickler
    np.savez(src / "object_uid.npz", **obj)
    (src / "bad.parquet").write_bytes(b"PAR1\x00\x00PAR1")
    table = pa.table(
        {
            "responses": [[5, 6, 7]] * 2,
            "response_mask": [[1, 1, 0]] * 2,
            "token_level_scores": [[0.0, 1.0, 0.0]] * 2,
            "uid": [{"a": 1}, {"a": 2}],  # a struct uid: an object column once read
        }
    )
    pq.write_table(table, src / "struct_uid.parquet")
    lake = _cli_ingest(src, "verl-batch", tmp_path / "lake")
    assert sorted(lake.read("trajectories", 0).column("traj_id").to_pylist()) == [
        "good:0",
        "good:1",
        "object_uid:0",
    ]
    q = lake.read("quarantine", 0).to_pylist()
    by_file = {r["source_file"].rsplit("/", 1)[-1]: f"{r['reason']}: {r['detail']}" for r in q}
    assert by_file["corrupt.npz"].startswith("unreadable_file")
    assert by_file["object_uid.npz"].startswith("invalid_value") and "uid None" in by_file["object_uid.npz"]
    assert by_file["bad.parquet"].startswith("unreadable_file")
    struct = [r for r in q if r["source_file"].endswith("struct_uid.parquet")]
    assert [r["field"] for r in struct] == ["uid", "uid"]  # per row, not str(dict) as a group id
    assert lake.read("trajectories", 0).num_rows == 3 and len(q) == 3 + 2


def test_object_uid_and_missing_key_in_memory():
    a = _verl(3)
    a["uid"] = np.array(["u0", None, 7], dtype=object)
    res = ingest("verl-batch", [("o.npz", a)], tokenizer=BYTES)
    assert res.trajectories.column("group_id").to_pylist() == ["u0", "7"]  # None is not the group "None"
    assert res.quarantine.column("field").to_pylist() == ["uid"] and res.stats["records_read"] == 3
    a["uid"] = np.array([1.0, np.nan, 2.5])
    res = ingest("verl-batch", [("f.npz", a)], tokenizer=BYTES)
    assert res.trajectories.column("group_id").to_pylist() == ["1"] and res.quarantine.num_rows == 2
    a = _verl()
    a["uid"] = np.array([["x", "y"], ["z", "w"]])  # 2-D uid
    res = ingest("verl-batch", [("two_d.npz", a), ("fine.npz", _verl())], tokenizer=BYTES)
    assert sorted(res.trajectories.column("traj_id").to_pylist()) == ["fine:0", "fine:1"]
    assert res.quarantine.num_rows >= 1
    assert res.trajectories.num_rows + res.quarantine.num_rows == res.stats["records_read"]
    a = _verl()
    del a["responses"]
    res = ingest("verl-batch", [("m.npz", a)], tokenizer=BYTES)
    assert res.quarantine.column("field").to_pylist() == ["responses"]


def test_a_reader_or_adapter_that_raises_stops_nothing_else():
    def reader(text, source_file):
        for i, line in enumerate(text.splitlines()):
            if line == "boom":
                raise RuntimeError("reader bug")
            yield SourceRecord(source_file, f"line {i + 1}", line, line)

    @adapter("_faulty_test", reader=reader, action_format=None)
    def convert(record):
        if record.data == "raise":
            raise KeyError("adapter bug")
        steps = [StepDraft("user", "q"), StepDraft("assistant", record.data)]
        return TrajectoryDraft(traj_id=record.data, group_id="g", reward=1.0, steps=steps)

    try:
        res = ingest("_faulty_test", [("f", "a\nraise\nb\nboom\nc"), ("g", "d")], tokenizer=BYTES)
    finally:
        ADAPTERS.pop("_faulty_test", None)
    assert res.trajectories.column("traj_id").to_pylist() == ["a", "b", "d"]
    reasons = res.quarantine.column("reason").to_pylist()
    assert reasons == ["adapter_error", "adapter_error"]  # a stable category; what exactly is in `detail`
    assert "reader bug" in res.quarantine.column("detail")[1].as_py() and res.stats["records_read"] == 5
