"""The oracle: a plain per-trajectory Python reference of every estimator, written from the spec with loops
(never calling the engine), checked against the vectorized engine to 1e-6 on random rounds."""

from __future__ import annotations

import difflib
import math
import statistics

import numpy as np
import pytest
from credit_rounds import random_round
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import Config
from pipeline.credit import CreditBatch, run_methods
from pipeline.credit.process import advantages_table

# ---- plain-Python view of a round -------------------------------------------------------------------


def load(traj_table, steps_table):
    trajs = sorted(traj_table.to_pylist(), key=lambda t: t["traj_id"])
    by_traj = {t["traj_id"]: [] for t in trajs}
    for s in steps_table.to_pylist():
        by_traj[s["traj_id"]].append(s)
    for v in by_traj.values():
        v.sort(key=lambda s: s["step_idx"])
    groups = {}
    for t in trajs:
        groups.setdefault(t["group_id"], []).append(t)
    return trajs, by_traj, groups


def norm(xs, eps, singleton_identity=True, by_std=True):
    """(x - mean) / (std_unbiased + eps); a single element gets verl's mean 0, std 1: x / (1 + eps)."""
    if len(xs) == 1:
        return [(xs[0] / (1 + eps) if by_std else xs[0]) if singleton_identity else 0.0]
    m = sum(xs) / len(xs)
    sd = statistics.stdev(xs)
    return [(x - m) / (sd + eps) if by_std else x - m for x in xs]


def token_layout(trajs, by_traj, per_step_adv):
    """Flatten {(traj_id, step_idx): [adv per token]} in engine order; non-assistant tokens 0."""
    out = []
    for t in trajs:
        for s in by_traj[t["traj_id"]]:
            n = len(s["token_ids"])
            vals = per_step_adv.get((t["traj_id"], s["step_idx"]))
            if s["role"] != "assistant" or vals is None:
                out += [0.0] * n
            else:
                out += list(vals) if isinstance(vals, list) else [vals] * n
    return np.array(out, dtype=np.float64)


def whiten_list(xs):
    """verl masked_whiten over a flat list: Bessel var, rsqrt(var + 1e-8)."""
    if not xs:
        return []
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
    return [(x - m) / math.sqrt(var + 1e-8) for x in xs]


# ---- reference estimators ---------------------------------------------------------------------------


def ref_grpo(trajs, by_traj, groups, eps=1e-6, by_std=True):
    A = {}
    for members in groups.values():
        for t, a in zip(members, norm([t["reward"] for t in members], eps, by_std=by_std), strict=True):
            A[t["traj_id"]] = a
    return {(t["traj_id"], s["step_idx"]): A[t["traj_id"]] for t in trajs for s in by_traj[t["traj_id"]]}


def ref_rloo(trajs, by_traj, groups):
    A = {}
    for members in groups.values():
        for t in members:
            others = [o["reward"] for o in members if o is not t]
            A[t["traj_id"]] = t["reward"] - (sum(others) / len(others) if others else 0.0)
    return {(t["traj_id"], s["step_idx"]): A[t["traj_id"]] for t in trajs for s in by_traj[t["traj_id"]]}


def ref_gdpo(trajs, by_traj, groups, eps=1e-4, weights=None, whiten="trajectories"):
    weights = weights or {}
    names = sorted({k for t in trajs for k, _ in (t["reward_components"] or [])})
    comp = {}
    for t in trajs:
        d = dict(t["reward_components"] or [])
        if names:
            comp[t["traj_id"]] = {c: (0.0 if d.get(c) is None or math.isnan(d[c]) else d[c]) for c in names}
        else:
            comp[t["traj_id"]] = {"reward": t["reward"]}
    names = names or ["reward"]
    pre = {t["traj_id"]: 0.0 for t in trajs}
    for c in names:
        for members in groups.values():
            for t, a in zip(members, norm([comp[t["traj_id"]][c] for t in members], eps), strict=True):
                pre[t["traj_id"]] += weights.get(c, 1.0) * a
    ids = [t["traj_id"] for t in trajs]
    if whiten == "trajectories" and len(ids) >= 2:
        vals = [pre[i] for i in ids]
        m, sd = sum(vals) / len(vals), statistics.stdev(vals)
        A = {i: (pre[i] - m) / (sd + eps) for i in ids}
    elif whiten == "tokens":
        flat = []
        for t in trajs:
            n = sum(len(s["token_ids"]) for s in by_traj[t["traj_id"]] if s["role"] == "assistant")
            flat += [pre[t["traj_id"]]] * n
        if flat:
            m = sum(flat) / len(flat)
            var = sum((x - m) ** 2 for x in flat) / (len(flat) - 1) if len(flat) > 1 else 0.0
            A = {i: (pre[i] - m) / math.sqrt(var + 1e-8) for i in ids}
        else:
            A = pre
    else:
        A = pre
    return {(t["traj_id"], s["step_idx"]): A[t["traj_id"]] for t in trajs for s in by_traj[t["traj_id"]]}


