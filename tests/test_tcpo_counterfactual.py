"""The counterfactual stage against the local stand-in server: the exact history, n = M sampling, the
verifier, injected failures (hindsight fallback, counted), slow responses, endpoint failover, a stateful
environment restored from a snapshot, and the end-to-end credit."""

from __future__ import annotations

import time

import polars as pl
import pytest
from llm_standin import Fail, dead_endpoint
from tcpo_data import make_batch

from flows.batch import stage_io
from pipeline.config import Config
from pipeline.counterfactual import counterfactual
from pipeline.counterfactual.env import KVBankEnv, StatefulEnv, score_from_snapshot
from pipeline.credit.process import process_batch
from pipeline.stages import execute, stages_for

QA_META = {"verifier": "em", "golden_answers": ["Paris"], "sampling": {"temperature": 0.7, "top_p": 0.95}}
# A fails turn 1 then succeeds; B never succeeds; C succeeds at once: eligible turns A1, B1, B2
GROUPS = [[[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]]]
LOGPROBS = [[[-2.0, -0.1], [-1.0, -3.0], [-0.1, -0.1]]]  # xi: A1 2, B1 1, B2 3


def _run(stage_fn, traj, steps, cfg):
    """The stage's requests sent through the flow's client (flows.batch.stage_io), as `run_stage` does."""
    io = stage_io(cfg)
    return execute(stage_fn(traj, steps, cfg, {}, io=io), io)


def config(url_or_urls, methods=("tcpo",), **tcpo) -> Config:
    urls = url_or_urls if isinstance(url_or_urls, list) else [url_or_urls]
    return Config(
        methods=list(methods),
        llm={"endpoints": urls, "cache": False, "max_retries": 0, "timeout_s": 10, "backoff_s": 0},
        stages={"tcpo": {"L": 2, "M": 4, **tcpo}},
    )


def alt_behaviour(body, kind, index):
    # alternatives 0 and 2 answer correctly, 1 and 3 do not: a non-degenerate comparison
    return "<answer>Paris</answer>" if index % 2 == 0 else "<answer>London</answer>"


def batch():
    return make_batch(GROUPS, logprobs=LOGPROBS, meta=QA_META, action_format="search_r1")


def test_samples_selected_turns_under_the_exact_history(llm_standin):
    llm_standin.behaviour = alt_behaviour
    traj, steps = batch()
    cfg_ = config(llm_standin.url)
    out = _run(counterfactual, traj, steps, cfg_)
    cf = pl.from_arrow(out.tables["counterfactuals"])
    # Top-2 by surprisal of {A1 (2), B1 (1), B2 (3)}: B2 and A1, M = 4 alternatives each
    assert sorted(set(zip(cf["traj_id"], cf["turn"], strict=True))) == [("g000-t00", 1), ("g000-t01", 2)]
    assert cf.height == 8 and (cf["status"] == "ok").all()
    assert cf.sort("traj_id", "turn", "alt_idx")["score"].to_list() == [1.0, 0.0, 1.0, 0.0] * 2
    assert set(cf["verifier"]) == {"em"}
    assert out.notes["selected_turns"] == 2 and out.notes["alts_ok"] == 8
    # one request per selected turn, n = M, the rollout's sampling params, logprobs on, the exact history
    assert llm_standin.calls == 2
    bodies = {len(b["messages"]): b for b in llm_standin.requests}
    for b in bodies.values():
        assert b["n"] == 4 and b["temperature"] == 0.7 and b["top_p"] == 0.95 and b["logprobs"] is True
    assert bodies[1]["messages"] == [{"role": "user", "content": "prompt 0"}]  # A1: history = the prompt
    assert bodies[3]["messages"] == [  # B2: prompt, B's turn 1, its feedback
        {"role": "user", "content": "prompt 0"},
        {"role": "assistant", "content": "answer 0.1.1"},
        {"role": "user", "content": "feedback 1"},
    ]


def test_end_to_end_credit_uses_the_alternatives(llm_standin):
    llm_standin.behaviour = alt_behaviour
    traj, steps = batch()
    cfg = config(llm_standin.url)
    (stage,) = stages_for({"counterfactuals"})
    out = _run(stage.fn, traj, steps, cfg)
    tables, notes = process_batch(
        traj, steps, ["tcpo"], cfg, {"counterfactuals": out.tables["counterfactuals"]}
    )
    adv = pl.from_arrow(tables["tcpo"]).filter(pl.col("role") == "assistant").unnest("components")
    a1 = adv.filter((pl.col("traj_id") == "g000-t00") & (pl.col("turn") == 1)).row(0, named=True)
    # q0 = 0, q = 1, 0, 1, 0 -> c_cf = -0.5, eta = 1
    assert (
        a1["g_sel"] == 1
        and a1["eta"] == 1
        and a1["c_cf"] == pytest.approx(-0.5)
        and a1["c_del"] == pytest.approx(-0.5)
    )
    assert notes["tcpo"]["cf_used"] == 2 and notes["tcpo"]["cf_missing_fallback"] == 0


