"""chat-jsonl conversion, given token ids / logprobs, and every quarantine reason (the rest still ingested)."""

import json
import math

import pyarrow as pa
import pytest

from pipeline.ingest import ingest
from pipeline.tokenize import ByteTokenizer
from warehouse.tokenizers import get_tokenizer

BYTES = ByteTokenizer()


def _good(traj_id="g1", **extra):
    rec = {
        "traj_id": traj_id,
        "group_id": "q1",
        "reward": 1.0,
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "find x"},
            {
                "role": "assistant",
                "content": "let me look",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q": "x"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "not found", "is_error": True},
            {"role": "assistant", "content": "x is 3", "verifier_score": 0.5},
        ],
    }
    rec.update(extra)
    return rec


def _ingest_lines(lines, tokenizer=BYTES):
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    return ingest("chat-jsonl", [("rollouts.jsonl", text)], round_=1, tokenizer=tokenizer)


def test_chat_jsonl_conversion():
    res = _ingest_lines([_good(), _good("g2", group_id=None, sample_idx=None)])
    assert res.quarantine.num_rows == 0
    steps = res.steps.to_pylist()[:5]
    assert [s["role"] for s in steps] == ["system", "user", "assistant", "tool", "assistant"]
    assert [s["turn"] for s in steps] == [None, None, 1, 1, 2]
    assert steps[2]["tool_calls"] == [{"id": "c1", "name": "lookup", "arguments": '{"q": "x"}'}]
    assert steps[2]["content"].startswith("let me look\n<tool_call>")
    assert steps[3]["tool_call_id"] == "c1" and steps[3]["is_error"]
    assert steps[4]["verifier_score"] == 0.5 and steps[4]["logprobs"] is None
    assert all(s["token_ids"] == list(s["content"].encode()) for s in steps)
    trajs = res.trajectories.to_pylist()
    assert json.loads(trajs[0]["meta"])["tools"][0]["function"]["name"] == "lookup"
    assert trajs[1]["group_id"].startswith("p")  # no group_id: hash of the prompt
    assert trajs[0]["sample_idx"] == 0 and trajs[1]["sample_idx"] == 0


def test_default_sample_idx_and_group_from_prompt():
    base = {
        "reward": 0.0,
        "messages": [{"role": "user", "content": "same prompt"}, {"role": "assistant", "content": "a"}],
    }
    res = _ingest_lines([base, base, {**base, "sample_idx": 0}])
    t = res.trajectories.to_pylist()
    assert len({r["group_id"] for r in t}) == 1
    assert sorted(r["sample_idx"] for r in t) == [0, 1, 2]
    assert [r["traj_id"] for r in t] == ["rollouts:L1", "rollouts:L2", "rollouts:L3"]


def test_given_token_ids_and_logprobs_kept():
    tok = get_tokenizer(None)
    if not hasattr(tok, "decode"):
        pytest.skip("SmolLM2 tokenizer not available")
    content = "héllo wörld, 3 + 4 = 7"
    ids = tok.encode_batch([content])[0][0]
    odd = list(reversed(ids))  # ids of another tokenization of the same text: kept, offsets approximate
    rec = {
        "traj_id": "t",
        "reward": 1.0,
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": content, "token_ids": ids, "logprobs": [-0.5] * len(ids)},
            {"role": "user", "content": "again"},
            {
                "role": "assistant",
                "content": content,
                "token_ids": odd,
                "logprobs": {"content": [{"token": "?", "logprob": -1.0}] * len(odd)},
            },
        ],
    }
    res = _ingest_lines([rec], tokenizer=tok)
    assert res.quarantine.num_rows == 0
    steps = res.steps.to_pylist()
    exact = tok.encode_batch([content])[1][0]
    assert steps[1]["token_ids"] == ids and steps[1]["token_offsets"] == exact
    assert steps[1]["logprobs"] == [-0.5] * len(ids) and steps[1]["logprob_source"] == "rollout"
    assert steps[3]["token_ids"] == odd and steps[3]["logprobs"] == [-1.0] * len(odd)
    assert len(steps[3]["token_offsets"]) == len(odd)
    assert res.stats["offsets_approximate"] == 1
    assert steps[0]["logprob_source"] is None


