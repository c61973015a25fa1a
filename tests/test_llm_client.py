"""The shared LLM client against the stand-in server (tests/llm_standin.py): retries, backoff, round-robin,
failover, the on-disk cache, the concurrency bound, structured output, logprobs and batch error isolation."""

from __future__ import annotations

import asyncio
import time

import pytest
from llm_standin import Fail, StandIn, dead_endpoint, default_reply, token_id, token_logprob, tokenize
from pydantic import BaseModel

from flows.config import load_config
from trainer.llm.client import LLMClient, LLMError, LLMRequest, LLMSettings

MSG = [{"role": "user", "content": "what is two plus two"}]


def make(url, tmp_path, **kw) -> LLMClient:
    base = dict(
        endpoints=[url] if isinstance(url, str) else url,
        model="standin-model",
        backoff_s=0.01,
        timeout_s=5.0,
        cache_dir=str(tmp_path / "cache"),
    )
    base.update(kw)
    return LLMClient(LLMSettings(**base))


def run(coro):
    return asyncio.run(coro)


def test_settings_from_config_and_registry(tmp_path):
    cfg = load_config(
        lake=str(tmp_path / "lake"),
        llm={"endpoints": ["localhost:9000"], "concurrency": 4},
        stages={"llm": {"max_retries": 1, "cache_dir": "llmcache"}},
    )
    s = LLMSettings.from_config(cfg)
    assert s.endpoints == ["localhost:9000"] and s.concurrency == 4 and s.max_retries == 1
    assert s.cache_dir == str(tmp_path / "lake" / "llmcache")  # relative cache dir: relative to the lake
    assert cfg.settings(LLMSettings).max_retries == 1
    assert LLMClient(s).endpoints == ["http://localhost:9000/v1"]
    with pytest.raises(Exception):  # noqa: B017 - a typo is an error, not a silent default
        LLMSettings(endpoint=["x"])


def test_chat_deterministic_with_logprobs_and_n(llm_standin, tmp_path):
    client = make(llm_standin.url, tmp_path)
    res = run(client.chat(MSG, n=3, max_tokens=50, logprobs=True, top_logprobs=2, temperature=0.7, seed=1))
    assert len(res.choices) == 3 and not res.cached and res.endpoint == llm_standin.url
    body = {"messages": MSG, "seed": 1}
    for i, ch in enumerate(res.choices):
        want = default_reply(body, "chat", i)
        assert ch.text == want
        toks = tokenize(want)
        assert ch.tokens == toks
        assert ch.token_ids == [token_id(t) for t in toks]
        assert ch.token_logprobs == pytest.approx([token_logprob(token_id(t)) for t in toks])
        assert ch.top_logprobs is not None and len(ch.top_logprobs[0]) == 2
    assert res.usage.completion_tokens == sum(len(c.tokens) for c in res.choices)
    sent = llm_standin.requests[0]
    assert sent["n"] == 3 and sent["logprobs"] is True and sent["top_logprobs"] == 2 and sent["seed"] == 1


def test_retries_on_500_then_succeeds(llm_standin, tmp_path):
    llm_standin.fail_next(2, "500")
    client = make(llm_standin.url, tmp_path, max_retries=3)
    res = run(client.chat(MSG, max_tokens=8))
    assert res.choices[0].text
    assert llm_standin.calls == 3
    assert client.records[-1].attempts == 3 and client.records[-1].error is None


@pytest.mark.parametrize("kind", ["timeout", "malformed", "429", "503", "drop"])
def test_retryable_failures(llm_standin, tmp_path, kind):
    llm_standin.hang_s = 1.0
    llm_standin.fail_next(1, kind)
    client = make(llm_standin.url, tmp_path, timeout_s=0.3, max_retries=2)
    res = run(client.chat(MSG, max_tokens=8))
    assert res.choices[0].text == default_reply({"messages": MSG, "seed": None}, "chat", 0)
    assert llm_standin.calls == 2


