"""Token data cannot lie (#22): ids are integers in [0, vocab size) and int32, logprobs finite and <= 0 (1e-4
tolerance), offsets inside the content, lengths aligned; anything else is a quarantine row naming the field,
in every path (text adapters, canonical Parquet, verl batches), and nothing bad reaches `export --layout verl`."""

import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.export import build_train_batch
from pipeline.ingest import ingest
from pipeline.ingest.core import LOGPROB_TOLERANCE, TOKEN_ID_LIMIT
from pipeline.layouts import to_padded
from pipeline.tokenize import ByteTokenizer
from schemas import advantages as advantages_schema
from warehouse.rounds import write_round

BYTES = ByteTokenizer()


class SmallVocab(ByteTokenizer):
    """The byte tokenizer, declaring a vocabulary of 300 ids."""

    name = "small"
    vocab_size = 300


def _line(traj_id, ids=(97, 98), lps=(-0.5, -0.25), **assistant):
    msg = {"role": "assistant", "content": "ab", "token_ids": list(ids), "logprobs": list(lps), **assistant}
    return json.dumps(
        {
            "traj_id": traj_id,
            "group_id": "g",
            "reward": 1.0,
            "messages": [{"role": "user", "content": "hi"}, msg],
        }
    )


def _chat(lines, tokenizer=BYTES):
    return ingest("chat-jsonl", [("r.jsonl", "\n".join(lines))], tokenizer=tokenizer)