def ref_gae(trajs, by_traj, gamma=1.0, lam=1.0, whiten=True):
    """verl's loop, literally, over each trajectory's full token sequence (mask-0 positions carry)."""
    adv, ret = {}, {}
    for t in trajs:
        toks = []  # (step_idx, value, mask)
        for s in by_traj[t["traj_id"]]:
            for j in range(len(s["token_ids"])):
                mask = s["role"] == "assistant"
                toks.append((s["step_idx"], s["values"][j] if mask else 0.0, mask))
        last = max((i for i, x in enumerate(toks) if x[2]), default=None)
        nextvalues, lastgaelam = 0.0, 0.0
        advs = [0.0] * len(toks)
        for i in reversed(range(len(toks))):
            r = t["reward"] if i == last else 0.0
            _, v, mask = toks[i]
            delta = r + gamma * nextvalues - v
            lastgaelam_ = delta + gamma * lam * lastgaelam
            if mask:
                nextvalues, lastgaelam = v, lastgaelam_
            advs[i] = lastgaelam
        for i, (step, v, mask) in enumerate(toks):
            if mask:
                adv.setdefault((t["traj_id"], step), []).append(advs[i])
                ret.setdefault((t["traj_id"], step), []).append(advs[i] + v)
    if whiten:
        keys = [
            (t["traj_id"], s["step_idx"])
            for t in trajs
            for s in by_traj[t["traj_id"]]
            if (t["traj_id"], s["step_idx"]) in adv
        ]
        flat = whiten_list([a for k in keys for a in adv[k]])
        pos = 0
        for k in keys:
            n = len(adv[k])
            adv[k], pos = flat[pos : pos + n], pos + n
    return adv, ret


def ref_turn_ppo(trajs, by_traj, gamma=0.99, lam=0.9, turn_reward="outcome", whiten=True):
    adv, ret = {}, {}
    for t in trajs:
        turns = [s for s in by_traj[t["traj_id"]] if s["role"] == "assistant" and s["token_ids"]]
        A_next, V_next = 0.0, 0.0
        for h in reversed(range(len(turns))):
            s = turns[h]
            V = s["values"][0]
            if turn_reward == "outcome":
                r = t["reward"] if h == len(turns) - 1 else 0.0
            else:
                r = s["verifier_score"] if s["verifier_score"] is not None else 0.0
            delta = r + gamma * V_next - V
            A = delta + gamma * lam * A_next
            adv[(t["traj_id"], s["step_idx"])] = [A] * len(s["token_ids"])
            ret[(t["traj_id"], s["step_idx"])] = [A + V] * len(s["token_ids"])
            A_next, V_next = A, V
    if whiten:
        keys = [
            (t["traj_id"], s["step_idx"])
            for t in trajs
            for s in by_traj[t["traj_id"]]
            if (t["traj_id"], s["step_idx"]) in adv
        ]
        flat = whiten_list([a for k in keys for a in adv[k]])
        pos = 0
        for k in keys:
            n = len(adv[k])
            adv[k], pos = flat[pos : pos + n], pos + n
    return adv, ret


def ref_mt_grpo(
    trajs, by_traj, groups, mode="aae", lam=1.0, cae_gamma=1.0, eps=1e-4, turn_reward="verifier_score"
):
    out = {}
    if mode == "kturn":
        A_O = {}
        for members in groups.values():
            for t, a in zip(members, norm([t["reward"] for t in members], eps), strict=True):
                A_O[t["traj_id"]] = a
        for members in groups.values():
            per_turn = {}
            for t in members:
                for s in by_traj[t["traj_id"]]:
                    if s["role"] == "assistant":
                        r = s["verifier_score"] if s["verifier_score"] is not None else 0.0
                        per_turn.setdefault(s["turn"], []).append(((t["traj_id"], s["step_idx"]), r))
            for items in per_turn.values():
                for (key, _), a in zip(items, norm([r for _, r in items], eps), strict=True):
                    out[key] = A_O[key[0]] + lam * a
        return out
    for members in groups.values():
        R_O = [t["reward"] for t in members]
        R_T = []
        for t in members:
            if turn_reward == "tool_ok":  # the first tool result: 1 when it is no error (none: 0)
                first = next((s for s in by_traj[t["traj_id"]] if s["role"] == "tool"), None)
                R_T.append(0.0 if first is None else float(not first["is_error"]))
                continue
            first = next((s for s in by_traj[t["traj_id"]] if s["role"] == "assistant"), None)
            R_T.append(first["verifier_score"] if first and first["verifier_score"] is not None else 0.0)
        A_O, A_T = norm(R_O, eps), norm(R_T, eps)
        if mode == "aae":
            combined = norm([a + b for a, b in zip(R_T, R_O, strict=True)], eps)
        else:
            combined = norm([a + cae_gamma * b for a, b in zip(R_T, R_O, strict=True)], eps)
        for j, t in enumerate(members):
            steps = by_traj[t["traj_id"]]
            has_tool = any(s["role"] == "tool" for s in steps)
            seen_tool = False
            for s in steps:
                if s["role"] == "tool":
                    seen_tool = True
                if s["role"] != "assistant":
                    continue
                if not has_tool:
                    a = combined[j]
                elif not seen_tool:
                    a = A_O[j] + lam * A_T[j] if mode == "aae" else combined[j]
                else:
                    a = A_O[j]
                out[(t["traj_id"], s["step_idx"])] = a
    return out