def test_offsets_by_decoding_multibyte():
    from pipeline.ingest.core import offsets_by_decoding

    tok = get_tokenizer(None)
    if not hasattr(tok, "decode"):
        pytest.skip("SmolLM2 tokenizer not available")
    content = "日本語 text ✓ ok"
    ids, offs = tok.encode_batch([content])
    assert offsets_by_decoding(tok.decode, ids[0], content) == offs[0]
    assert offsets_by_decoding(tok.decode, ids[0], content + "!") is None


BAD = {
    "malformed_json": '{"traj_id": "m", "reward": 1.0, "messages": [',
    "missing_field": {"traj_id": "nomsg", "reward": 1.0},
    "length_mismatch": {
        "traj_id": "len",
        "reward": 1.0,
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2]},
        ],
    },
    "non_finite_reward": '{"traj_id": "nan", "reward": NaN, "messages": [{"role": "user", "content": "q"}]}',
    "duplicate_traj_id": _good("g1"),
    "unknown_role": {"traj_id": "role", "reward": 0.0, "messages": [{"role": "narrator", "content": "once"}]},
    "unmatched_tool_result": {
        "traj_id": "orphan",
        "reward": 0.0,
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "tool_call_id": "nope", "content": "result"},
        ],
    },
}


@pytest.mark.parametrize("reason", sorted(BAD))
def test_each_quarantine_reason(reason):
    bad = BAD[reason]
    res = _ingest_lines([_good("g1"), bad, _good("g3")])
    assert res.trajectories["traj_id"].to_pylist() == ["g1", "g3"]
    assert set(res.steps["traj_id"].to_pylist()) == {"g1", "g3"}
    q = res.quarantine.to_pylist()
    assert len(q) == 1
    assert q[0]["reason"].split(":")[0] == reason
    assert q[0]["location"] == "line 2" and q[0]["source_file"] == "rollouts.jsonl"
    assert q[0]["raw"] == (bad if isinstance(bad, str) else json.dumps(bad))  # verbatim
    assert q[0]["stage"] == "ingest:chat-jsonl" and q[0]["round"] == 1
    assert res.quarantined_by_reason() == {reason: 1}


def test_quarantine_fields():
    res = _ingest_lines([BAD["missing_field"], BAD["length_mismatch"], BAD["unknown_role"]])
    by_id = {q["record_id"]: q for q in res.quarantine.to_pylist()}
    assert by_id["nomsg"]["field"] == "messages"
    assert by_id["len"]["field"] == "steps[1].logprobs"
    assert by_id["role"]["field"] == "messages[0].role"


def test_logprobs_without_token_ids_must_match_tokenizer():
    ok = {
        "traj_id": "ok",
        "reward": 1.0,
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "abc", "logprobs": [-1.0, -1.0, -1.0]},
        ],
    }
    bad = {
        "traj_id": "bad",
        "reward": 1.0,
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "abc", "logprobs": [-1.0]},
        ],
    }
    res = _ingest_lines([ok, bad])
    assert res.trajectories["traj_id"].to_pylist() == ["ok"]
    assert res.steps.to_pylist()[1]["logprobs"] == [-1.0] * 3
    assert res.quarantined_by_reason() == {"length_mismatch": 1}


def test_malformed_json_list_keeps_the_good_prefix():
    good = {
        "task_id": 1,
        "trial": 0,
        "reward": 1.0,
        "info": {},
        "traj": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    }
    text = "[" + json.dumps(good) + ', {"task_id": 2, "trial": 0, "reward": nope}]'
    res = ingest("tau-bench", [("t.json", text)], tokenizer=BYTES)
    assert res.trajectories.num_rows == 1
    q = res.quarantine.to_pylist()
    assert q[0]["reason"].startswith("malformed_json") and q[0]["location"] == "[1:]"
    assert q[0]["raw"].startswith('{"task_id": 2')


