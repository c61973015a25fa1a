"""IAPO routing (spec section 4 and the section 7 properties): hypothesis properties, a hand-worked refund
trajectory, and a per-trajectory loop reference matched on random graphs."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from iapo_data import annotations, base_result, make_ctx, reference_weights

from pipeline.credit.methods.iapo import IAPOSettings, iapo, route_weights
from pipeline.credit.registry import MethodError

TYPES = ["input", "success_utilization", "failed_utilization", "bogus"]


@st.composite
def batches(draw, max_traj=4, max_T=7):
    trajs, edges, nodes, a_hat, failed = [], [], [], {}, set()
    for k in range(draw(st.integers(1, max_traj))):
        T = draw(st.integers(1, max_T))
        L = draw(st.lists(st.integers(0, 30), min_size=T, max_size=T))
        if not any(L):
            L[draw(st.integers(0, T - 1))] = draw(st.integers(1, 30))
        tid = f"t{k}"
        trajs.append({"id": tid, "L": L})
        for _ in range(draw(st.integers(0, 3 * T))):
            edges.append(
                (tid, draw(st.integers(0, T + 1)), draw(st.integers(0, T + 1)), draw(st.sampled_from(TYPES)))
            )
        for turn in range(1, T + 1):
            nodes.append(
                (tid, turn, int(draw(st.booleans()) and draw(st.booleans())), draw(st.integers(0, 2)))
            )
        a_hat[tid] = draw(st.sampled_from([0.0, 1.0, -1.0, 0.37, -2.5, 1e-3]))
        if draw(st.integers(0, 9)) == 0:
            failed.add(tid)
    nodes = [(*n, n[0] in failed) for n in nodes]
    return trajs, edges, nodes, a_hat, failed


def run(trajs, edges, nodes, a_hat, **kw):
    ctx = make_ctx(trajs, annotations(edges, nodes))
    res = iapo(ctx, base_result(ctx, a_hat), IAPOSettings(**kw))
    return ctx, res


def per_traj_tokens(ctx, res):
    return np.bincount(ctx.token_trajs(), weights=res.adv_per_token(), minlength=ctx.n_traj)


def assistant_frame(ctx, res):
    comps = {
        k: res.components[k]
        for k in ("w", "m_plus", "m_minus", "phi_plus", "phi_minus", "d_plus", "d_minus", "d_in")
    }
    return ctx.steps.with_columns(**{k: pl.Series(v) for k, v in comps.items()}).filter(
        pl.col("is_assistant") & (pl.col("n_tokens") > 0)
    )


SETTINGS = dict(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(**SETTINGS)
@given(
    batches(),
    st.sampled_from(["cons", "proj"]),
    st.sampled_from([0.0, 0.05, 0.3]),
    st.sampled_from([0.125, 0.25, 0.5]),
)
def test_matches_reference(batch, neg, beta, c):
    trajs, edges, nodes, a_hat, failed = batch
    ctx, res = run(trajs, edges, nodes, a_hat, negative_branch=neg, beta_plus=beta, c=c)
    got = assistant_frame(ctx, res)
    for t in trajs:
        tid = t["id"]
        ref = reference_weights(
            t["L"],
            [(i, j, ty) for (x, i, j, ty) in edges if x == tid],
            {n[1]: n[2] for n in nodes if n[0] == tid},
            {n[1]: n[3] for n in nodes if n[0] == tid},
            a_hat[tid],
            beta_plus=beta,
            c=c,
            negative=neg,
            parse_failed=tid in failed,
        )
        rows = got.filter(pl.col("traj_id") == tid)
        w = dict(zip(rows["turn"].to_list(), rows["w"].to_list(), strict=True))
        assert set(w) == set(ref)
        for turn in ref:
            assert w[turn] == pytest.approx(ref[turn], abs=1e-6, rel=1e-6)


@settings(**SETTINGS)
@given(batches())
def test_mass_sign_zero_and_bounds(batch):
    trajs, edges, nodes, a_hat, _ = batch
    ctx, res = run(trajs, edges, nodes, a_hat)
    ids = ctx.trajectories["traj_id"].to_list()
    L = np.bincount(ctx.token_trajs(), weights=ctx.tok_mask.astype(float), minlength=ctx.n_traj)
    a = np.array([a_hat[t] for t in ids])
    # mass: sum of token advantages = L * A_hat
    np.testing.assert_allclose(per_traj_tokens(ctx, res), L * a, rtol=1e-9, atol=1e-9)
    # sign preservation, A_hat = 0 -> 0, masked tokens 0
    tok_a = a[ctx.token_trajs()]
    m = ctx.tok_mask
    assert np.all(np.sign(res.adv_per_token()[m]) == np.sign(tok_a[m]))
    assert np.all(res.adv_per_token()[~m] == 0)
    # bounds of m
    c = 0.25
    f = assistant_frame(ctx, res)
    for col in ("m_plus", "m_minus"):
        v = f[col].to_numpy()
        assert np.all(v >= math.exp(-2 * c) - 1e-12) and np.all(v <= math.exp(2 * c) + 1e-12)
    assert np.all(f["w"].to_numpy() > 0)


@settings(**SETTINGS)
@given(batches())
def test_beta_zero_gives_m_plus(batch):
    trajs, edges, nodes, a_hat, _ = batch
    a_hat = dict.fromkeys(a_hat, 1.0)
    ctx, res = run(trajs, edges, nodes, a_hat, beta_plus=0.0)
    f = assistant_frame(ctx, res)
    np.testing.assert_allclose(f["w"].to_numpy(), f["m_plus"].to_numpy(), rtol=0, atol=1e-12)


@settings(**SETTINGS)
@given(batches(), st.randoms(use_true_random=False))
def test_edge_order_independent(batch, rnd):
    trajs, edges, nodes, a_hat, _ = batch
    _, r1 = run(trajs, edges, nodes, a_hat)
    shuffled = list(edges)
    rnd.shuffle(shuffled)
    _, r2 = run(
        trajs, shuffled + shuffled[: len(shuffled) // 2], list(reversed(nodes)), a_hat
    )  # + duplicates
    np.testing.assert_array_equal(r1.adv_per_token(), r2.adv_per_token())


@settings(**SETTINGS)
@given(
    st.integers(2, 8),
    st.integers(0, 7),
    st.floats(0.01, 3.0),
    st.floats(0.01, 1.0),
    st.randoms(use_true_random=False),
)
def test_raising_phi_minus_lowers_w_plus(T, i, delta, beta, rnd):
    i = i % T
    L = np.array([rnd.randint(1, 40) for _ in range(T)], dtype=float)
    phi_p = np.array([math.log(1 + rnd.randint(0, 4)) for _ in range(T)])
    phi_m = np.array([math.log(1 + rnd.randint(0, 1) * rnd.randint(1, 4)) for _ in range(T)])
    seg = np.zeros(T, dtype=np.int64)
    s = IAPOSettings(beta_plus=beta)
    sign = np.array([1.0])
    before = route_weights(phi_p, phi_m, L, seg, 1, sign, s)
    raised = phi_m.copy()
    raised[i] += delta
    after = route_weights(phi_p, raised, L, seg, 1, sign, s)
    np.testing.assert_array_equal(before["m_plus"], after["m_plus"])
    assert after["w"][i] < before["w"][i]


def test_uniform_fallbacks():
    trajs = [
        {"id": "a", "L": [5, 7, 9]},
        {"id": "b", "L": [4]},
        {"id": "c", "L": [3, 3, 3]},
        {"id": "d", "L": [6, 2, 8]},
    ]
    edges = [
        ("c", 1, 2, "input"),
        ("c", 2, 3, "input"),
        ("c", 1, 3, "input"),  # symmetric: not constant
        ("d", 1, 2, "input"),
        ("d", 1, 3, "success_utilization"),
        ("d", 2, 3, "failed_utilization"),
    ]
    nodes = [("d", 1, 0, 0, True), ("d", 2, 1, 0, True), ("d", 3, 0, 0, True)]  # d: parse failure
    a_hat = {"a": 1.0, "b": -1.0, "c": -0.5, "d": 2.0}
    ctx, res = run(trajs, edges, nodes, a_hat)
    f = assistant_frame(ctx, res)
    w = {(r["traj_id"], r["turn"]): r["w"] for r in f.iter_rows(named=True)}
    # a: empty graph; b: T = 1; c: negative with no errors -> phi- constant; d: parse failure
    for key, val in w.items():
        if key[0] in "abcd":
            assert val == 1.0, key
    assert res.notes["iapo.fallback_trajectories"] == 1.0


def test_constant_features_and_zero_length_actions():
    # every action has the same support structure -> phi+ constant -> m+ = 1 exactly
    trajs = [{"id": "a", "L": [5, 0, 9, 4]}]
    edges = [("a", 1, 3, "input"), ("a", 3, 4, "input"), ("a", 1, 2, "input"), ("a", 2, 4, "input")]
    # edges touching the zero-length action 2 are dropped: 1->3, 3->4: d+ = (1, 1, 0), d_in = (0, 1, 1)
    nodes = [("a", 4, 0, 1)]  # u_dir 1 on action 4 -> phi+ = log2 for 1, log3 for 3, log3 for 4
    ctx, res = run(trajs, edges, nodes, {"a": 1.0}, beta_plus=0.0)
    f = assistant_frame(ctx, res)
    assert f["turn"].to_list() == [1, 3, 4]
    assert f["d_plus"].to_list() == [1.0, 1.0, 0.0]
    assert f["d_in"].to_list() == [0.0, 1.0, 2.0]
    assert res.notes["iapo.invalid_edges"] == 2.0
    ctx, res = run(
        trajs, [("a", 1, 3, "input"), ("a", 3, 4, "input")], [("a", 1, 0, 1), ("a", 4, 0, 1)], {"a": 1.0}
    )
    f = assistant_frame(ctx, res)
    assert f["phi_plus"].n_unique() == 1 and f["m_plus"].to_list() == [1.0, 1.0, 1.0]


def test_failed_edge_from_clean_action_sets_error_and_duplicates_once():
    trajs = [{"id": "a", "L": [10, 10, 10]}]
    edges = [
        ("a", 1, 2, "failed_utilization"),
        ("a", 1, 2, "failed_utilization"),
        ("a", 1, 3, "input"),
        ("a", 1, 3, "success_utilization"),
    ]
    ctx, res = run(trajs, edges, [], {"a": -1.0})
    f = assistant_frame(ctx, res)
    assert f["d_minus"].to_list() == [1.0, 0.0, 0.0]
    assert f["d_plus"].to_list() == [1.0, 0.0, 0.0]  # (1->3) input and success_utilization: one consumer
    # e_1 set to 1 by its E- edge: phi-_1 = log(1 + 1 * (1 + 1 + 0)) = log 3
    assert f["phi_minus"].to_list()[0] == pytest.approx(math.log(3))
    assert res.notes["iapo.duplicate_edges"] == 2.0
    # the negative branch routes more blame to action 1
    w = f["w"].to_list()
    assert w[0] > 1.0 > w[1] and w[1] == w[2]


def test_refuses_non_trajectory_level_base():
    ctx = make_ctx([{"id": "a", "L": [3, 4]}], annotations([]))
    base = base_result(ctx, {"a": 1.0})
    adv = base.adv_per_token().copy()
    adv[np.flatnonzero(ctx.tok_mask)[0]] = 2.0
    with pytest.raises(MethodError, match="trajectory-level"):
        iapo(ctx, type(base).per_token(adv, base.components), IAPOSettings())


def test_several_annotators_need_a_choice():
    ctx = make_ctx([{"id": "a", "L": [3, 4]}])
    a1 = annotations([("a", 1, 2, "input")], annotator="x")
    a2 = annotations([("a", 1, 2, "input")], annotator="y")
    ctx = replace(ctx, annotations={"edges": pl.concat([a1["edges"], a2["edges"]]), "nodes": a1["nodes"]})
    with pytest.raises(MethodError, match="several annotators"):
        iapo(ctx, base_result(ctx, {"a": 1.0}), IAPOSettings())
    res = iapo(ctx, base_result(ctx, {"a": 1.0}), IAPOSettings(annotator="y"))
    assert res.components["d_plus"][1] == 1.0


def test_hand_worked_refund_trajectory():
    """A successful (A_hat = +1.2) and a failed (A_hat = -0.8) refund rollout, weights computed by hand.

    a1 (L=10) asks "original card or store balance?"; the user answers.   (a1 also cites the opening request,
    which has no elicitor: u_dir(a1) = 1)
    a2 (L=20) get_order(order_id) -> order record with payment_id
    a3 (L=30) refund(order_id, payment_id, destination) -> tool error (wrong amount)
    a4 (L=40) refund(...) corrected: uses the destination (from a1), the payment_id (from a2), recovers from a3
    edges: 1->3 input, 2->3 success_utilization, 1->4 input, 2->4 success_utilization, 3->4 failed_utilization
    """
    L = [10.0, 20.0, 30.0, 40.0]
    edges = [
        (1, 3, "input"),
        (2, 3, "success_utilization"),
        (1, 4, "input"),
        (2, 4, "success_utilization"),
        (3, 4, "failed_utilization"),
    ]
    # degrees: d+ = (2, 2, 0, 0), d- = (0, 0, 1, 0), d_in = (1, 0, 2, 2) (a1: u_dir), e = (0, 0, 1, 0)
    phi_p = [math.log(4), math.log(3), math.log(3), math.log(3)]
    phi_m = [0.0, 0.0, math.log(1 + 1 * (1 + 1 + 2)), 0.0]  # log 5 on a3
    Lt = 100.0
    c, eps, beta = 0.25, 1e-6, 0.05

    def m_of(phi):
        mean = sum(li * p for li, p in zip(L, phi, strict=True)) / Lt
        sd = math.sqrt(sum(li * (p - mean) ** 2 for li, p in zip(L, phi, strict=True)) / Lt)
        ez = [math.exp(max(-c, min(c, (p - mean) / (sd + eps)))) for p in phi]
        norm = sum(li * x for li, x in zip(L, ez, strict=True)) / Lt
        return [x / norm for x in ez], mean

    # phi+: mean = (10 log4 + 90 log3)/100 = 1.127...; sd = 3 * 0.2877 * 0.1 ... -> z1 = +3 (clipped to c),
    # z2..4 = -1/3 (clipped to -c): m+ = e^{+-0.25} / (0.1 e^0.25 + 0.9 e^-0.25)
    m_p, _ = m_of(phi_p)
    norm_p = 0.1 * math.exp(0.25) + 0.9 * math.exp(-0.25)
    assert m_p[0] == pytest.approx(math.exp(0.25) / norm_p, rel=1e-12)
    assert m_p[1] == pytest.approx(math.exp(-0.25) / norm_p, rel=1e-12)
    m_m, mean_m = m_of(phi_m)
    assert mean_m == pytest.approx(0.3 * math.log(5))
    # phi-: z3 = 0.7 log5 / sqrt(.21) log5 = 1.53 -> c; others -0.3/sqrt(.21) = -0.65 -> -c
    norm_m = 0.3 * math.exp(0.25) + 0.7 * math.exp(-0.25)
    assert m_m[2] == pytest.approx(math.exp(0.25) / norm_m, rel=1e-12)
    psi = [p - mean_m for p in phi_m]
    u = [mp * math.exp(-beta * s) for mp, s in zip(m_p, psi, strict=True)]
    w_pos = [Lt * x / sum(li * y for li, y in zip(L, u, strict=True)) for x in u]
    w_neg = m_m

    trajs = [
        {"id": "win", "group": "g", "L": [10, 20, 30, 40]},
        {"id": "lose", "group": "g", "L": [10, 20, 30, 40]},
    ]
    ann = annotations(
        [(t, i, j, ty) for t in ("win", "lose") for (i, j, ty) in edges],
        [(t, 1, 0, 1) for t in ("win", "lose")] + [(t, 3, 1, 0) for t in ("win", "lose")],
    )
    ctx = make_ctx(trajs, ann)
    res = iapo(ctx, base_result(ctx, {"win": 1.2, "lose": -0.8}), IAPOSettings())
    f = assistant_frame(ctx, res)
    got = {(r["traj_id"], r["turn"]): r["w"] for r in f.iter_rows(named=True)}
    for k in range(4):
        assert got[("win", k + 1)] == pytest.approx(w_pos[k], rel=1e-9)
        assert got[("lose", k + 1)] == pytest.approx(w_neg[k], rel=1e-9)
    # a1 (hub of support) gets the most positive credit; a3 (the error) gets less than a2 / a4 in the win
    assert w_pos[0] > w_pos[1] > w_pos[2]
    assert w_neg[2] == max(w_neg)
    # token advantages
    adv = res.adv_per_token()
    tok_turn = ctx.steps["turn"].to_numpy()[ctx.token_steps()]
    tok_tid = np.array(ctx.trajectories["traj_id"].to_list())[ctx.token_trajs()]
    sel = ctx.tok_mask & (tok_tid == "win") & (tok_turn == 3)
    np.testing.assert_allclose(adv[sel], 1.2 * w_pos[2])
    assert sum(li * w for li, w in zip(L, w_pos, strict=True)) == pytest.approx(Lt)


def test_reference_random_graphs_large():
    """Many random trajectories at once (whole-column path) against the loop reference, to 1e-6."""
    rnd = random.Random(7)
    trajs, edges, nodes, a_hat = [], [], [], {}
    for k in range(300):
        T = rnd.randint(1, 30)
        L = [
            rnd.choice([0, rnd.randint(1, 200)]) if rnd.random() < 0.1 else rnd.randint(1, 200)
            for _ in range(T)
        ]
        if not any(L):
            L[0] = 5
        tid = f"r{k:03d}"
        trajs.append({"id": tid, "group": f"g{k // 8}", "L": L})
        for _ in range(rnd.randint(0, 3 * T)):
            i, j = rnd.randint(1, T), rnd.randint(1, T)
            edges.append((tid, min(i, j), max(i, j) + rnd.choice([0, 0, 0, 1]), rnd.choice(TYPES[:3])))
        for turn in range(1, T + 1):
            nodes.append((tid, turn, int(rnd.random() < 0.15), rnd.choice([0, 0, 0, 1])))
        a_hat[tid] = rnd.choice([-1.0, 0.0, 1.0]) * rnd.random()
    ctx, res = run(trajs, edges, nodes, a_hat)
    f = assistant_frame(ctx, res)
    w = {(r["traj_id"], r["turn"]): r["w"] for r in f.iter_rows(named=True)}
    for t in trajs:
        tid = t["id"]
        ref = reference_weights(
            t["L"],
            [(i, j, ty) for (x, i, j, ty) in edges if x == tid],
            {n[1]: n[2] for n in nodes if n[0] == tid},
            {n[1]: n[3] for n in nodes if n[0] == tid},
            a_hat[tid],
        )
        for turn, val in ref.items():
            assert abs(w[(tid, turn)] - val) <= 1e-6
