"""collect: the local backend (tiny model) into a lake, and the vllm backend through the shared LLM client
against the OpenAI-compatible stand-in; both give the same table layout."""

import json

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")

from trainer.collect import CollectSettings, collect, collect_to_lake  # noqa: E402
from trainer.envs.search_qa import questions  # noqa: E402
from trainer.generation import Codec  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trainer.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", vocab_size=256, hidden=16, layers=1, heads=2
    )


def _check_layout(traj: pa.Table, steps: pa.Table, prompts: int, samples: int):
    from schemas.steps import SPEC as STEPS
    from schemas.trajectories import SPEC as TRAJ

    TRAJ.validate(traj)
    STEPS.validate(steps)
    assert traj.num_rows == prompts * samples
    groups = {}
    for r in traj.to_pylist():
        groups.setdefault(r["group_id"], []).append(r["sample_idx"])
    assert len(groups) == prompts and all(sorted(v) == list(range(samples)) for v in groups.values())
    for r in steps.to_pylist():
        if r["role"] == "assistant":
            assert r["turn"] >= 1 and r["logprob_source"] == "rollout"
            assert len(r["logprobs"]) == len(r["token_ids"]) == len(r["token_offsets"])
            assert all(lp <= 0 for lp in r["logprobs"]) and r["verifier_score"] is not None
        else:
            assert r["logprobs"] is None and r["logprob_source"] is None
    by = {}
    for r in steps.to_pylist():
        by.setdefault(r["traj_id"], []).append(r)
    for rows in by.values():
        roles = [r["role"] for r in sorted(rows, key=lambda r: r["step_idx"])]
        assert roles[:3] == ["system", "user", "assistant"]
        assert all(a != b or a != "assistant" for a, b in zip(roles, roles[1:], strict=False))


def test_local_collect_into_lake_logprobs_match_the_model(tiny, lake):
    s = CollectSettings(env="search_qa", prompts=3, samples=2, turns=2, max_new_tokens=12, seed=5)
    res = collect_to_lake(lake, tiny, s, 0, backend="local", batch_groups=2)
    assert res.stats["episodes"] == 6 and res.stats["backend"] == "local"
    traj = lake.read("trajectories", 0)
    steps = lake.read("steps", 0)
    _check_layout(traj, steps, 3, 2)
    assert len(lake.parts("trajectories", 0)) == 2  # aligned parts of whole groups
    meta = json.loads(traj.column("meta")[0].as_py())
    assert meta["env"] == "search_qa" and meta["max_turns"] == 2 and meta["golden_answers"]
    assert meta["sampling"]["temperature"] == 1.0 and meta["backend"] == "local"
    # the behaviour logprobs are the model's logprobs of those tokens given the concatenated steps
    from transformers import AutoModelForCausalLM

    from trainer.losses import token_logprobs_and_entropy

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    one = sorted(
        (r for r in steps.to_pylist() if r["traj_id"] == traj.column("traj_id")[0].as_py()),
        key=lambda r: r["step_idx"],
    )
    ids = torch.tensor([[t for r in one for t in r["token_ids"]]])
    with torch.no_grad():
        logp, _ = token_logprobs_and_entropy(model(input_ids=ids).logits, ids)
    pos, got, want = 0, [], []
    for r in one:
        n = len(r["token_ids"])
        if r["role"] == "assistant":
            got += r["logprobs"]
            want += logp[0, pos : pos + n].tolist()
        pos += n
    assert len(got) > 0 and np.allclose(got, want, atol=1e-4)
    # seeded: the same settings give the same rollouts
    again = collect(tiny, s, 0, backend="local")
    assert again.steps.column("token_ids").to_pylist() == res.steps.column("token_ids").to_pylist()
    other = collect(tiny, s.model_copy(update={"seed": 6}), 0, backend="local")
    assert other.steps.column("token_ids").to_pylist() != res.steps.column("token_ids").to_pylist()


