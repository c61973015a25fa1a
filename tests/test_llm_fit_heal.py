"""Issue 37 against the local stand-in (tests/llm_standin.py): requests are counted before they are sent and a
request too long for the context is not sent; the IAPO annotator labels a trajectory longer than the context in
overlapping windows and merges them; a dead managed server is restarted and the failed requests sent again;
a stage whose requests fail beyond flow.max_failed_share fails `process` with one line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from flows.batch import stage_io
from pipeline.config import Config
from pipeline.llm.types import LLMError, LLMRequest
from pipeline.stages import StageIO, execute, failure_cause
from trainer.llm import service, supervisor
from trainer.llm.client import LLMClient, LLMSettings


def _client(url, tmp_path, **kw):
    return LLMClient(
        LLMSettings(endpoints=[url], cache_dir=str(tmp_path / "cache"), backoff_s=0.0, **kw), healer=None
    )


# ---- requests that fit ------------------------------------------------------------------------------------


def test_a_request_too_long_for_the_context_is_counted_and_not_sent(llm_standin, tmp_path):
    llm_standin.max_model_len = 40
    client = _client(llm_standin.url, tmp_path)
    short = LLMRequest.chat([{"role": "user", "content": "two words"}], max_tokens=8)
    long_ = LLMRequest.chat([{"role": "user", "content": "word " * 30}], max_tokens=16)
    fits_alone = LLMRequest.chat([{"role": "user", "content": "word " * 30}], max_tokens=4)
    ok, too_long, ok2 = client.run_batch([short, long_, fits_alone])
    assert not isinstance(ok, LLMError) and not isinstance(ok2, LLMError)
    assert isinstance(too_long, LLMError) and too_long.kind == "too_long" and not too_long.retryable
    # the prompt is the stand-in's own count ("<user>word " + 29 words), the context what /tokenize reported
    assert too_long.prompt_tokens == 30 and too_long.context == 40, str(too_long)
    assert llm_standin.calls == 2  # the long one never reached /v1/chat/completions
    assert llm_standin.tokenize_calls == 3
    rec = [r for r in client.records if r.error]
    assert len(rec) == 1 and rec[0].error.startswith("too_long")
    # a configured context wins over the server's
    tight = _client(llm_standin.url, tmp_path, context_tokens=20, cache=False)
    (res,) = tight.run_batch([fits_alone])
    assert isinstance(res, LLMError) and res.kind == "too_long" and res.context == 20


def test_without_counting_the_server_answers_400(llm_standin, tmp_path):
    """The check is what prevents the 400: with count_tokens off the same request reaches the server, whose
    refusal ("maximum context length is 20 tokens ... your request has 30 input tokens") becomes a too_long
    error with the server's figures; it is no sign that the server lacks constrained decoding."""
    llm_standin.max_model_len = 20
    client = _client(llm_standin.url, tmp_path, count_tokens=False)
    long_ = [{"role": "user", "content": "word " * 30}]
    (res,) = client.run_batch([LLMRequest.chat(long_, max_tokens=4, response_format={"type": "json_object"})])
    assert isinstance(res, LLMError) and res.status == 400 and "maximum context length" in res.message
    assert res.kind == "too_long" and (res.prompt_tokens, res.context) == (30, 20) and not res.retryable
    assert llm_standin.tokenize_calls == 0 and llm_standin.calls == 1
    llm_standin.behaviour = lambda body, kind, i: "{}"
    (ok,) = client.run_batch(
        [
            LLMRequest.chat(
                [{"role": "user", "content": "hi"}], max_tokens=4, response_format={"type": "json_object"}
            )
        ]
    )
    assert not isinstance(ok, LLMError) and llm_standin.requests[-1]["response_format"] == {
        "type": "json_object"
    }