def test_gives_up_after_max_retries(llm_standin, tmp_path):
    llm_standin.fail_next(10, "500")
    client = make(llm_standin.url, tmp_path, max_retries=2)
    with pytest.raises(LLMError) as err:
        run(client.chat(MSG, max_tokens=8))
    assert err.value.kind == "server" and err.value.status == 500 and err.value.attempts == 3
    assert llm_standin.calls == 3
    assert client.records[-1].error and client.records[-1].attempts == 3


def test_no_retry_on_4xx(llm_standin, tmp_path):
    llm_standin.fail_next(3, "400")
    client = make(llm_standin.url, tmp_path, max_retries=3)
    with pytest.raises(LLMError) as err:
        run(client.chat(MSG, max_tokens=8))
    assert err.value.kind == "client" and err.value.status == 400
    assert llm_standin.calls == 1


def test_exponential_backoff(llm_standin, tmp_path):
    llm_standin.fail_next(3, "500")
    client = make(llm_standin.url, tmp_path, max_retries=3, backoff_s=0.1)
    run(client.chat(MSG, max_tokens=8))
    t = llm_standin.call_times
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    # delays 0.1, 0.2, 0.4 (plus request time)
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2 and gaps[2] >= 0.4
    assert gaps[2] < 0.4 + 0.5 and gaps[2] > gaps[1] > gaps[0]


def test_retry_after_is_honoured(llm_standin, tmp_path):
    llm_standin.fail_next(1, "429")
    llm_standin.retry_after_s = 1.0
    client = make(llm_standin.url, tmp_path, max_retries=2, backoff_s=0.05)
    res = run(client.chat(MSG, max_tokens=8))
    assert res.choices[0].text and llm_standin.calls == 2
    gap = llm_standin.call_times[1] - llm_standin.call_times[0]
    assert gap >= 1.0  # the server's Retry-After, not the 0.05 s backoff


def test_cache_is_a_diskcache_shared_across_clients(llm_standin, tmp_path):
    import diskcache

    first = make(llm_standin.url, tmp_path)
    run(first.chat(MSG, max_tokens=8))
    assert len(diskcache.Cache(str(tmp_path / "cache"))) == 1
    second = make(llm_standin.url, tmp_path)  # another client (another process would do the same)
    res = run(second.chat(MSG, max_tokens=8))
    assert res.cached and llm_standin.calls == 1


def test_round_robin_over_endpoints(tmp_path):
    with StandIn() as a, StandIn() as b:
        client = make([a.url, b.url], tmp_path, cache=False)
        reqs = [LLMRequest.chat([{"role": "user", "content": f"q{i}"}], max_tokens=4) for i in range(10)]
        out = client.run_batch(reqs)
        assert all(not isinstance(r, LLMError) for r in out)
        assert a.calls == 5 and b.calls == 5
        assert {r.endpoint for r in out} == {a.url, b.url}


def test_failover_on_connection_error(tmp_path):
    dead = dead_endpoint()
    with StandIn() as live:
        client = make([dead, live.url], tmp_path, cache=False, max_retries=0, backoff_s=5.0)
        t0 = time.perf_counter()
        out = client.run_batch(
            [LLMRequest.chat([{"role": "user", "content": f"q{i}"}], max_tokens=4) for i in range(6)]
        )
        assert time.perf_counter() - t0 < 4.0  # failover does not sleep
        assert all(not isinstance(r, LLMError) and r.endpoint == live.url for r in out)
        assert live.calls == 6
        recs = client.records
        assert sorted(r.attempts for r in recs) == [1, 1, 1, 2, 2, 2]  # half started on the dead one


def test_all_endpoints_down_is_connection_error(tmp_path):
    client = make([dead_endpoint(), dead_endpoint()], tmp_path, max_retries=1)
    with pytest.raises(LLMError) as err:
        run(client.chat(MSG, max_tokens=4))
    assert err.value.kind == "connection" and err.value.attempts == 4