def _standin_behaviour(codec: Codec):
    answers = {q["question"]: q["answers"][0] for q in questions()}

    def behaviour(body, kind, index):
        text = codec.decode(body["prompt"])  # the context arrives as token ids
        question = text.split("Question: ")[1].split("\n")[0]
        if "<information>Doc" not in text:  # (the system prompt names the tag too)
            return "<think> look it up </think> <search> " + question + " </search> ignored tail"
        return "<answer> " + answers[question] + " </answer> more"

    return behaviour


def test_collect_through_the_llm_client_against_the_standin(tiny, lake, llm_standin, tmp_path):
    from llm_standin import token_id, token_logprob

    from pipeline.llm.types import LLMSettings

    llm_standin.behaviour = _standin_behaviour(Codec(tiny))
    s = CollectSettings(env="search_qa", prompts=2, samples=3, turns=3, max_new_tokens=64)
    llm = LLMSettings(
        endpoints=[llm_standin.url], model="policy", cache_dir=str(tmp_path / "c"), concurrency=4
    )
    res = collect_to_lake(lake, tiny, s, 1, backend="vllm", llm_settings=llm)
    traj, steps = lake.read("trajectories", 1), lake.read("steps", 1)
    _check_layout(traj, steps, 2, 3)
    assert res.stats["backend"] == "vllm" and res.stats["errors"] == 0
    assert traj.column("reward").to_pylist() == [1.0] * 6  # search, then the right answer
    assert set(traj.column("source").to_pylist()) == {"collect:vllm"}
    assert len(llm_standin.requests) == 12  # 6 episodes x 2 turns, nothing cached
    asst = [r for r in steps.to_pylist() if r["role"] == "assistant"]
    first = [r for r in asst if r["turn"] == 1]
    # cut at the token that completes the stop string (a stand-in token carries its trailing space)
    assert all(r["content"].rstrip().endswith("</search>") and "ignored" not in r["content"] for r in first)
    assert all(r["verifier_score"] == 0.5 for r in first)  # the gold document was retrieved
    for r in asst:  # the server's token ids and logprobs, cut after the stop string
        pieces = [
            r["content"][a:b]
            for a, b in zip(r["token_offsets"], [*r["token_offsets"][1:], len(r["content"])], strict=True)
        ]
        assert r["token_ids"] == [token_id(p) for p in pieces]
        assert np.allclose(r["logprobs"], [token_logprob(t) for t in r["token_ids"]])
    # the prompt of turn 2 is exactly the concatenated token ids of the steps before it
    tid = traj.column("traj_id")[0].as_py()
    one = sorted((r for r in steps.to_pylist() if r["traj_id"] == tid), key=lambda r: r["step_idx"])
    ctx2 = [t for r in one[:4] for t in r["token_ids"]]
    bodies = [b for b in llm_standin.requests if b["prompt"] == ctx2]
    assert len(bodies) == 3  # the stand-in is deterministic: the group's 3 samples share this context ...
    assert len({b["seed"] for b in bodies}) == 3  # ... but every (trajectory, turn) has its own seed
    b = bodies[0]
    assert b["stop"] == ["</search>", "</answer>"] and b["logprobs"] == 1 and b["return_token_ids"] is True
    assert b["include_stop_str_in_output"] is True
    calls = lake.read("llm_calls", 1)
    assert calls.num_rows == 12 and set(calls.column("purpose").to_pylist()) == {"collect"}
    # identical layout to the local backend
    local = collect(tiny, s, 1, backend="local")
    assert local.steps.schema.equals(res.steps.schema) and local.trajectories.schema.equals(
        res.trajectories.schema
    )


@pytest.mark.sandbox
def test_collect_code_repair_local(tiny):
    s = CollectSettings(env="code_repair", prompts=2, samples=2, max_new_tokens=8)
    res = collect(tiny, s, 3, backend="local")
    _check_layout(res.trajectories, res.steps, 2, 2)
    meta = json.loads(res.trajectories.column("meta")[0].as_py())
    assert meta["tests"] and meta["max_turns"] == 3
    assert set(res.trajectories.column("action_format").to_pylist()) == {"code"}
    # random tokens write no code: every turn keeps the buggy program, whose score is the reward
    assert res.stats["turns"] == 3
