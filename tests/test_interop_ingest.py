"""Ingest of the RL frameworks' rollout dumps (rLLM, AReaL, ROLL, TRL, verl batches): exact counts, kept token
ids / logprobs, groups, and the quarantine reason of each bad record."""

import json

import numpy as np
import pyarrow.compute as pc
import pytest

from pipeline.ingest import ingest
from pipeline.tokenize import ByteTokenizer
from tests import interop_samples as S
from warehouse.interop_sources import read_raw_sources
from warehouse.sources import read_text_sources

TOK = ByteTokenizer()


def _text(path, exts):
    return read_text_sources([path], exts)


def _reasons(result):
    return result.quarantined_by_reason()


def _steps_of(result, traj_id):
    s = result.steps.filter(pc.equal(result.steps.column("traj_id"), traj_id)).sort_by("step_idx")
    return s.to_pylist()


def test_rllm_episodes(tmp_path):
    r = ingest("rllm", _text(S.write_rllm(tmp_path), (".jsonl",)), tokenizer=TOK)
    assert r.trajectories.num_rows == 8
    assert r.steps.num_rows == 6 * 5 + 2 * 3
    assert len(set(r.trajectories.column("group_id").to_pylist())) == 4
    assert _reasons(r) == {"length_mismatch": 1, "missing_field": 2, "malformed_json": 1}
    steps = _steps_of(r, "task1:1/solver")
    assert [s["role"] for s in steps] == ["system", "user", "assistant", "user", "assistant"]
    assert steps[2]["token_ids"] == [11, 12, 13] and steps[4]["token_ids"] == [21, 22]
    assert (
        steps[2]["logprobs"] == pytest.approx([-0.1, -0.2, -0.3]) and steps[2]["logprob_source"] == "rollout"
    )
    assert steps[3]["content"] == "feedback 1" and [s["turn"] for s in steps] == [None, None, 1, 1, 2]
    assert steps[4]["verifier_score"] == 1.0
    t = {row["traj_id"]: row for row in r.trajectories.to_pylist()}
    assert t["task1:1/solver"]["reward"] == 2.0 and t["task1:1/solver"]["sample_idx"] == 1
    assert t["task2:0/judge"]["reward"] == 0.5 and t["task2:0/judge"]["group_id"] == "task2:judge"


def test_areal_dump(tmp_path):
    r = ingest("areal", _text(S.write_areal(tmp_path), (".txt",)), tokenizer=TOK)
    assert r.trajectories.num_rows == 8
    assert sorted(set(r.trajectories.column("group_id").to_pylist())) == ["3/q0", "3/q1"]
    assert _reasons(r) == {"non_finite_reward": 1, "malformed_json": 1}
    steps = _steps_of(r, "3/q1:2")
    assert [s["role"] for s in steps] == ["user", "assistant"]
    assert steps[0]["content"].startswith("<|im_start|>user\nWhat is 1 + 2?")
    assert steps[1]["content"] == "The answer is\n3.<|im_end|>"
    row = r.trajectories.filter(pc.equal(r.trajectories.column("traj_id"), "3/q1:2")).to_pylist()[0]
    assert row["reward"] == 0.0 and row["policy_version"] == "3" and json.loads(row["meta"])["seqlen"] == 32
    assert sorted(r.trajectories.column("sample_idx").to_pylist()) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_roll_dump(tmp_path):
    r = ingest("roll", _text(S.write_roll(tmp_path), (".jsonl",)), tokenizer=TOK)
    assert r.trajectories.num_rows == 6 and r.steps.num_rows == 30
    assert sorted(set(r.trajectories.column("group_id").to_pylist())) == ["sokoban-0", "sokoban-1"]
    assert _reasons(r) == {"length_mismatch": 1, "missing_field": 1, "non_finite_reward": 1}
    steps = _steps_of(r, "g1-t2")
    assert [s["verifier_score"] for s in steps if s["role"] == "assistant"] == [0.0, 1.0]
    row = r.trajectories.filter(pc.equal(r.trajectories.column("traj_id"), "g1-t2")).to_pylist()[0]
    assert (
        row["reward"] == 1.0
        and row["policy_version"] == "4"
        and json.loads(row["meta"])["tags"] == "SimpleSokoban"
    )