def ref_gigpo(
    trajs,
    by_traj,
    groups,
    mode="mean_std_norm",
    eps=1e-6,
    gamma=0.95,
    omega=1.0,
    penalty=0.1,
    similarity=False,
    thresh=0.9,
):
    out = {}
    for members in groups.values():
        rows = []  # (traj_id, step_idx, R, anchor, G)
        for t in members:
            anchor_parts, turns = [], []
            for s in by_traj[t["traj_id"]]:
                if s["role"] == "assistant":
                    r = (s["verifier_score"] if s["verifier_score"] is not None else 0.0) - penalty * s[
                        "is_error"
                    ]
                    turns.append([s["step_idx"], "\n".join(anchor_parts), r])
                    anchor_parts = []
                else:
                    anchor_parts.append(s["content"])
            G = 0.0
            for k in reversed(range(len(turns))):
                G = turns[k][2] + gamma * G
                turns[k].append(G)
            rows += [(t["traj_id"], st_, t["reward"], anc, G) for st_, anc, _, G in turns]
        if not rows:
            continue
        Rs = [r[2] for r in rows]
        if len(members) < 2 or len(rows) < 2:
            mu, sigma = 0.0, 1.0
        else:
            mu, sigma = sum(Rs) / len(Rs), statistics.stdev(Rs)
        # step groups
        reps, cluster_of = [], []
        for r in rows:
            if similarity:
                c = next(
                    (
                        i
                        for i, rep in enumerate(reps)
                        if rep == r[3] or difflib.SequenceMatcher(None, r[3], rep).ratio() >= thresh
                    ),
                    None,
                )
            else:
                c = next((i for i, rep in enumerate(reps) if rep == r[3]), None)
            if c is None:
                reps.append(r[3])
                c = len(reps) - 1
            cluster_of.append(c)
        for j, r in enumerate(rows):
            A_E = (r[2] - mu) / (sigma + eps) if mode == "mean_std_norm" else r[2] - mu
            peers = [rows[i][4] for i in range(len(rows)) if cluster_of[i] == cluster_of[j]]
            if len(peers) < 2:
                A_S = 0.0
            else:
                m = sum(peers) / len(peers)
                A_S = (r[4] - m) / (statistics.stdev(peers) + eps) if mode == "mean_std_norm" else r[4] - m
            out[(r[0], r[1])] = A_E + omega * A_S
    return out


# ---- engine vs reference ----------------------------------------------------------------------------


def engine(traj, steps, method, stages=None):
    ctx = CreditBatch.from_arrow(traj, steps, config=Config(stages=stages or {}))
    return ctx, run_methods(ctx, [method])[method]


def check(traj, steps, method, ref_per_step, stages=None, ref_returns=None):
    ctx, res = engine(traj, steps, method, stages)
    trajs, by_traj, _ = load(traj, steps)
    expect = token_layout(trajs, by_traj, ref_per_step)
    np.testing.assert_allclose(res.adv_per_token(), expect, rtol=1e-6, atol=1e-6)
    if ref_returns is not None:
        np.testing.assert_allclose(
            np.where(ctx.tok_mask, res.returns_per_token(), 0.0),
            token_layout(trajs, by_traj, ref_returns),
            rtol=1e-6,
            atol=1e-6,
        )
    # the stored table (float32) carries the same numbers, step by step
    table = advantages_table(ctx, method, res)
    stored = np.concatenate(
        [np.asarray(x, dtype=np.float64) for x in table.column("token_adv").to_pylist()] or [[]]
    )
    np.testing.assert_allclose(stored, expect, rtol=1e-5, atol=1e-5)