@pytest.mark.parametrize(
    ("message", "prompt", "context"),
    [
        # vLLM 0.32 (serving engine's _validate_input) and OpenAI's wording
        (
            "This model's maximum context length is 8192 tokens. However, your request has 9001 input tokens. "
            "Please reduce the length of the input messages.",
            9001,
            8192,
        ),
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 2048. This model's maximum context length is "
            "8192 tokens and your request has 7000 input tokens (2048 > 8192 - 7000).",
            7000,
            8192,
        ),
        (
            "This model's maximum context length is 4097 tokens. However, you requested 5000 tokens (4500 in the "
            "messages, 500 in the completion). Please reduce the length of the messages or completion.",
            4500,
            4097,
        ),
        ("This model's maximum context length is 2048 tokens.", 2048, 2048),  # no count: the whole context
    ],
)
def test_a_servers_context_refusal_is_read_as_too_long(message, prompt, context):
    from trainer.llm.responses import context_exceeded

    class Refusal(Exception):
        def __init__(self, message):
            super().__init__(message)
            self.message = message

    err = context_exceeded(Refusal(message))
    assert (
        err is not None and err.kind == "too_long" and (err.prompt_tokens, err.context) == (prompt, context)
    )
    assert context_exceeded(Refusal("Error code: 400 - unknown field 'foo'")) is None


def test_an_endpoint_without_tokenize_is_asked_once(llm_standin, tmp_path):
    client = _client(llm_standin.url, tmp_path, cache=False)
    reqs = [LLMRequest.chat([{"role": "user", "content": f"q{i}"}], max_tokens=4) for i in range(3)]
    assert not any(isinstance(r, LLMError) for r in client.run_batch(reqs))
    first = llm_standin.tokenize_calls  # the batch's requests asked at once, before the first 404 came back
    assert not any(isinstance(r, LLMError) for r in client.run_batch(reqs))
    assert 1 <= first <= 3 and llm_standin.tokenize_calls == first and llm_standin.calls == 6


def test_too_long_errors_survive_pickling():
    import pickle

    err = LLMError.too_long(9000, 2048, 8192)
    back = pickle.loads(pickle.dumps(err))
    assert (back.kind, back.prompt_tokens, back.context) == ("too_long", 9000, 8192)
    assert failure_cause(back).startswith("too_long")


# ---- the annotator on a trajectory longer than the context -------------------------------------------------


def _tau_steps(real_data, longest=False):
    from pipeline.ingest import ingest

    records = json.loads((real_data / "tau_bench_v1" / "gpt-4o-airline.json").read_text())
    chosen = sorted(records, key=lambda r: len(json.dumps(r["traj"])))[-1 if longest else 0 :][:1]
    res = ingest("tau-bench", [("tau.json", json.dumps(chosen))], round_=0)
    return res.trajectories, res.steps


def _excerpt_ids(body) -> list[str]:
    text = body["messages"][1]["content"]
    block = text.split("<transcript>\n", 1)[1].split("\n</transcript>", 1)[0]
    return [item["id"] for item in json.loads(block)]


def chain_answer(body, kind, index):
    """Each action of the excerpt cites the action before it in the excerpt; the excerpt's LAST action is
    marked an error. Merged by centrality only the trajectory's last action is an error (a union of the
    windows would mark the last action of every window)."""
    actions = [int(i.split(":")[1]) for i in _excerpt_ids(body) if i.startswith("action:")]
    out = []
    for k, j in enumerate(actions):
        sources = (
            [] if k == 0 else [{"source": f"action:{actions[k - 1]}", "type": "input", "info_unit": "v"}]
        )
        last = k == len(actions) - 1
        out.append(
            {
                "action_id": j,
                "error": int(last),
                "error_kind": "tool" if last else "none",
                "sources": [{**s, "binding": "b"} for s in sources],
            }
        )
    return json.dumps({"actions": out}, separators=(",", ":"))  # one stand-in token: within max_tokens


def _annotate(url, tmp_path, steps, **annotate_llm):
    from pipeline.annotate.llm import annotate_llm as run

    cfg = Config(
        llm={"endpoints": [url], "cache_dir": str(tmp_path / "llm-cache"), "backoff_s": 0.0},
        stages={"annotate_llm": {"max_tokens": 64, **annotate_llm}},
    )
    return run(steps, cfg, io=stage_io(cfg))


def _longest_and_its_size(real_data):
    """The longest shipped tau-bench trajectory's steps, its transcript index, and the stand-in's token counts
    of its whole request and of the request's fixed part (instructions without a transcript)."""
    from llm_standin import StandIn

    from pipeline.annotate.llm import _split_trajectories
    from pipeline.annotate.llm_prompt import build_messages, build_transcript
    from pipeline.annotate.settings import LLMAnnotatorSettings

    _, steps = _tau_steps(real_data, longest=True)
    ((_, rows),) = _split_trajectories(steps)
    items, idx = build_transcript(rows, LLMAnnotatorSettings())
    whole = len(StandIn._prompt_tokens({"messages": build_messages(items)}, "chat")[1])
    fixed = len(StandIn._prompt_tokens({"messages": build_messages([])}, "chat")[1])
    return steps, idx, whole, fixed


