"""The c3 refiner (spec 5 correction, spec 7 C3 properties), its composition after any estimator, and the
"+ process reward" baselines."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from c3_build import batch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import Config
from pipeline.credit.batch import CreditBatch
from pipeline.credit.methods.c3 import C3Settings, c3
from pipeline.credit.process import process_batch
from pipeline.credit.registry import run_methods
from pipeline.credit.result import CreditResult
from pipeline.detect import detect_spans


@st.composite
def cases(draw):
    n_traj = draw(st.integers(1, 3))
    trajs, spans = [], []
    for i in range(n_traj):
        steps = [{"role": "user", "content": "question here"}]
        for _ in range(draw(st.integers(1, 3))):
            n = draw(st.integers(1, 6))
            lps = draw(st.lists(st.floats(-5, 0), min_size=n, max_size=n))
            steps.append({"role": "assistant", "content": " ".join(["w"] * n), "logprobs": lps})
            steps.append({"role": "tool", "content": "obs"})
        trajs.append({"traj_id": f"t{i}", "reward": draw(st.floats(0, 1)), "steps": steps})
        for _ in range(draw(st.integers(0, 3))):
            k = draw(st.integers(0, len(steps) // 2 - 1))
            n = len(steps[1 + 2 * k]["content"].split())
            lo = draw(st.integers(0, n - 1))
            hi = draw(st.integers(lo, n))
            spans.append(
                {
                    "traj_id": f"t{i}",
                    "step_idx": 1 + 2 * k,
                    "token_start": lo,
                    "token_end": hi,
                    "severity": draw(st.sampled_from([0.0, 0.5, 1.0, 0.3])),
                }
            )
    t, s = batch(trajs)
    ctx = CreditBatch.from_arrow(t, s)
    adv = np.where(
        ctx.tok_mask,
        np.array(
            draw(st.lists(st.floats(-3, 3), min_size=ctx.n_tokens, max_size=ctx.n_tokens)), dtype=np.float64
        ),
        0.0,
    )
    sp = pl.DataFrame(
        spans,
        schema={
            "traj_id": pl.String,
            "step_idx": pl.Int32,
            "token_start": pl.Int32,
            "token_end": pl.Int32,
            "severity": pl.Float64,
        },
    )
    ctx = replace(ctx, annotations={"spans": sp})
    return ctx, adv, sp


def span_mask(ctx, sp):
    inside = np.zeros(ctx.n_tokens, bool)
    starts = dict(
        zip(
            zip(ctx.steps["traj_id"], ctx.steps["step_idx"], strict=True), ctx.steps["tok_start"], strict=True
        )
    )
    for r in sp.iter_rows(named=True):
        base = starts[(r["traj_id"], r["step_idx"])]
        inside[base + r["token_start"] : base + r["token_end"]] = True
    return inside


def run_c3(ctx, adv, **kw):
    return c3(ctx, CreditResult.per_token(adv.copy()), C3Settings(**kw)).adv_per_token()


@settings(max_examples=80, deadline=None)
@given(cases(), st.floats(0, 1))
def test_c3_properties(case, lam):
    ctx, adv, sp = case
    out = run_c3(ctx, adv, lam=lam)
    inside = span_mask(ctx, sp)
    # outside spans and A <= 0: bit-identical
    keep = ~inside | (adv <= 0)
    assert np.array_equal(out[keep], adv[keep]) and out[keep].tobytes() == adv[keep].tobytes()
    # inside, positive: 0 <= A' <= A
    pos = inside & (adv > 0)
    assert np.all(out[pos] >= 0) and np.all(out[pos] <= adv[pos])
    # severity 0 -> no change; confidence 0 -> no change
    assert np.array_equal(
        run_c3(ctx, adv, lam=lam)
        if lam == 0
        else c3(_with_sev(ctx, 0.0), CreditResult.per_token(adv.copy()), C3Settings(lam=lam)).adv_per_token(),
        adv,
    )
    ctx0 = _with_logprob(ctx, np.full(ctx.n_tokens, -np.inf))
    assert np.array_equal(run_c3(ctx0, adv, lam=lam), adv)
    # monotone non-increasing in s and in c
    lower_s = c3(
        _with_sev(ctx, None, scale=0.5), CreditResult.per_token(adv.copy()), C3Settings(lam=lam)
    ).adv_per_token()
    assert np.all(out <= lower_s + 1e-12)
    lower_c = run_c3(_with_logprob(ctx, ctx.logprobs.per_token() - 1.0), adv, lam=lam)
    assert np.all(out <= lower_c + 1e-12)


def _with_sev(ctx, value, scale=1.0):
    sp = ctx.annotations["spans"]
    sev = pl.lit(value, pl.Float64) if value is not None else pl.col("severity") * scale
    return replace(ctx, annotations={"spans": sp.with_columns(sev.alias("severity"))})


def _with_logprob(ctx, lp):
    return replace(ctx, logprobs=replace(ctx.logprobs, dense=lp))  # the logprobs as this per-token array


def test_c3_hand_computed():
    lps = [-0.1, -0.2, -0.3, -0.4]
    t, s = batch(
        [
            {
                "traj_id": "a",
                "steps": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "w w w w", "logprobs": lps},
                ],
            }
        ]
    )
    ctx = CreditBatch.from_arrow(t, s)
    spans = pl.DataFrame(
        {
            "traj_id": ["a", "a"],
            "step_idx": [1, 1],
            "token_start": [1, 2],
            "token_end": [3, 4],
            "severity": [0.5, 1.0],
        }
    )
    ctx = replace(ctx, annotations={"spans": spans})
    adv = np.array([0.0, 2.0, 2.0, 2.0, -1.0])  # flat tokens: user q, then w0..w3
    res = c3(ctx, CreditResult.per_token(adv.copy(), {"a_hat": np.array([np.nan, 2.0])}), C3Settings())
    c1, c2 = np.exp(np.mean(lps[1:3])), np.exp(np.mean(lps[2:4]))
    g1, g2 = 0.5 * c1, 1.0 * c2
    expect = [0.0, 2.0, 2.0 * (1 - g1), 2.0 * (1 - max(g1, g2)), -1.0]
    assert res.adv_per_token() == pytest.approx(expect)
    assert res.components["severity"][1] == 1.0 and np.isnan(res.components["severity"][0])
    assert res.components["confidence"][1] == pytest.approx(max(c1, c2))
    assert res.components["factor"][1] == pytest.approx(1 - max(g1, g2))
    assert res.components["a_hat"][1] == 2.0  # base components pass through
    arith = c3(ctx, CreditResult.per_token(adv.copy()), C3Settings(confidence="arithmetic")).adv_per_token()
    assert arith[2] == pytest.approx(2.0 * (1 - 0.5 * np.mean(np.exp(lps[1:3]))))


def test_missing_logprobs_use_setting_and_are_counted():
    t, s = batch([{"traj_id": "a", "steps": [{"role": "assistant", "content": "w w", "logprob": None}]}])
    ctx = CreditBatch.from_arrow(t, s)
    ctx = replace(
        ctx,
        annotations={
            "spans": pl.DataFrame(
                {"traj_id": ["a"], "step_idx": [0], "token_start": [0], "token_end": [2], "severity": [1.0]}
            )
        },
    )
    adv = np.array([1.0, 1.0])
    res = c3(ctx, CreditResult.per_token(adv.copy()), C3Settings())
    assert res.adv_per_token().tolist() == [0.0, 0.0] and res.notes["c3.missing_confidence_spans"] == 1.0
    res = c3(ctx, CreditResult.per_token(adv.copy()), C3Settings(missing_confidence=0.25, lam=0.8))
    assert res.adv_per_token() == pytest.approx([0.8, 0.8])


# ---- composition on a detected batch -------------------------------------------------------------
def loop_batch():
    def traj(i, reward, turns):
        steps = [{"role": "user", "content": "question"}]
        for text in turns:
            steps.append(
                {
                    "role": "assistant",
                    "content": text,
                    "logprob": -0.2 * (i + 1),
                    "values": [0.1 * i] * len(text.split()),
                }
            )
            steps.append({"role": "user", "content": "<information> docs </information>"})
        return {
            "traj_id": f"t{i}",
            "group_id": "g",
            "reward": reward,
            "action_format": "search_r1",
            "steps": steps,
            "reward_components": None,
        }

    q = "<think> hmm </think> <search> capital of france </search>"
    return batch(
        [
            traj(0, 1.0, [q, q, "<answer> Paris </answer>"]),
            traj(1, 0.0, [q, "no action here"]),
            traj(2, 1.0, ["<search> capital of france please </search>", "<answer> Paris </answer>"]),
        ]
    )


METHODS = ["grpo", "grpo+c3", "gae", "gae+c3", "gdpo", "gdpo+c3", "rloo+c3", "grpo_pr", "gae_pr"]


def test_c3_after_estimators_and_ppo_returns_untouched():
    t, s = loop_batch()
    spans, _ = detect_spans(t, s)
    assert sorted(spans["rule"].to_pylist()) == ["query.exact", "search_r1.no_action"]
    tables, notes = process_batch(t, s, METHODS, Config(), {"spans": spans})
    for base in ("grpo", "gae", "gdpo"):
        a = np.concatenate([np.asarray(x, dtype=np.float64) for x in tables[base]["token_adv"].to_pylist()])
        b = np.concatenate(
            [np.asarray(x, dtype=np.float64) for x in tables[base + "+c3"]["token_adv"].to_pylist()]
        )
        assert np.all((b == a) | ((a > 0) & (b < a) & (b >= 0)))
        assert notes[base + "+c3"]["c3.spans"] == 2.0
    assert tables["gae+c3"]["token_returns"].to_pylist() == tables["gae"]["token_returns"].to_pylist()
    # the loop turn of the successful t0 got positive credit under grpo, reduced under grpo+c3
    g = pl.from_arrow(tables["grpo+c3"]).filter((pl.col("traj_id") == "t0") & (pl.col("step_idx") == 3))
    assert g["components"].struct.field("severity").to_list() == [1.0]
    factor = g["components"].struct.field("factor")[0]
    assert factor == pytest.approx(1 - np.exp(-0.2))


def test_c3_with_iapo_and_tcpo_chains():
    from pipeline.credit.registry import ESTIMATORS, REFINERS

    if "iapo" not in REFINERS or "tcpo" not in ESTIMATORS:
        pytest.skip("iapo / tcpo not registered")
    t, s = loop_batch()
    spans, _ = detect_spans(t, s)
    ctx = CreditBatch.from_arrow(
        t, s, annotations={"spans": spans, "nodes": _empty("nodes"), "edges": _empty("edges")}
    )
    out = run_methods(ctx, ["grpo+iapo", "grpo+iapo+c3"])
    a, b = out["grpo+iapo"].adv_per_token(), out["grpo+iapo+c3"].adv_per_token()
    assert np.all((b == a) | ((a > 0) & (b < a)))
    # tcpo+c3: turn-level credit, corrected only on positive tokens inside the spans (no CF rows: hindsight)
    scores = {"t0": [0.1, 1.0, 1.0], "t1": [0.0, 0.2], "t2": [0.3, 0.3]}  # t0's looping turn 2 makes progress
    rows_ = s.to_pylist()
    for r in rows_:
        if r["role"] == "assistant":
            r["verifier_score"] = scores[r["traj_id"]][r["turn"] - 1]
    s = pa.Table.from_pylist(rows_, schema=s.schema)
    cfg = Config()
    ctx = CreditBatch.from_arrow(
        t, s, config=cfg, annotations={"spans": spans, "counterfactuals": _empty("counterfactuals")}
    )
    out = run_methods(ctx, ["tcpo", "tcpo+c3"])
    a, b = out["tcpo"].adv_per_token(), out["tcpo+c3"].adv_per_token()
    in_span = np.zeros(ctx.n_tokens, dtype=bool)
    starts = ctx.steps["tok_start"].to_numpy()
    rows = {
        (tid, si): i
        for i, (tid, si) in enumerate(zip(ctx.steps["traj_id"], ctx.steps["step_idx"], strict=True))
    }
    for sp in spans.to_pylist():
        base = starts[rows[(sp["traj_id"], sp["step_idx"])]]
        in_span[base + sp["token_start"] : base + sp["token_end"]] = True
    assert np.array_equal(a[~in_span], b[~in_span])  # bit-identical outside the spans
    assert np.array_equal(a[in_span & (a <= 0)], b[in_span & (a <= 0)])
    pos = in_span & (a > 0)
    assert pos.any(), "the case must put positive tcpo credit inside a span"
    assert np.all((b[pos] < a[pos]) & (b[pos] >= 0))


def _empty(name):
    from schemas import TABLES

    return TABLES[name].schema.empty_table()


def test_process_reward_baselines():
    t, s = loop_batch()
    spans, _ = detect_spans(t, s)
    cfg = Config(stages={"gae": {"whiten": False}})
    ctx = CreditBatch.from_arrow(t, s, config=cfg, annotations={"spans": spans})
    out = run_methods(ctx, ["grpo", "grpo_pr", "gae", "gae_pr"])
    # outcome level for grpo: R' = R - 0.5 * sum s = [0.5, -0.5, 1.0]
    r = np.array([0.5, -0.5, 1.0])
    a = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    assert out["grpo_pr"].components["a_hat"][ctx.steps["traj_index"].to_numpy() == 0][0] == pytest.approx(
        a[0]
    )
    # turn level for gae (gamma = lam = 1, unwhitened): tokens up to the penalised turn lose beta*s = 0.5
    diff = out["gae_pr"].adv_per_token() - out["gae"].adv_per_token()
    t0 = (ctx.token_trajs() == 0) & ctx.tok_mask
    turn2_end = int(ctx.steps["tok_start"][3] + ctx.steps["n_tokens"][3])
    idx = np.flatnonzero(t0)
    assert diff[idx[idx < turn2_end]] == pytest.approx(-0.5)
    assert diff[idx[idx >= turn2_end]] == pytest.approx(0.0)
    assert (out["gae_pr"].returns_per_token() - out["gae"].returns_per_token())[
        idx[idx < turn2_end]
    ] == pytest.approx(-0.5)
    ctx2 = CreditBatch.from_arrow(
        t,
        s,
        config=Config(stages={"gae": {"whiten": False}, "process_reward": {"level": "outcome"}}),
        annotations={"spans": spans},
    )
    d2 = run_methods(ctx2, ["gae_pr"])["gae_pr"].adv_per_token() - out["gae"].adv_per_token()
    assert d2[idx] == pytest.approx(-0.5)  # the outcome penalty reaches every token (gamma = lam = 1)