def test_cache_hit_on_rerun_makes_zero_calls(llm_standin, tmp_path):
    reqs = [
        LLMRequest.chat([{"role": "user", "content": f"q{i}"}], max_tokens=6, seed=i, purpose="t")
        for i in range(20)
    ]
    first = make(llm_standin.url, tmp_path).run_batch(reqs)
    assert llm_standin.calls == 20 and not any(r.cached for r in first)
    second_client = make(llm_standin.url, tmp_path)  # a new process would see the same files
    second = second_client.run_batch(reqs)
    assert llm_standin.calls == 20  # zero calls the second time
    assert all(r.cached for r in second)
    assert [r.choices[0].text for r in second] == [r.choices[0].text for r in first]
    assert second_client.calls_made == 0
    # different sampling params or seed: a different key
    make(llm_standin.url, tmp_path).run_batch([LLMRequest.chat(reqs[0].messages, max_tokens=6, seed=99)])
    assert llm_standin.calls == 21
    # no leftover temp files: writes are atomic renames
    assert not list((tmp_path / "cache").rglob(".tmp-*"))


def test_identical_requests_in_flight_share_one_call(llm_standin, tmp_path):
    llm_standin.latency_s = 0.2
    client = make(llm_standin.url, tmp_path)
    out = client.run_batch([LLMRequest.chat(MSG, max_tokens=4)] * 8)
    assert llm_standin.calls == 1
    assert len({r.choices[0].text for r in out}) == 1 and sum(not r.cached for r in out) == 1


def test_cache_off(llm_standin, tmp_path):
    client = make(llm_standin.url, tmp_path, cache=False)
    client.run_batch([LLMRequest.chat(MSG, max_tokens=4)])
    client.run_batch([LLMRequest.chat(MSG, max_tokens=4)])
    assert llm_standin.calls == 2


def test_concurrency_bound_respected(llm_standin, tmp_path):
    llm_standin.latency_s = 0.1
    client = make(llm_standin.url, tmp_path, concurrency=4, cache=False)
    t0 = time.perf_counter()
    out = client.run_batch(
        [LLMRequest.chat([{"role": "user", "content": f"q{i}"}], max_tokens=4) for i in range(20)]
    )
    wall = time.perf_counter() - t0
    assert all(not isinstance(r, LLMError) for r in out)
    assert llm_standin.max_inflight == 4  # reached, never exceeded
    assert wall >= 0.5  # 20 requests / 4 at a time * 0.1 s


def test_failed_request_does_not_fail_batch(llm_standin, tmp_path):
    def behaviour(body, kind, i):
        if "poison" in str(body.get("messages")):
            raise Fail("500")
        return default_reply(body, kind, i)

    llm_standin.behaviour = behaviour
    client = make(llm_standin.url, tmp_path, max_retries=1)
    reqs = [
        {"messages": [{"role": "user", "content": c}], "max_tokens": 4, "purpose": "iapo"}
        for c in ["a", "poison", "b", "c"]
    ]
    reqs.append({"prompt": "hello there", "max_tokens": 2})
    reqs.append({"messages": MSG, "max_tokens": 4, "bogus_param": 1})  # a caller bug: TypeError
    out = client.run_batch(reqs)
    assert isinstance(out[1], LLMError) and out[1].kind == "server"
    assert isinstance(out[5], LLMError) and out[5].kind == "client"
    assert all(not isinstance(out[i], LLMError) for i in (0, 2, 3, 4))
    table = client.records_table()
    assert table.num_rows == 5
    assert table.column("error").null_count == 4
    assert set(table.column("purpose").to_pylist()) == {"iapo", None}