def test_a_trajectory_longer_than_the_context_is_labelled_in_merged_windows(llm_standin, real_data, tmp_path):
    from llm_standin import StandIn

    steps, idx, whole, fixed = _longest_and_its_size(real_data)
    llm_standin.behaviour = chain_answer
    # the instructions and a quarter of the transcript fit (with the answer budget): several windows
    llm_standin.max_model_len = fixed + (whole - fixed) // 4 + 64

    out = _annotate(llm_standin.url, tmp_path, steps)
    nodes, edges = out.tables["nodes"], out.tables["edges"]
    actions = sorted(idx.actions)
    assert out.notes["windows"] >= 2 and out.notes["trajectories_windowed"] == 1, out.notes
    assert not any(nodes.column("parse_failed").to_pylist())
    assert out.notes["llm_requests_failed"] == 0 and not out.warnings, (out.notes, out.warnings)
    # every request that reached the server fit: prompt + answer budget <= context
    for body in llm_standin.requests:
        n_prompt = len(StandIn._prompt_tokens(body, "chat")[1])
        assert n_prompt + body["max_tokens"] <= llm_standin.max_model_len
    # the windows overlap and together hold every action
    seen = [set(_excerpt_ids(b)) for b in llm_standin.requests]
    assert set().union(*seen) >= {f"action:{t}" for t in actions}
    assert any(a & b for a, b in zip(seen, seen[1:], strict=False))
    # merged by centrality: one error (the trajectory's last action), edges only from the action before
    errors = {r["turn"] for r in nodes.to_pylist() if r["error"]}
    assert errors == {actions[-1]}, errors
    pairs = [(e["src_turn"], e["dst_turn"]) for e in edges.to_pylist()]
    assert len(pairs) == len(set(pairs))
    before = {b: a for a, b in zip(actions, actions[1:], strict=False)}
    assert all(before[j] == i for i, j in pairs), pairs
    assert len(pairs) >= len(actions) - 1 - (out.notes["windows"] - 1)


def test_an_endpoint_that_only_refuses_gets_windows_too(llm_standin, real_data, tmp_path):
    """An OpenAI-compatible server without vLLM's /tokenize: nothing is counted before sending, the server
    refuses the whole trajectory (HTTP 400 "maximum context length"), and the annotator splits it into
    windows from the figures of that refusal, as it does for a request the client counted."""
    from llm_standin import StandIn

    steps, idx, whole, fixed = _longest_and_its_size(real_data)
    llm_standin.behaviour = chain_answer
    llm_standin.tokenize_route = False
    llm_standin.max_model_len = fixed + (whole - fixed) // 3 + 64

    out = _annotate(llm_standin.url, tmp_path, steps)
    assert out.notes["windows"] >= 2 and out.notes["trajectories_windowed"] == 1, out.notes
    assert not any(out.tables["nodes"].column("parse_failed").to_pylist())
    assert out.notes["llm_requests_failed"] == 0 and not out.warnings, (out.notes, out.warnings)
    sizes = [len(StandIn._prompt_tokens(b, "chat")[1]) for b in llm_standin.requests]
    refused = [n for n in sizes if n + 1 > llm_standin.max_model_len]
    assert sizes[0] == whole and refused[0] == whole  # the whole trajectory was sent once and refused
    assert len(sizes) - len(refused) == out.notes["windows"]  # every window was answered
    assert {r["turn"] for r in out.tables["nodes"].to_pylist() if r["error"]} == {max(idx.actions)}


def test_what_fits_whole_is_one_request(llm_standin, real_data, tmp_path):
    _, steps = _tau_steps(real_data)
    llm_standin.behaviour = chain_answer
    llm_standin.max_model_len = 100_000
    out = _annotate(llm_standin.url, tmp_path, steps)
    assert "windows" not in out.notes and llm_standin.calls == 1
    assert out.notes["llm_requests_total"] == 1 and out.notes["llm_requests_failed"] == 0