ROUNDS = st.builds(
    random_round,
    seed=st.integers(0, 2**31 - 1),
    max_groups=st.integers(1, 5),
    max_group_size=st.integers(1, 5),
    max_steps=st.integers(0, 8),
    max_tokens=st.integers(0, 5),
)
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(ROUNDS, st.booleans())
def test_grpo_matches_reference(round_, by_std):
    traj, steps = round_
    trajs, by_traj, groups = load(traj, steps)
    check(
        traj,
        steps,
        "grpo",
        ref_grpo(trajs, by_traj, groups, by_std=by_std),
        {"grpo": {"norm_by_std": by_std}},
    )


@SETTINGS
@given(ROUNDS)
def test_rloo_matches_reference(round_):
    traj, steps = round_
    trajs, by_traj, groups = load(traj, steps)
    check(traj, steps, "rloo", ref_rloo(trajs, by_traj, groups))


@SETTINGS
@given(ROUNDS, st.sampled_from(["trajectories", "tokens", "none"]), st.booleans())
def test_gdpo_matches_reference(round_, whiten, weighted):
    traj, steps = round_
    trajs, by_traj, groups = load(traj, steps)
    weights = {"acc": 2.0, "fmt": 0.5} if weighted else {}
    check(
        traj,
        steps,
        "gdpo",
        ref_gdpo(trajs, by_traj, groups, weights=weights, whiten=whiten),
        {"gdpo": {"whiten": whiten, "weights": weights}},
    )


@SETTINGS
@given(ROUNDS, st.sampled_from([(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.9, 1.0)]), st.booleans())
def test_gae_matches_reference(round_, gamma_lam, whiten):
    traj, steps = round_
    trajs, by_traj, _ = load(traj, steps)
    gamma, lam = gamma_lam
    adv, ret = ref_gae(trajs, by_traj, gamma, lam, whiten)
    check(traj, steps, "gae", adv, {"gae": {"gamma": gamma, "lam": lam, "whiten": whiten}}, ref_returns=ret)


@SETTINGS
@given(ROUNDS, st.sampled_from(["outcome", "verifier_score"]), st.booleans())
def test_turn_ppo_matches_reference(round_, turn_reward, whiten):
    traj, steps = round_
    trajs, by_traj, _ = load(traj, steps)
    adv, ret = ref_turn_ppo(trajs, by_traj, turn_reward=turn_reward, whiten=whiten)
    check(
        traj,
        steps,
        "turn_ppo",
        adv,
        {"turn_ppo": {"turn_reward": turn_reward, "whiten": whiten}},
        ref_returns=ret,
    )


@SETTINGS
@given(
    ROUNDS,
    st.sampled_from(["aae", "cae", "kturn"]),
    st.sampled_from([1.0, 0.5]),
    st.sampled_from(["verifier_score", "tool_ok"]),
)
def test_mt_grpo_matches_reference(round_, mode, lam, turn_reward):
    traj, steps = round_
    trajs, by_traj, groups = load(traj, steps)
    check(
        traj,
        steps,
        "mt_grpo",
        ref_mt_grpo(trajs, by_traj, groups, mode=mode, lam=lam, cae_gamma=0.7, turn_reward=turn_reward),
        {"mt_grpo": {"mode": mode, "turn_advantage_coef": lam, "cae_gamma": 0.7, "turn_reward": turn_reward}},
    )


@SETTINGS
@given(
    ROUNDS, st.sampled_from(["mean_std_norm", "mean_norm"]), st.booleans(), st.sampled_from([1.0, 0.0, 0.5])
)
def test_gigpo_matches_reference(round_, mode, similarity, omega):
    traj, steps = round_
    trajs, by_traj, groups = load(traj, steps)
    ref = ref_gigpo(trajs, by_traj, groups, mode=mode, omega=omega, similarity=similarity, thresh=0.8)
    check(
        traj,
        steps,
        "gigpo",
        ref,
        {
            "gigpo": {
                "mode": mode,
                "step_advantage_w": omega,
                "enable_similarity": similarity,
                "similarity_thresh": 0.8,
            }
        },
    )


@pytest.mark.parametrize("method", ["grpo", "rloo", "gdpo", "gae", "turn_ppo", "mt_grpo", "gigpo"])
def test_empty_batch(method):
    traj, steps = random_round(0, max_groups=1)
    traj, steps = traj.slice(0, 0), steps.slice(0, 0)
    ctx, res = engine(traj, steps, method)
    assert res.adv_per_token().shape == (0,)
    assert advantages_table(ctx, method, res).num_rows == 0