def test_records_written_to_lake(llm_standin, tmp_path, lake):
    from warehouse.llm_calls import write_llm_calls

    client = make(llm_standin.url, tmp_path)
    client.run_batch([LLMRequest.chat(MSG, max_tokens=4, purpose="tcpo")] * 2)
    client.run_batch([LLMRequest.chat(MSG, max_tokens=4, purpose="tcpo")])
    write_llm_calls(lake, client, round_=3, part="b0")
    back = lake.read("llm_calls", 3)
    assert back.num_rows == 3
    assert back.column("cached").to_pylist().count(True) == 2
    assert set(back.column("round").to_pylist()) == {3}
    assert client.records == []


class Verdict(BaseModel):
    label: str
    score: int


def test_structured_output_json_schema(llm_standin, tmp_path):
    llm_standin.behaviour = lambda body, kind, i: '{"label": "ok", "score": 3}'
    client = make(llm_standin.url, tmp_path)
    res = run(client.chat(MSG, max_tokens=50, response_format=Verdict))
    assert res.structured == "json_schema"
    assert res.choices[0].parsed == {"label": "ok", "score": 3} and res.choices[0].parse_error is None
    rf = llm_standin.requests[0]["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"]["required"] == ["label", "score"]


def test_structured_output_fallback_when_rejected(llm_standin, tmp_path):
    llm_standin.reject_json_schema = True
    llm_standin.behaviour = lambda body, kind, i: (
        '{"label": "ok", "score": "many"}' if i else '{"label": "ok", "score": 3}'
    )
    client = make(llm_standin.url, tmp_path)
    res = run(client.chat(MSG, n=2, max_tokens=50, response_format=Verdict))
    assert res.structured == "prompted"
    assert res.choices[0].parsed == {"label": "ok", "score": 3}
    assert res.choices[1].parsed is None and res.choices[1].parse_error.startswith("schema")
    assert llm_standin.calls == 2  # the rejected one, then the plain one
    assert "JSON schema" in llm_standin.requests[1]["messages"][0]["content"]
    # the endpoint is remembered: no second rejection
    run(client.chat([{"role": "user", "content": "again"}], max_tokens=50, response_format=Verdict))
    assert llm_standin.calls == 3


def test_structured_output_schema_dict_and_off(llm_standin, tmp_path):
    llm_standin.behaviour = lambda body, kind, i: "not json at all"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client = make(llm_standin.url, tmp_path, structured_output="off")
    res = run(client.chat(MSG, max_tokens=50, response_format=schema))
    assert "response_format" not in llm_standin.requests[0]
    assert res.structured == "prompted" and res.choices[0].parse_error.startswith("not JSON")
    # all choices invalid: not cached, so a re-run asks again
    run(client.chat(MSG, max_tokens=50, response_format=schema))
    assert llm_standin.calls == 2


def test_complete_echo_prompt_logprobs(llm_standin, tmp_path):
    client = make(llm_standin.url, tmp_path)
    ids = [5, 17, 300, 4242]
    res = run(client.complete(ids, echo=True, logprobs=0, max_tokens=0))
    assert res.prompt_token_ids == ids
    assert res.prompt_logprobs[0] is None
    assert res.prompt_logprobs[1:] == pytest.approx([token_logprob(t) for t in ids[1:]])
    res2 = run(client.complete(ids, prompt_logprobs=0, max_tokens=1))
    assert res2.prompt_logprobs[1:] == pytest.approx([token_logprob(t) for t in ids[1:]])


def test_model_discovered_when_not_set(llm_standin, tmp_path):
    client = make(llm_standin.url, tmp_path, model=None)
    res = run(client.chat(MSG, max_tokens=4))
    assert res.model == "standin-model" and llm_standin.requests[0]["model"] == "standin-model"


def test_run_batch_inside_running_loop(llm_standin, tmp_path):
    client = make(llm_standin.url, tmp_path)

    async def inside():
        return client.run_batch([LLMRequest.chat(MSG, max_tokens=4)])

    out = run(inside())
    assert not isinstance(out[0], LLMError)