def test_a_message_longer_than_the_context_is_recorded_too_long(llm_standin, real_data, tmp_path):
    _, steps = _tau_steps(real_data)
    llm_standin.behaviour = chain_answer
    llm_standin.max_model_len = 120  # not even the system prompt and one message
    out = _annotate(llm_standin.url, tmp_path, steps)
    assert llm_standin.calls == 0  # nothing was sent
    assert all(out.tables["nodes"].column("parse_failed").to_pylist())  # uniform weights
    assert out.notes["llm_too_long"] == 1 and out.notes["llm_requests_failed"] == 1
    assert [c for c in out.failures] == ["too_long: prompt + answer budget exceed the context (not sent)"]
    assert any("too long" in w and "not sent" in w for w in out.warnings), out.warnings


# ---- a service that heals -----------------------------------------------------------------------------------


class FakeSupervisor:
    """What the client needs of trainer.llm.supervisor.Supervisor: `url`, `generation`, `heal(seen)`."""

    def __init__(self, standin, restarts: int = 1):
        import threading

        self.standin, self.url, self.generation, self.left, self.calls = standin, standin.url, 0, restarts, 0
        self.lock = threading.Lock()

    def heal(self, seen=None):
        with self.lock:
            return self._heal(seen)

    def _heal(self, seen):
        self.calls += 1
        if seen is not None and seen < self.generation:
            return True
        if not self.standin.down:
            return True
        if self.left == 0:
            return False
        time.sleep(0.2)  # a restart takes a while: requests failing meanwhile wait for it
        self.left -= 1
        self.standin.down = False
        self.generation += 1
        return True


def test_a_dead_server_is_restarted_once_and_the_failed_requests_sent_again(llm_standin, tmp_path):
    llm_standin.down = True
    sup = FakeSupervisor(llm_standin)
    client = LLMClient(
        LLMSettings(endpoints=[llm_standin.url], cache_dir=str(tmp_path / "c"), max_retries=0), healer=sup
    )
    reqs = [LLMRequest.chat([{"role": "user", "content": f"q{i}"}], max_tokens=4) for i in range(6)]
    results = client.run_batch(reqs)
    assert not any(isinstance(r, LLMError) for r in results), results
    assert sup.generation == 1  # one restart shared by every request that failed
    assert client.restarts == 1
    # nothing from the dead server was cached: the cache holds six answers, each from the live server
    again = client.run_batch(reqs)
    assert all(r.cached for r in again) and [r.choices[0].text for r in again] == [
        r.choices[0].text for r in results
    ]


def test_restarts_are_bounded(llm_standin, tmp_path):
    llm_standin.down = True
    sup = FakeSupervisor(llm_standin, restarts=0)
    client = LLMClient(
        LLMSettings(
            endpoints=[llm_standin.url], model="standin-model", cache_dir=str(tmp_path / "c"), max_retries=1
        ),
        healer=sup,
    )
    (res,) = client.run_batch([LLMRequest.chat([{"role": "user", "content": "q"}], max_tokens=4)])
    assert isinstance(res, LLMError) and res.kind == "server" and sup.generation == 0
    assert not client._responses.get(res.request_hash)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def _info(tmp_path, pid: int, **kw) -> service.ServiceInfo:
    """A recorded server at port 9 (nothing listens there) of the given pid."""
    base = {"url": "http://127.0.0.1:9/v1", "host": "127.0.0.1", "port": 9, "model": "m", "model_dir": "/m"}
    return service.ServiceInfo(
        **{**base, **kw}, pid=pid, venv="/venv", log=str(tmp_path / "vllm.log"), started_at=0.0
    )