def test_trl_completions(tmp_path):
    spec_sources = read_raw_sources([S.write_trl(tmp_path)], (".parquet",))
    r = ingest("trl", spec_sources, tokenizer=TOK)
    assert r.trajectories.num_rows == 16 and r.steps.num_rows == 32
    assert len(set(r.trajectories.column("group_id").to_pylist())) == 4  # 2 steps x 2 prompts
    assert _reasons(r) == {"non_finite_reward": 1, "missing_field": 1}
    rows = {row["traj_id"]: row for row in r.trajectories.to_pylist()}
    full, partial = rows["completions_00010:0"], rows["completions_00010:3"]
    assert dict(full["reward_components"]) == {"accuracy_reward": 1.0, "format_reward": 0.5}
    assert full["reward"] == 1.5
    assert dict(partial["reward_components"]) == {"accuracy_reward": 0.0} and partial["reward"] == 0.0
    assert json.loads(partial["meta"])["trl_advantage"] == pytest.approx(0.3)
    assert [s["role"] for s in _steps_of(r, "completions_00020:5")] == ["user", "assistant"]


def test_verl_batch_npz_and_parquet(tmp_path):
    npz, par, a = S.write_verl(tmp_path)
    r = ingest("verl-batch", read_raw_sources([npz, par], (".npz", ".parquet")), tokenizer=TOK)
    assert r.trajectories.num_rows == 6 + 3
    assert r.steps.num_rows == 9 * 4  # prompt, assistant, tool observation, assistant
    assert _reasons(r) == {"non_finite_reward": 1, "invalid_value": 1, "missing_field": 1}
    assert set(r.quarantine.column("stage").to_pylist()) == {"ingest:verl-batch"}
    for b in range(6):
        steps = _steps_of(r, f"batch:{b}")
        assert [s["role"] for s in steps] == ["user", "assistant", "tool", "assistant"]
        assert [s["turn"] for s in steps] == [None, 1, 1, 2]
        real_p = a["prompts"][b][a["attention_mask"][b, :6] == 1]
        assert steps[0]["token_ids"] == real_p.tolist()
        resp = a["responses"][b][a["attention_mask"][b, 6:] == 1]
        assert sum((s["token_ids"] for s in steps[1:]), []) == resp.tolist()
        lp = a["rollout_log_probs"][b][a["response_mask"][b] == 1]
        assert np.allclose(steps[1]["logprobs"] + steps[3]["logprobs"], lp) and steps[2]["logprobs"] is None
        # placeholder text: offsets are the pieces' starts
        s1 = steps[1]
        assert s1["content"] == "".join(f"<{i}>" for i in s1["token_ids"])
        assert [s1["content"][o:].split(">")[0] + ">" for o in s1["token_offsets"]] == [
            f"<{i}>" for i in s1["token_ids"]
        ]
    t = {row["traj_id"]: row for row in r.trajectories.to_pylist()}
    assert t["batch:1"]["reward"] == 1.0 and t["batch:1"]["group_id"] == "prompt-0"
    assert sorted(r.trajectories.column("group_id").to_pylist()).count("prompt-1") == 3 + 3


def test_verl_batch_missing_key_and_decoding(tmp_path):
    a = S.verl_arrays()
    del a["uid"]
    r = ingest("verl-batch", [("x.npz", a)], tokenizer=TOK)
    assert r.trajectories.num_rows == 0 and _reasons(r) == {"missing_field": 1}

    class Decoding(ByteTokenizer):
        def decode(self, ids):
            return "".join(chr(0x41 + i % 26) for i in ids)

    r = ingest("verl-batch", [("y.npz", S.verl_arrays())], tokenizer=Decoding())
    step = _steps_of(r, "y:0")[1]
    assert step["content"] == "".join(chr(0x41 + i % 26) for i in step["token_ids"])
    assert step["token_offsets"] == list(range(len(step["token_ids"])))