BAD_CHAT = {
    "negative id": (dict(ids=(-6, 98)), "steps[1].token_ids", "negative"),
    "2^31+5": (dict(ids=(2**31 + 5, 98)), "steps[1].token_ids", "int32"),
    "2^40": (dict(ids=(2**40, 98)), "steps[1].token_ids", "int32"),
    "2^70": (dict(ids=(97, 2**70)), "steps[1].token_ids", "int32"),
    "nan logprob": (dict(lps=(float("nan"), -0.1)), "steps[1].logprobs", "not finite"),
    "-inf logprob": (dict(lps=(-0.1, float("-inf"))), "steps[1].logprobs", "not finite"),
    "positive logprob": (dict(lps=(5.0, -0.1)), "steps[1].logprobs", "> 0"),
    "float32 overflow": (dict(lps=(-1e300, -0.1)), "steps[1].logprobs", "not finite"),
    "huge int logprob": (dict(lps=(-(10**400), -0.1)), "steps[1].logprobs", "not finite"),
    "lengths": (dict(lps=(-0.1,)), "steps[1].logprobs", "logprobs"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_chat_jsonl_bad_token_data_is_quarantined_with_the_field(case):
    kwargs, field, words = BAD_CHAT[case]
    res = _chat([_line("ok"), _line("bad", **kwargs)])
    assert res.trajectories.column("traj_id").to_pylist() == ["ok"]
    row = res.quarantine.to_pylist()[0]
    assert row["record_id"] == "bad" and row["field"] == field and words in row["detail"]
    assert row["reason"] in ("invalid_tokens", "length_mismatch")  # the category alone, no text
    assert res.quarantine.num_rows == 1


def test_tolerance_and_vocabulary():
    tiny = LOGPROB_TOLERANCE / 2
    res = _chat([_line("a", lps=(tiny, 0.0)), _line("b", lps=(2 * LOGPROB_TOLERANCE, 0.0))])
    assert res.trajectories.column("traj_id").to_pylist() == ["a"]
    assert "logprob" in res.quarantine.column("detail")[0].as_py()
    # the vocabulary bound, when the tokenizer knows its size (the byte tokenizer does not: any int32 id)
    lines = [_line("in", ids=(0, 299)), _line("out", ids=(0, 300)), _line("max", ids=(0, 2**31 - 1))]
    res = _chat(lines, tokenizer=SmallVocab())
    assert res.trajectories.column("traj_id").to_pylist() == ["in"]
    reasons = dict(
        zip(res.quarantine["record_id"].to_pylist(), res.quarantine["detail"].to_pylist(), strict=True)
    )
    assert "vocabulary size 300 of tokenizer small" in reasons["out"] and "position 1" in reasons["out"]
    assert _chat(lines).trajectories.num_rows == 3


def _canonical():
    res = _chat([_line("t0"), _line("t1"), _line("t2")])
    assert res.quarantine.num_rows == 0
    return res.trajectories, res.steps


def _with_step_value(steps, traj_id, column, values, value_type):
    rows = steps.to_pylist()
    for r in rows:
        if r["traj_id"] == traj_id and r["role"] == "assistant":
            r[column] = values
    schema = steps.schema.set(steps.schema.get_field_index(column), pa.field(column, pa.list_(value_type)))
    return pa.Table.from_pylist(rows, schema=schema)


PARQUET_CASES = [
    ("token_ids", [-6, 98], pa.int32(), "negative"),
    ("token_ids", [97, 2**40], pa.int64(), "int32"),
    ("token_ids", [2**31 + 5, 98], pa.int64(), "int32"),
    ("token_ids", [97, None], pa.int32(), "null"),
    ("logprobs", [float("nan"), -0.1], pa.float32(), "not finite"),
    ("logprobs", [5.0, -0.1], pa.float64(), "> 0"),
    ("logprobs", [-0.1, float("inf")], pa.float32(), "not finite"),
    ("token_offsets", [0, 7], pa.int32(), "outside the content"),
    ("token_offsets", [-1, 1], pa.int32(), "outside the content"),
]


@pytest.mark.parametrize("column,values,value_type,words", PARQUET_CASES)
def test_parquet_bad_token_data_is_quarantined_with_the_field(column, values, value_type, words):
    traj, steps = _canonical()
    bad = _with_step_value(steps, "t1", column, values, value_type)
    res = ingest("parquet", [("in", {"trajectories": traj, "steps": bad})], tokenizer=BYTES)
    assert res.trajectories.column("traj_id").to_pylist() == ["t0", "t2"]
    assert res.quarantine.num_rows == 1
    row = res.quarantine.to_pylist()[0]
    assert row["record_id"] == "t1" and row["field"] == f"steps[1].{column}", row
    assert words in row["detail"], row["detail"]


def test_parquet_lengths_must_align():
    traj, steps = _canonical()
    for column, values, value_type in (
        ("logprobs", [-0.1], pa.float32()),
        ("token_offsets", [0], pa.int32()),
        ("values", [0.1, 0.2, 0.3], pa.float32()),
    ):
        bad = _with_step_value(steps, "t2", column, values, value_type)
        res = ingest("parquet", [("in", {"trajectories": traj, "steps": bad})], tokenizer=BYTES)
        assert res.trajectories.column("traj_id").to_pylist() == ["t0", "t1"], column
        assert res.quarantine.column("field").to_pylist() == [column]
        assert "length" in res.quarantine.column("reason")[0].as_py()


def _verl(n=4, R=6):
    """A small verl batch: every row 2 prompt tokens, 4 response tokens (3 trained, 1 observation)."""
    responses = np.tile(np.arange(10, 10 + R, dtype=np.int64), (n, 1))
    rmask = np.zeros((n, R), np.int64)
    rmask[:, [0, 1, 3]] = 1
    attn = np.zeros((n, 2 + R), np.int64)
    attn[:, : 2 + 4] = 1
    return {
        "prompts": np.full((n, 2), 7, np.int64),
        "responses": responses,
        "attention_mask": attn,
        "response_mask": rmask,
        "old_log_probs": np.where(rmask == 1, -0.5, 0.0),
        "token_level_scores": np.eye(n, R)[:, ::-1].copy(),
        "uid": np.array([f"u{r // 2}" for r in range(n)]),
    }


def test_verl_batch_never_wraps_ids_and_refuses_bad_logprobs():
    a = _verl(n=6)
    a["responses"][1, 0] = 2**40  # wrapped to 0 by an int32 cast
    a["responses"][2, 1] = 2**31 + 5  # wrapped to a negative id
    a["prompts"][3, 0] = -6
    a["old_log_probs"][4, 3] = np.nan
    a["old_log_probs"][5, 0] = 5.0
    a["responses"][0, 5] = 2**40  # padding (attention 0): not a token of the trajectory, no problem
    res = ingest("verl-batch", [("b.npz", a)], tokenizer=BYTES)
    assert res.trajectories.column("traj_id").to_pylist() == ["b:0"]
    assert res.quarantine["record_id"].to_pylist() == ["b:1", "b:2", "b:3", "b:4", "b:5"]
    fields = sorted(r["field"] for r in res.quarantine.to_pylist())
    assert fields == ["prompts", "responses", "responses", "steps[1].logprobs", "steps[3].logprobs"]
    reasons = " | ".join(res.quarantine.column("detail").to_pylist())
    assert "1099511627776" in reasons and "2147483653" in reasons and "-6" in reasons
    assert res.stats["records_read"] == 6
    ids = res.steps.column("token_ids").to_pylist()
    assert all(0 <= i < TOKEN_ID_LIMIT for step in ids for i in step)


def test_verl_batch_float_ids_are_not_truncated():
    a = _verl()
    a["responses"] = a["responses"].astype(np.float64)
    a["responses"][2, 0] = 10.5
    res = ingest("verl-batch", [("f.npz", a)], tokenizer=BYTES)
    assert sorted(res.trajectories.column("traj_id").to_pylist()) == ["f:0", "f:1", "f:3"]
    assert "10.5" in res.quarantine.column("detail")[0].as_py()
    a["responses"] = a["responses"].astype(str)
    res = ingest("verl-batch", [("s.npz", a)], tokenizer=BYTES)
    assert res.trajectories.num_rows == 0 and res.quarantine.column("field").to_pylist() == ["responses"]


def _advantages(trajectories, steps):
    group = dict(zip(trajectories["traj_id"].to_pylist(), trajectories["group_id"].to_pylist(), strict=True))
    n = len(steps)
    lens = [len(x) for x in steps["token_ids"].to_pylist()]
    table = pa.table(
        {
            "round": pa.array([0] * n, pa.int32()),
            "method": ["m"] * n,
            "traj_id": steps["traj_id"],
            "group_id": [group[t] for t in steps["traj_id"].to_pylist()],
            "step_idx": steps["step_idx"],
            "role": steps["role"],
            "turn": steps["turn"],
            "token_adv": pa.array([[0.5] * k for k in lens], pa.list_(pa.float32())),
        }
    )
    return advantages_schema.SPEC.conform(table)


def test_nothing_bad_reaches_the_verl_export(lake):
    """The red team's records through all three paths and the lake; what is ingested exports clean."""
    chat = _chat([_line("ok"), _line("neg", ids=(-6, 98)), _line("nan", lps=(float("nan"), -0.1))])
    chat_pos = _chat([_line("ok2"), _line("pos", lps=(5.0, -0.1))])
    traj, steps = _canonical()
    parquet = ingest(
        "parquet",
        [
            (
                "in",
                {
                    "trajectories": traj,
                    "steps": _with_step_value(steps, "t1", "logprobs", [5.0, -0.1], pa.float32()),
                },
            )
        ],
        tokenizer=BYTES,
    )
    a = _verl()
    a["responses"][1, 0], a["responses"][2, 1] = 2**40, 2**31 + 5
    verl = ingest("verl-batch", [("b.npz", a)], tokenizer=BYTES)
    assert verl.trajectories.num_rows == 2
    for round_, res in enumerate((chat, chat_pos, parquet, verl)):
        assert res.quarantine.num_rows >= 1
        write_round(lake, round_, res.trajectories, res.steps, 8, res.quarantine)
        trajectories, steps = lake.read("trajectories", round_), lake.read("steps", round_)
        batch = build_train_batch(trajectories, steps, _advantages(trajectories, steps))
        out = to_padded(batch, "verl")
        lp = out["old_log_probs"][out["response_mask"] == 1]
        assert np.isfinite(lp).all() and (lp <= LOGPROB_TOLERANCE).all()
        assert (out["responses"] >= 0).all() and (out["input_ids"] >= 0).all()
        assert (out["input_ids"] < TOKEN_ID_LIMIT).all()


SCALARS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
    st.sampled_from([np.int64(3), np.float64(-0.5), np.float32(1.0), np.bool_(True), [1], {}]),
)


@given(st.lists(SCALARS, max_size=12))
def test_all_instances_is_the_per_token_isinstance_check(values):
    """The whole-list type check of finalize is the per-token rule it replaced: an int / float, never a bool."""
    from pipeline.ingest.core import all_instances

    for kinds in (int, (int, float)):
        assert all_instances(values, kinds) == all(
            isinstance(x, kinds) and not isinstance(x, bool) for x in values
        )