def test_nan_reward_in_react_and_missing_fields_in_ldb():
    res = ingest(
        "react",
        [("r.json", '{"a": {"em": true, "traj": "Q\\nThought: t"}, "b": {"traj": "x"}}')],
        tokenizer=BYTES,
    )
    assert res.trajectories.num_rows == 1 and res.quarantined_by_reason() == {"missing_field": 1}
    line = json.dumps(
        {
            "task_id": "H/1",
            "prompt": "p",
            "implementations": ["a", "b"],
            "test_feedback": [[]],
            "given_tests": ["assert f()"],
            "is_solved": True,
        }
    )
    res = ingest("ldb", [("l.jsonl", line)], tokenizer=BYTES)
    assert res.quarantined_by_reason() == {"length_mismatch": 1}


def _canonical(tmp_traj=None):
    res = _ingest_lines([_good("g1"), _good("g2")])
    return res.trajectories, res.steps


def test_parquet_roundtrip_and_bad_rows():
    traj, steps = _canonical()
    res = ingest("parquet", [("in", {"trajectories": traj, "steps": steps})], round_=5, tokenizer=BYTES)
    assert res.quarantine.num_rows == 0 and res.trajectories.num_rows == 2
    assert res.steps.num_rows == steps.num_rows and set(res.steps["round"].to_pylist()) == {5}

    rows = traj.to_pylist()
    rows[1]["reward"] = math.nan
    bad_traj = pa.Table.from_pylist(rows, schema=traj.schema)
    no_tokens = steps.drop(["token_ids", "token_offsets"])
    res = ingest("parquet", [("in", {"trajectories": bad_traj, "steps": no_tokens})], tokenizer=BYTES)
    assert res.trajectories["traj_id"].to_pylist() == ["g1"]
    assert res.quarantined_by_reason() == {"non_finite_reward": 1}
    assert json.loads(res.quarantine["raw"][0].as_py())["trajectory"]["traj_id"] == "g2"
    assert res.steps.to_pylist()[0]["token_ids"] == list(b"sys")  # tokenized where ids were missing

    srows = steps.to_pylist()
    srows[0]["role"] = "narrator"
    res = ingest(
        "parquet",
        [
            ("a", {"trajectories": traj, "steps": pa.Table.from_pylist(srows, schema=steps.schema)}),
            ("b", {"trajectories": traj.slice(1), "steps": steps.slice(5)}),
        ],
        tokenizer=BYTES,
    )
    assert res.quarantined_by_reason() == {"unknown_role": 1, "duplicate_traj_id": 1}
    assert res.trajectories["traj_id"].to_pylist() == ["g2"]


def test_given_ids_of_another_split_get_offsets_by_decoding():
    tok = get_tokenizer(None)
    if not hasattr(tok, "decode"):
        pytest.skip("SmolLM2 tokenizer not available")
    content = "abc déf"
    per_char = [i for ch in content for i in tok.encode_batch([ch])[0][0]]  # decodes to content, other split
    assert per_char != tok.encode_batch([content])[0][0]
    rec = {
        "traj_id": "t",
        "reward": 0.0,
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": content, "token_ids": per_char},
        ],
    }
    res = _ingest_lines([rec], tokenizer=tok)
    step = res.steps.to_pylist()[1]
    assert step["token_ids"] == per_char
    assert "offsets_approximate" not in res.stats
    starts = step["token_offsets"]
    assert [content[o] for o in starts][:3] == ["a", "b", "c"] and sorted(starts) == starts


def test_a_new_adapter_is_one_decorated_function():
    from pipeline.ingest import ADAPTERS, StepDraft, TrajectoryDraft, adapter
    from pipeline.ingest.core import read_jsonl

    @adapter("test-lines", reader=read_jsonl, action_format="chat")
    def test_lines(record):
        d = record.data
        return TrajectoryDraft(
            traj_id=d["id"],
            group_id="g",
            reward=d["r"],
            steps=[StepDraft("user", "q"), StepDraft("assistant", d["a"])],
        )

    try:
        res = ingest(
            "test-lines",
            [("x.jsonl", '{"id": "1", "r": 1, "a": "yes"}\n{"id": "2", "r": 0}')],
            tokenizer=BYTES,
        )
        assert res.trajectories["action_format"].to_pylist() == ["chat"]
        assert res.steps["turn"].to_pylist() == [None, 1]
        assert res.quarantined_by_reason() == {"adapter_error": 1}  # an adapter bug: kept, with its reason
    finally:
        ADAPTERS.pop("test-lines", None)