def test_supervisor_restarts_a_dead_server_with_its_arguments(monkeypatch, tmp_path):
    """Supervisor.heal with `serve` and `/health` stubbed: the process group of the dead server is stopped, the
    new one gets the old arguments and port, concurrent callers share a restart, restarts are bounded and
    each is one logged line."""
    old = _sleeper()
    info = _info(tmp_path, old.pid, model_dir="/models/m", max_model_len=8192, extra_args=["--seed", "1"])
    started: list[dict] = []
    procs: list[subprocess.Popen] = [old]
    healthy_pids: set[int] = set()

    def fake_serve(model, **kw):
        started.append({"model": str(model), **kw})
        p = _sleeper()
        procs.append(p)
        healthy_pids.add(p.pid)
        return service.ServiceInfo(**{**info.__dict__, "pid": p.pid, "log": info.log, "started_at": 1.0})

    monkeypatch.setattr(service, "serve", fake_serve)
    monkeypatch.setattr(service, "healthy", lambda url, timeout=2.0: sup.info.pid in healthy_pids)
    lines: list[str] = []
    sup = supervisor.Supervisor(info, max_restarts=1, log=lines.append, health_pause_s=0.0)
    try:
        assert not sup.alive()  # unhealthy (alive but /health fails): restarted too
        assert sup.heal(0) is True and sup.generation == 1
        assert old.wait(timeout=20) is not None  # the old group was stopped
        assert started == [
            {
                "model": "/models/m",
                "port": 9,
                "host": "127.0.0.1",
                "venv": service.Path("/venv"),
                "served_name": "m",
                "max_model_len": 8192,
                "extra_args": ["--seed", "1"],
                "wait_s": 600.0,
                "log": started[0]["log"],
                "record": False,
            }
        ]
        assert info.pid == procs[1].pid and info.restarts == 1
        assert sup.heal(0) is True and len(started) == 1  # a caller that saw generation 0: no second restart
        assert sup.heal(1) is True and len(started) == 1  # healthy: nothing to do
        healthy_pids.clear()
        procs[1].kill()
        procs[1].wait()
        assert sup.heal(1) is False and len(started) == 1  # bounded: max_restarts = 1
        assert len(lines) == 2 and "restarted as pid" in lines[0] and "not restarted" in lines[1]
        assert "restarted as pid" in (tmp_path / "vllm.log").read_text()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_cpu_service_serves_the_models_context_without_chunked_prefill(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert service.model_context(tmp_path) == 8192
    assert service.model_context(tmp_path / "absent") is None
    cpu = service.serve_command(service.Path("py"), tmp_path, "m", "h", 1, 8192, [], gpu=False)
    assert cpu[cpu.index("--max-model-len") + 1] == "8192"
    assert "--no-enable-chunked-prefill" in cpu and cpu[cpu.index("--max-num-batched-tokens") + 1] == "8192"
    gpu = service.serve_command(service.Path("py"), tmp_path, "m", "h", 1, 8192, [], gpu=True)
    assert "--no-enable-chunked-prefill" not in gpu
    mine = service.serve_command(
        service.Path("py"), tmp_path, "m", "h", 1, 4096, ["--enable-chunked-prefill"], gpu=False
    )
    assert "--no-enable-chunked-prefill" not in mine  # the user's choice stands
    so = json.loads(cpu[cpu.index("--structured-outputs-config") + 1])
    # JSON answers without free whitespace
    assert so == {"backend": "xgrammar", "disable_any_whitespace": True}


# ---- degradation is loud --------------------------------------------------------------------------------------


def test_execute_counts_failed_requests_by_cause(llm_standin, tmp_path):
    from tcpo_data import make_batch

    from pipeline.counterfactual import counterfactual

    traj, steps = make_batch(
        [[[0.0, 1.0], [0.0, 0.0]]],
        logprobs=[[[-2.0, -0.1], [-1.0, -3.0]]],
        meta={"verifier": "em", "golden_answers": ["Paris"]},
    )
    cfg = Config(
        methods=["tcpo"],
        llm={"endpoints": [llm_standin.url], "cache_dir": str(tmp_path / "c"), "max_retries": 0},
        stages={"tcpo": {"M": 2, "L": 2}},
    )
    llm_standin.fail_next(100, "400")
    io = stage_io(cfg)
    out = execute(counterfactual(traj, steps, cfg, {}, io=io), io)
    total = out.notes["llm_requests_total"]
    assert total >= 1 and out.notes["llm_requests_failed"] == total
    (cause,) = out.failures
    assert cause.startswith("client: HTTP 400") and out.failures[cause] == total


def test_over_failure_share_names_stage_count_and_cause():
    from flows.run import over_failure_share
    from flows.summary import fallback_lines

    summary = {
        "this_run": {
            "detect": {"batches": 1},
            "annotate": {"llm_requests": 20, "llm_failed": 20, "failures": {"client: HTTP 400: too big": 20}},
            "counterfactual": {"llm_requests": 20, "llm_failed": 2, "failures": {"timeout: x": 2}},
        },
        "warnings": [
            "annotate: b0: iapo llm annotator: 20 request(s) failed",
            "annotate: b1: iapo llm annotator: 20 request(s) failed",
        ],
    }
    assert over_failure_share(summary, 0.1) == [
        "stage annotate degraded: 20 of 20 LLM requests failed (client: HTTP 400: too big), over "
        "flow.max_failed_share 10%"
    ]
    assert len(over_failure_share(summary, 0.05)) == 2  # 2 of 20 = 10% > 5%
    lines = fallback_lines(summary)
    assert lines[0].startswith("annotate: 20 of 20 LLM requests failed (100%)")
    assert lines[-1] == "annotate: iapo llm annotator: 20 request(s) failed (2 batches)"


def test_stage_io_client_is_the_shared_client():
    io = stage_io(Config())
    assert isinstance(io, StageIO) and io.llm is LLMClient
    assert asyncio.iscoroutinefunction(LLMClient.count_prompt)


@pytest.mark.slow
def test_process_exits_with_one_line_when_a_stage_degrades(tmp_path, prefect_harness, llm_standin, capsys):
    """Every annotator request fails (HTTP 500, no retries): `process` prints the summary, what fell back
    first, and stops with one line naming the stage, the count and the cause; --allow-degraded accepts it."""
    from test_flows_process import cfg_for, make_round

    from flows.run import run_process
    from warehouse.lake import Lake

    lake = Lake(tmp_path / "lake")
    make_round(lake, groups=2, batch_groups=2)
    sets = [
        f"llm.endpoints=[{llm_standin.url}]",
        "llm.max_retries=0",
        f"llm.cache_dir={tmp_path / 'llm-cache'}",
        "flow.processes=false",
        "flow.retries=0",
    ]
    llm_standin.fail_next(10_000, "500")
    cfg = cfg_for(lake, methods=["grpo+iapo"], sets=sets, annotator="llm")
    with pytest.raises(SystemExit) as stop:
        run_process(cfg, 0)
    line = str(stop.value.code)
    assert "\n" not in line and line.startswith("stage annotate degraded: ")
    assert "LLM requests failed (server: HTTP 500" in line and "--allow-degraded" in line
    n = int(line.split("degraded: ")[1].split(" of ")[0])
    assert n == int(line.split(" of ")[1].split(" ")[0]) >= 1  # all of them
    out = capsys.readouterr().out
    assert out.index("degraded: what fell back") < out.index("credit by method")
    assert out.index("degraded: what fell back") < out.index("trajectories")

    allowed = cfg_for(lake, methods=["grpo+iapo"], sets=[*sets, "flow.allow_degraded=true"], annotator="llm")
    summary = run_process(allowed, 0)
    assert summary["this_run"]["annotate"]["llm_failed"] == n  # degraded batches are computed again


def test_a_recorded_server_stopped_on_purpose_or_restarted_elsewhere_is_not_restarted(monkeypatch, tmp_path):
    """A recorded server (`creditflow llm serve`) is shared by every process: after `creditflow llm stop` no
    supervisor starts it again, and one restarted by another process is adopted, not restarted twice."""
    monkeypatch.setenv("CREDITFLOW_CACHE", str(tmp_path))
    monkeypatch.setenv("CREDITFLOW_SERVICES_DIR", str(tmp_path / "services"))
    first = _sleeper()
    info = _info(tmp_path, first.pid)
    service._write_state(info, None)
    monkeypatch.setattr(service, "serve", lambda *a, **k: pytest.fail("must not start a server"))
    monkeypatch.setattr(service, "healthy", lambda url, timeout=2.0: False)
    lines: list[str] = []
    sup = supervisor.Supervisor(
        service.ServiceInfo(**info.__dict__), record=True, log=lines.append, health_pause_s=0.0
    )
    other = _sleeper()
    try:
        service._write_state(service.ServiceInfo(**{**info.__dict__, "pid": other.pid, "restarts": 1}), None)
        assert sup.heal(0) is True and sup.generation == 1 and sup.info.pid == other.pid  # adopted
        service.stop()  # on purpose: the state is gone (and the server with it)
        assert other.wait(timeout=20) is not None
        assert sup.heal(1) is False and "no longer recorded" in lines[-1]
    finally:
        for p in (first, other):
            p.kill()
            p.wait()


def test_a_token_id_prompt_is_counted_by_its_length(llm_standin, tmp_path):
    llm_standin.max_model_len = 10
    client = _client(llm_standin.url, tmp_path)
    fits = asyncio.run(client.complete([1, 2, 3], max_tokens=2))
    assert fits.choices and llm_standin.calls == 1
    with pytest.raises(LLMError) as err:
        asyncio.run(client.complete(list(range(9)), max_tokens=2))
    assert err.value.kind == "too_long" and err.value.prompt_tokens == 9 and err.value.context == 10
    assert llm_standin.calls == 1 and llm_standin.tokenize_calls == 1  # the context asked once


def test_a_reask_that_outgrows_the_context_is_not_split(llm_standin, real_data, tmp_path):
    """A window fits, its answer is not JSON, and the re-ask (window + answer + note) no longer fits: the
    window stays one parse failure; it is not split into more windows."""
    from llm_standin import StandIn

    from pipeline.annotate.llm import _split_trajectories
    from pipeline.annotate.llm_prompt import build_messages, build_transcript
    from pipeline.annotate.settings import LLMAnnotatorSettings

    _, steps = _tau_steps(real_data)
    ((_, rows),) = _split_trajectories(steps)
    items, _ = build_transcript(rows, LLMAnnotatorSettings())
    whole = len(StandIn._prompt_tokens({"messages": build_messages(items)}, "chat")[1])
    llm_standin.max_model_len = whole + 64 + 5  # the trajectory fits whole, a re-ask with an answer does not
    llm_standin.behaviour = lambda body, kind, i: "not json " * 40
    out = _annotate(llm_standin.url, tmp_path, steps)
    assert llm_standin.calls == 1 and out.notes["reasks_too_long"] == 1 and "windows" not in out.notes
    assert all(out.tables["nodes"].column("parse_failed").to_pylist())
    assert any("not the JSON schema" in w for w in out.warnings)


def test_a_dead_server_is_healed_when_the_model_name_is_asked(llm_standin, tmp_path):
    """With no model configured the client first lists the served models: a dead managed server is restarted
    there too, and the request then goes to the restarted server."""
    llm_standin.down = True  # /v1/models answers 503 too
    sup = FakeSupervisor(llm_standin)
    client = LLMClient(
        LLMSettings(endpoints=[llm_standin.url], cache_dir=str(tmp_path / "c"), max_retries=0), healer=sup
    )
    (res,) = client.run_batch([LLMRequest.chat([{"role": "user", "content": "q"}], max_tokens=4)])
    assert not isinstance(res, LLMError), res
    assert sup.generation == 1 and client.restarts == 1 and llm_standin.calls == 1


def test_answers_unusable_after_the_reasks_are_failed_requests(llm_standin, real_data, tmp_path):
    """A trajectory whose answers are never the schema falls back to uniform weights: its request counts as
    failed for the stage's failure share (`process` stops above flow.max_failed_share), under its own cause;
    a bad first answer that the re-ask repairs is no failure."""
    _, steps = _tau_steps(real_data)
    llm_standin.behaviour = lambda body, kind, i: "not json " * 5
    out = _annotate(llm_standin.url, tmp_path / "bad", steps)
    assert llm_standin.calls == 2  # the request and its one re-ask
    assert out.notes["llm_unusable"] == 1 and out.notes["llm_requests_total"] == 2
    assert out.notes["llm_requests_failed"] == 1
    assert out.failures == {"unusable answer: not the expected schema after the re-asks (fell back)": 1}
    assert all(out.tables["nodes"].column("parse_failed").to_pylist())

    asked: list[int] = []

    def first_bad(body, kind, i):
        asked.append(1)
        if len(asked) == 1:
            return "not json"
        return json.dumps({"actions": []})

    llm_standin.behaviour = first_bad
    repaired = _annotate(llm_standin.url, tmp_path / "repaired", steps)
    assert len(asked) == 2 and repaired.notes["llm_unusable"] == 0
    assert repaired.notes["llm_requests_failed"] == 0 and repaired.failures == {}