def test_failed_samples_fall_back_to_hindsight(llm_standin):
    def behaviour(body, kind, index):
        if body["messages"][-1]["content"] == "feedback 1":  # B2's request fails for good
            raise Fail("400")
        return alt_behaviour(body, kind, index)

    llm_standin.behaviour = behaviour
    traj, steps = batch()
    cfg = config(llm_standin.url)
    cfg_ = cfg
    out = _run(counterfactual, traj, steps, cfg_)
    cf = pl.from_arrow(out.tables["counterfactuals"])
    b2 = cf.filter(pl.col("traj_id") == "g000-t01")
    assert b2.height == 4 and (b2["status"] == "sample_failed").all() and b2["score"].null_count() == 4
    assert b2["error"][0] is not None
    assert out.notes["turns_hindsight_fallback"] == 1 and out.warnings
    _, notes = process_batch(traj, steps, ["tcpo"], cfg, {"counterfactuals": out.tables["counterfactuals"]})
    assert notes["tcpo"]["cf_missing_fallback"] == 1 and notes["tcpo"]["cf_used"] == 1


def test_every_endpoint_down_never_fails_the_round():
    traj, steps = batch()
    cfg = config([dead_endpoint()])
    cfg_ = cfg
    out = _run(counterfactual, traj, steps, cfg_)
    cf = pl.from_arrow(out.tables["counterfactuals"])
    assert cf.height == 8 and (cf["status"] == "sample_failed").all()
    tables, notes = process_batch(
        traj, steps, ["tcpo"], cfg, {"counterfactuals": out.tables["counterfactuals"]}
    )
    assert notes["tcpo"]["cf_missing_fallback"] == 2


def test_round_robin_with_a_dead_endpoint_fails_over(llm_standin):
    llm_standin.behaviour = alt_behaviour
    traj, steps = batch()
    cfg_ = config([dead_endpoint(), llm_standin.url])
    out = _run(counterfactual, traj, steps, cfg_)
    assert out.notes["alts_ok"] == 8


def test_slow_responses_run_concurrently(llm_standin):
    llm_standin.behaviour = alt_behaviour
    llm_standin.latency_s = 0.5
    groups = [[[0.0, 0.0], [0.0, 0.0]] for _ in range(6)]  # 4 eligible turns per prompt, L = 2: 12 requests
    traj, steps = make_batch(groups, meta=QA_META, action_format="search_r1")
    t0 = time.perf_counter()
    cfg_ = config(llm_standin.url)
    out = _run(counterfactual, traj, steps, cfg_)
    wall = time.perf_counter() - t0
    assert out.notes["alts_ok"] == 12 * 4
    assert llm_standin.max_inflight >= 6
    assert wall < 12 * 0.5 / 2  # serial would take 6 s


def test_verifier_failure_is_recorded(llm_standin):
    llm_standin.behaviour = alt_behaviour
    traj, steps = make_batch(GROUPS, logprobs=LOGPROBS, meta={"verifier": "em"})  # no gold answer
    cfg_ = config(llm_standin.url)
    out = _run(counterfactual, traj, steps, cfg_)
    cf = pl.from_arrow(out.tables["counterfactuals"])
    assert (cf["status"] == "verify_failed").all() and "gold" in cf["error"][0]


def test_all_cf_and_random_cf_methods_widen_the_selection(llm_standin):
    llm_standin.behaviour = alt_behaviour
    traj, steps = batch()
    cfg_ = config(llm_standin.url, methods=("tcpo", "tcpo_all_cf"))
    out = _run(counterfactual, traj, steps, cfg_)
    assert out.notes["selected_turns"] == 3


# ---- stateful environment ----------------------------------------------------------------------------

BANK = {"env": "kv_bank", "accounts": {"alice": 10, "bob": 0}, "goal": {"alice": 5, "bob": 5}}


def test_kv_bank_snapshot_restore():
    env = KVBankEnv()
    assert isinstance(env, StatefulEnv)
    env.reset(BANK)
    env.step("transfer alice bob 2")
    snap = env.snapshot()
    assert env.step("transfer alice bob 3").score == 1.0
    env.restore(snap)
    assert env.balances == {"alice": 8, "bob": 2}
    assert env.step("deposit bob 3").score == 0.5  # bob 5, alice 8
    env.restore(snap)
    assert env.step("nonsense").observation.startswith("invalid action")
    # every alternative starts from the same pre-turn state
    scores = score_from_snapshot(
        env, BANK, ["transfer alice bob 2"], ["transfer alice bob 3", "deposit bob 3", "transfer alice bob 3"]
    )
    assert scores == [1.0, 0.5, 1.0]
    assert env.balances == {"alice": 8, "bob": 2}


def test_stage_scores_alternatives_in_the_environment(llm_standin):
    actions = ["transfer alice bob 3", "transfer bob alice 1", "withdraw alice 100", "transfer alice bob 3"]
    llm_standin.behaviour = lambda body, kind, index: actions[index]
    # one trajectory pair; turn 1 "transfer alice bob 2" scored 0, turn 2 scored 0 (eligible, selected)
    contents = [[["transfer alice bob 2", "deposit alice 1"], ["deposit bob 1", "deposit bob 1"]]]
    traj, steps = make_batch(
        [[[0.0, 0.0], [0.0, 0.0]]], meta=BANK, contents=contents, logprobs=[[[-0.1, -5.0], [-0.1, -0.2]]]
    )
    cfg_ = config(llm_standin.url, L=1)
    out = _run(counterfactual, traj, steps, cfg_)
    cf = pl.from_arrow(out.tables["counterfactuals"]).sort("alt_idx")
    assert cf["traj_id"].unique().to_list() == ["g000-t00"] and cf["turn"][0] == 2
    # pre-turn state: alice 8, bob 2 (turn 1 replayed); each alternative from that state
    assert cf["score"].to_list() == [1.0, 0.0, 0.0, 1.0]
    assert set(cf["verifier"]) == {"env:kv_bank"}
