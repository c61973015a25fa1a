"""trainer/policy_server.py: the loop's local policy behind an OpenAI-compatible API, as TCPO's counterfactual
stage calls it (through the project's own LLM client), and the folder it serves for a loop workdir."""

import pytest

from trainer.policy_server import PolicyServer, resolve_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trainer.envs import make_env
    from trainer.tiny import build_tiny_model, word_tokenizer_json

    work = tmp_path_factory.mktemp("loop")
    words = make_env("tcpo_refine").vocabulary()
    tok = word_tokenizer_json(words, work / "tok" / "tokenizer.json")
    build_tiny_model(
        work / "base-tiny", vocab_size=len(words), hidden=16, layers=1, heads=2, tokenizer_json=tok
    )
    return work, words


def test_resolve_model_newest_complete_checkpoint(tiny, tmp_path):
    work, _ = tiny
    assert resolve_model(str(work)) == work / "base-tiny"
    assert resolve_model(str(work / "base-tiny")) == work / "base-tiny"
    (tmp_path / "ckpt-round3").mkdir()  # incomplete: no config / weights
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path))
    assert resolve_model(str(tmp_path), fallback=work / "base-tiny") == work / "base-tiny"


def test_chat_through_the_llm_client(tiny):
    from pipeline.llm.types import LLMRequest, LLMSettings
    from trainer.llm.client import LLMClient

    work, words = tiny
    srv = PolicyServer().start()
    try:
        client = LLMClient(LLMSettings(endpoints=[srv.url], model=str(work), cache=False, max_retries=0))
        req = LLMRequest.chat(
            [{"role": "system", "content": "refine_toy"}, {"role": "user", "content": " refine draft"}],
            n=3,
            temperature=1.0,
            max_tokens=1,
            logprobs=True,
            seed=7,
        )
        (res,) = client.run_batch([req])
        assert len(res.choices) == 3
        for c in res.choices:
            assert c.text in words and len(c.token_logprobs) == 1 and c.token_logprobs[0] <= 0.0
        (again,) = client.run_batch([req])  # seeded: the same alternatives
        assert [c.text for c in again.choices] == [c.text for c in res.choices]
        bad = LLMClient(LLMSettings(endpoints=[srv.url], model="/nonexistent", cache=False, max_retries=0))
        (err,) = bad.run_batch([req])
        assert not getattr(err, "choices", None)  # an LLMError naming the folder, not a hang
    finally:
        srv.stop()
