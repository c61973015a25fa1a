"""Spec section 7 properties (GRPO / GDPO / GiGPO), hand-computed cases, edge cases, export alignment and the
`creditflow process` + `creditflow export` CLI end to end."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from credit_rounds import random_round
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import Config
from pipeline.credit import CreditBatch, MethodError, run_methods
from pipeline.credit.process import process_batch
from pipeline.export import STEP_COLUMNS, TrainLayout, build_train_batch
from schemas import steps as steps_schema
from schemas import trajectories as traj_schema


def make_round(trajs: list[dict], steps: list[dict]) -> tuple[pa.Table, pa.Table]:
    """Compact builder: trajs [{id, group, reward, [rc]}], steps [{traj, role, n | values, [score, content]}]."""
    t_rows = [
        {
            "round": 0,
            "traj_id": t["id"],
            "group_id": t["group"],
            "sample_idx": i,
            "reward": t["reward"],
            "reward_components": list(t["rc"].items()) if t.get("rc") else None,
            "source": "hand",
        }
        for i, t in enumerate(trajs)
    ]
    s_rows, idx, turn = [], {}, {}
    for s in steps:
        i = idx.get(s["traj"], 0)
        idx[s["traj"]] = i + 1
        if s["role"] == "assistant":
            turn[s["traj"]] = turn.get(s["traj"], 0) + 1
        values = s.get("values")
        n = len(values) if values is not None else s.get("n", 2)
        s_rows.append(
            {
                "round": 0,
                "traj_id": s["traj"],
                "step_idx": i,
                "role": s["role"],
                "turn": turn.get(s["traj"]) if s["role"] == "assistant" else None,
                "content": s.get("content", ""),
                "is_error": s.get("error", False),
                "token_ids": list(range(n)),
                "token_offsets": list(range(n)),
                "logprobs": None,
                "values": values,
                "verifier_score": s.get("score"),
            }
        )
    return (
        traj_schema.validate(pa.Table.from_pylist(t_rows, schema=traj_schema.SCHEMA)),
        steps_schema.validate(pa.Table.from_pylist(s_rows, schema=steps_schema.SCHEMA)),
    )


def run(traj, steps, method, **stages):
    ctx = CreditBatch.from_arrow(traj, steps, config=Config(stages=stages))
    return ctx, run_methods(ctx, [method])[method]


def per_traj(ctx, res, comp="a_hat"):
    """Per-trajectory value of a trajectory-level component (first step of each trajectory)."""
    first = ctx.steps.with_row_index("r").group_by("traj_index", maintain_order=True).agg(pl_first("r"))
    return res.components[comp][first["r"].to_numpy()]


def pl_first(col):
    import polars as pl

    return pl.col(col).first()


def simple_group(rewards, group="g", prefix="t", rc=None):
    trajs = [
        {"id": f"{prefix}{i}", "group": group, "reward": r, "rc": (rc[i] if rc else None)}
        for i, r in enumerate(rewards)
    ]
    steps = []
    for t in trajs:
        steps += [{"traj": t["id"], "role": "user", "n": 3}, {"traj": t["id"], "role": "assistant", "n": 4}]
    return trajs, steps


# ---- GRPO / RLOO hand cases and properties ---------------------------------------------------------


def test_grpo_hand_case():
    traj, steps = make_round(*simple_group([1.0, 0.0, 0.0, 1.0]))
    ctx, res = run(traj, steps, "grpo")
    np.testing.assert_allclose(per_traj(ctx, res), [0.8660239, -0.8660239, -0.8660239, 0.8660239], atol=1e-6)
    assert np.all(res.adv_per_token()[~ctx.tok_mask] == 0)
    ctx, res = run(traj, steps, "grpo", grpo={"norm_by_std": False})
    np.testing.assert_allclose(per_traj(ctx, res), [0.5, -0.5, -0.5, 0.5])


def test_rloo_hand_case():
    traj, steps = make_round(*simple_group([1.0, 0.0, 0.0, 1.0]))
    ctx, res = run(traj, steps, "rloo")
    np.testing.assert_allclose(per_traj(ctx, res), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    traj, steps = make_round(*simple_group([0.7]))
    assert per_traj(*run(traj, steps, "rloo"))[0] == pytest.approx(0.7)
    assert per_traj(*run(traj, steps, "rloo", rloo={"singleton": "zero"}))[0] == 0.0


rewards_st = st.lists(st.sampled_from([0.0, 0.25, 1.0, 3.0]), min_size=1, max_size=8)


@settings(max_examples=50, deadline=None)
@given(st.lists(rewards_st, min_size=1, max_size=4), st.sampled_from(["grpo", "rloo", "gdpo"]))
def test_group_sum_zero_equal_zero_singleton(groups, method):
    trajs, steps = [], []
    for g, rewards in enumerate(groups):
        t, s = simple_group(rewards, group=f"g{g}", prefix=f"x{g}_")
        trajs += t
        steps += s
    traj, steps_t = make_round(trajs, steps)
    ctx, res = run(traj, steps_t, method, gdpo={"whiten": "none"})
    A = per_traj(ctx, res)
    gi = ctx.traj_group
    for g in range(ctx.n_groups):
        Rg, Ag = ctx.rewards()[gi == g], A[gi == g]
        if len(Rg) > 1:
            assert abs(Ag.sum()) < 1e-6  # sum A = 0 (size > 1; all-equal gives 0 too)
            if np.all(Rg == Rg[0]):
                assert np.all(Ag == 0)
        else:
            assert Ag[0] == pytest.approx(Rg[0], rel=1e-3)  # singleton: A = R (verl)


def test_gdpo_one_component_is_batch_whitened_grpo():
    trajs, steps = simple_group([1.0, 0.0, 0.5, 0.5], group="a", prefix="a")
    t2, s2 = simple_group([2.0, 0.0, 0.0], group="b", prefix="b")
    traj, st_ = make_round(trajs + t2, steps + s2)
    _, grpo = run(traj, st_, "grpo", grpo={"eps": 1e-4})
    ctx, gdpo = run(traj, st_, "gdpo")
    a = per_traj(ctx, grpo)
    np.testing.assert_allclose(per_traj(ctx, gdpo), (a - a.mean()) / (a.std(ddof=1) + 1e-4), atol=1e-9)
    assert abs(per_traj(ctx, gdpo).sum()) < 1e-9


def test_gdpo_components_weights_and_nan():
    rc = [{"acc": 1.0, "fmt": 0.0}, {"acc": 0.0, "fmt": float("nan")}, {"acc": 1.0}]
    traj, st_ = make_round(*simple_group([0.0, 0.0, 0.0], rc=rc))
    ctx, res = run(traj, st_, "gdpo", gdpo={"whiten": "none", "weights": {"fmt": 0.0}})
    # fmt has weight 0: only acc [1, 0, 1] counts; NaN -> 0 never propagates
    np.testing.assert_allclose(per_traj(ctx, res), [0.57725, -1.1545, 0.57725], atol=1e-4)
    traj, st_ = make_round(*simple_group([5.0]))  # batch of one trajectory: no whitening, no NaN
    ctx, res = run(traj, st_, "gdpo")
    assert np.isfinite(res.adv_per_token()).all() and res.notes["singleton_batch"] == 1.0


def test_gdpo_named_components_twice_or_absent():
    """`components` names what Eq. 1-2 sum: a name given twice counts twice (its column twice in R^c, as the
    weighted sum reads it), a name no trajectory has is a column of zeros (it normalises to exactly 0)."""
    rc = [{"acc": 1.0, "fmt": 0.0}, {"acc": 0.0, "fmt": 2.0}, {"acc": 1.0}, None]
    traj, st_ = make_round(*simple_group([0.0, 1.0, 0.0, 3.0], rc=rc))

    def adv(**gdpo):
        ctx, res = run(traj, st_, "gdpo", gdpo={"whiten": "none", **gdpo})
        return per_traj(ctx, res)

    once = adv(components=["acc"])
    # acc = [1, 0, 1, 0] (the trajectory without components: 0): group mean .5, unbiased std 0.57735
    np.testing.assert_allclose(
        once, np.array([0.5, -0.5, 0.5, -0.5]) / (0.5773502691896258 + 1e-4), atol=1e-12
    )
    np.testing.assert_allclose(adv(components=["acc", "acc"]), 2 * once, atol=1e-12)
    np.testing.assert_allclose(adv(components=["acc", "absent"]), once, atol=1e-12)
    np.testing.assert_allclose(adv(components=["fmt", "acc"]), adv(components=["acc", "fmt"]), atol=1e-12)


# ---- GAE hand cases -----------------------------------------------------------------------------


def gae_round(with_obs: bool):
    steps = [
        {"traj": "t", "role": "user", "values": [9.0, 9.0]},
        {"traj": "t", "role": "assistant", "values": [0.5]},
    ]
    if with_obs:
        steps.append({"traj": "t", "role": "tool", "values": None, "n": 3})
    steps.append({"traj": "t", "role": "assistant", "values": [0.2, 0.1]})
    return make_round([{"id": "t", "group": "g", "reward": 1.0}], steps)


@pytest.mark.parametrize("with_obs", [False, True])
def test_gae_three_tokens_by_hand(with_obs):
    traj, steps = gae_round(with_obs)
    ctx, res = run(traj, steps, "gae", gae={"whiten": False})
    m = ctx.tok_mask
    # delta = [0 + .2 - .5, 0 + .1 - .2, 1 - .1] = [-.3, -.1, .9]; gamma = lam = 1: A = [.5, .8, .9]
    np.testing.assert_allclose(res.adv_per_token()[m], [0.5, 0.8, 0.9], atol=1e-12)
    np.testing.assert_allclose(res.returns_per_token()[m], [1.0, 1.0, 1.0], atol=1e-12)
    ctx, res = run(traj, steps, "gae", gae={"whiten": False, "gamma": 0.9, "lam": 0.5})
    # delta = [.18 - .5, .09 - .2, .9]; A3 = .9, A2 = -.11 + .45 * .9 = .295, A1 = -.32 + .45 * .295
    np.testing.assert_allclose(res.adv_per_token()[m], [-0.18725, 0.295, 0.9], atol=1e-12)
    np.testing.assert_allclose(res.returns_per_token()[m], [-0.18725 + 0.5, 0.495, 1.0], atol=1e-12)
    ctx, res = run(traj, steps, "gae")  # whitened advantages, returns still before whitening
    a = np.array([-0.18725, 0.295, 0.9]) if False else np.array([0.5, 0.8, 0.9])
    np.testing.assert_allclose(
        res.adv_per_token()[m], (a - a.mean()) / np.sqrt(a.var(ddof=1) + 1e-8), atol=1e-9
    )
    np.testing.assert_allclose(res.returns_per_token()[m], [1.0, 1.0, 1.0], atol=1e-12)
    assert np.all(res.adv_per_token()[~m] == 0)


def test_gae_missing_values_names_trajectory():
    traj, steps = make_round(
        [{"id": "no-critic", "group": "g", "reward": 1.0}],
        [{"traj": "no-critic", "role": "assistant", "n": 3}],
    )
    with pytest.raises(MethodError, match="no-critic"):
        run(traj, steps, "gae")


def test_turn_ppo_by_hand():
    traj, steps = gae_round(True)
    ctx, res = run(traj, steps, "turn_ppo", turn_ppo={"whiten": False, "gamma": 1.0, "lam": 1.0})
    # turns: V = [.5, .2]; delta = [.2 - .5, 1 - .2] = [-.3, .8]; A = [.5, .8]
    np.testing.assert_allclose(res.adv_per_token()[ctx.tok_mask], [0.5, 0.8, 0.8], atol=1e-12)
    np.testing.assert_allclose(res.returns_per_token()[ctx.tok_mask], [1.0, 1.0, 1.0], atol=1e-12)


# ---- MT-GRPO ------------------------------------------------------------------------------------


def test_mt_grpo_aae_by_hand():
    trajs = [{"id": "a", "group": "g", "reward": 1.0}, {"id": "b", "group": "g", "reward": 0.0}]
    steps = []
    for t, score in (("a", 1.0), ("b", 0.0)):
        steps += [
            {"traj": t, "role": "assistant", "score": score},
            {"traj": t, "role": "tool"},
            {"traj": t, "role": "assistant", "score": 0.0},
        ]
    traj, st_ = make_round(trajs, steps)
    ctx, res = run(traj, st_, "mt_grpo")
    a_hat = res.components["a_hat"]
    z = 0.5 / (np.sqrt(0.5) + 1e-4)  # (1 - .5) / (std_unbiased([1, 0]) + 1e-4)
    np.testing.assert_allclose(a_hat[[0, 2, 3, 5]], [2 * z, z, -2 * z, -z])  # turn 1: A^O + A^T; later: A^O


# ---- GiGPO properties ---------------------------------------------------------------------------


def gigpo_round(seed):
    return random_round(seed, max_groups=3, max_group_size=5, max_steps=8, components=False, values=False)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_gigpo_omega_zero_is_episode_term(seed):
    traj, steps = gigpo_round(seed)
    _, res = run(traj, steps, "gigpo", gigpo={"step_advantage_w": 0.0})
    np.testing.assert_allclose(res.components["a_hat"], res.components["a_episode"], equal_nan=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_gigpo_singleton_step_groups_and_shared_anchors(seed, similarity):
    traj, steps = gigpo_round(seed)
    ctx, res = run(traj, steps, "gigpo", gigpo={"enable_similarity": similarity})
    from pipeline.credit.methods.gigpo import anchor_observations, step_groups

    rows = anchor_observations(ctx)
    sg = step_groups(rows, similarity, 0.9)
    a_step = res.components["a_step"][rows.step_row]
    sizes = np.bincount(sg)[sg]
    assert np.all(a_step[sizes == 1] == 0)  # singleton step groups contribute 0
    key = list(zip(rows.group_index.tolist(), rows.anchor.to_pylist(), strict=True))
    for i in range(len(key)):  # identical anchors within a prompt group share a step group
        for j in range(len(key)):
            if key[i] == key[j]:
                assert sg[i] == sg[j]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 10_000),
    st.lists(st.sampled_from(["a", "b", "a\nb", "", None, "page 1"]), min_size=1, max_size=6),
)
def test_gigpo_anchors_match_a_plain_loop(seed, contents):
    _anchor_case(seed, contents)


def _anchor_case(seed, contents):
    """anchor_observations against a loop over the steps (the non-assistant contents since the previous assistant
    step, nulls skipped, joined by newlines), with null, empty and newline-holding contents and runs of several
    observation steps; exact step groups are the (prompt group, anchor) pairs numbered by first appearance."""
    import polars as pl

    from pipeline.credit.methods.gigpo import anchor_observations, step_groups

    traj, steps = gigpo_round(seed)
    rng = np.random.default_rng(seed)
    content = [contents[i] for i in rng.integers(0, len(contents), steps.num_rows)]
    steps = steps.set_column(steps.column_names.index("content"), "content", pa.array(content, pa.string()))
    ctx = CreditBatch.from_arrow(traj, steps)
    expect, parts, prev = [], [], None
    for row, (t, is_asst, text) in enumerate(
        zip(
            ctx.step_traj.tolist(),
            ctx.steps["is_assistant"].to_list(),
            ctx.steps["content"].to_list(),
            strict=True,
        )
    ):
        if t != prev:
            parts, prev = [], t
        if is_asst:
            expect.append((row, "\n".join(p for p in parts if p is not None)))
            parts = []
        else:
            parts.append(text)
    rows = anchor_observations(ctx)
    assert list(zip(rows.step_row.tolist(), rows.anchor.to_pylist(), strict=True)) == expect
    turns = rows.frame().with_columns(pl.int_range(pl.len()).over("traj_index").alias("k"))
    assert turns["turns_before"].to_list() == turns["k"].to_list()
    assert turns["anchor"].to_list() == [text for _, text in expect]
    pairs = list(zip(rows.group_index.tolist(), rows.anchor.to_pylist(), strict=True))
    first = {}
    for key in pairs:
        first.setdefault(key, len(first))
    assert step_groups(rows, False, 0.9).tolist() == [first[k] for k in pairs]


def test_gigpo_by_hand():
    trajs = [{"id": "a", "group": "g", "reward": 1.0}, {"id": "b", "group": "g", "reward": 0.0}]
    steps = []
    for t, s1, s2, obs in (("a", 0.0, 1.0, "page 1"), ("b", 0.0, 0.0, "page 1")):
        steps += [
            {"traj": t, "role": "user", "content": "find x"},
            {"traj": t, "role": "assistant", "score": s1},
            {"traj": t, "role": "tool", "content": obs},
            {"traj": t, "role": "assistant", "score": s2},
        ]
    traj, st_ = make_round(trajs, steps)
    ctx, res = run(traj, st_, "gigpo", gigpo={"mode": "mean_norm"})
    c = res.components
    rows = [1, 3, 5, 7]
    np.testing.assert_allclose(c["a_episode"][rows], [0.5, 0.5, -0.5, -0.5])
    np.testing.assert_allclose(c["score"][rows], [0.95, 1.0, 0.0, 0.0])  # G = r + 0.95 * G_next
    np.testing.assert_allclose(c["a_step"][rows], [0.475, 0.5, -0.475, -0.5])


# ---- edge cases: every estimator ------------------------------------------------------------------


def _estimators_without_annotations() -> list[str]:
    """Every registered estimator that reads no annotation table (those are covered with their stages): the
    list follows the registry, so a new estimator is checked here without editing this file."""
    import pipeline.credit  # noqa: F401  (registers the methods)
    from pipeline.credit.registry import ESTIMATORS

    return sorted(name for name, stage in ESTIMATORS.items() if not stage.needs)


ALL = _estimators_without_annotations()


def test_the_edge_case_list_covers_the_registry():
    assert {"grpo", "dr_grpo", "rloo", "gdpo", "gae", "turn_ppo", "mt_grpo", "gigpo"} <= set(ALL)
    assert "tcpo" not in ALL  # reads counterfactuals


@pytest.mark.parametrize("method", ALL)
def test_edge_cases(method):
    trajs = [
        {"id": "only-user", "group": "g1", "reward": 1.0},
        {"id": "empty-turn", "group": "g1", "reward": 0.0},
        {"id": "solo", "group": "g2", "reward": 0.5},
        {"id": "no-steps", "group": "g1", "reward": 1.0},
    ]
    steps = [
        {"traj": "only-user", "role": "user", "values": [0.1, 0.2]},
        {"traj": "empty-turn", "role": "assistant", "values": []},
        {"traj": "empty-turn", "role": "tool", "values": [0.3]},
        {"traj": "empty-turn", "role": "assistant", "values": [0.4, 0.5]},
        {"traj": "solo", "role": "assistant", "values": [0.1], "score": 1.0},
    ]
    traj, st_ = make_round(trajs, steps)
    # the TCPO variants score a turn without a verifier score 0 here (their default stops the round)
    tables, _ = process_batch(traj, st_, [method], Config(stages={"tcpo": {"missing_score": "zero"}}))
    table = tables[method]
    assert table.num_rows == 5
    lens = [len(x) for x in table.column("token_adv").to_pylist()]
    assert lens == [0, 1, 2, 2, 1]  # sorted by traj_id: empty-turn (3 steps), only-user, solo
    flat = np.concatenate([np.asarray(x, float) for x in table.column("token_adv").to_pylist() if x])
    assert np.isfinite(flat).all()
    roles = table.column("role").to_pylist()
    for role, adv in zip(roles, table.column("token_adv").to_pylist(), strict=True):
        if role != "assistant":
            assert all(a == 0 for a in adv)


# ---- export: every advantage lands on its token -----------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["gae", "gigpo", "grpo"]))
def test_export_alignment(seed, method):
    traj, steps = random_round(seed, max_groups=3, max_group_size=4, max_steps=6)
    adv = process_batch(traj, steps, [method])[0][method]
    batch = build_train_batch(traj, steps, adv)
    # the rows' order in the inputs does not matter (sorted inputs skip the sort, shuffled ones take it)
    rng = np.random.default_rng(seed)
    shuffled = build_train_batch(
        traj, steps.take(rng.permutation(steps.num_rows)), adv.take(rng.permutation(adv.num_rows))
    )
    assert shuffled.equals(batch)
    steps_sorted = steps.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
    adv_sorted = adv.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
    by_traj: dict[str, dict[str, list]] = {}
    for s, a in zip(steps_sorted.to_pylist(), adv_sorted.to_pylist(), strict=True):
        d = by_traj.setdefault(s["traj_id"], {"ids": [], "adv": [], "mask": [], "values": [], "returns": []})
        n = len(s["token_ids"])
        d["ids"] += s["token_ids"]
        d["adv"] += a["token_adv"]
        d["mask"] += [int(s["role"] == "assistant")] * n
        d["values"] += s["values"] if s["values"] is not None else [0.0] * n
        d["returns"] += a["token_returns"] if a["token_returns"] is not None else [0.0] * n
    assert sorted(by_traj) == batch.column("traj_id").to_pylist()
    for row in batch.to_pylist():
        d = by_traj[row["traj_id"]]
        assert row["input_ids"] == d["ids"]
        assert row["loss_mask"] == d["mask"]
        np.testing.assert_array_equal(np.float32(row["advantages"]), np.float32(d["adv"]))
        if method == "gae":
            np.testing.assert_allclose(row["values"], d["values"], rtol=1e-6)
            np.testing.assert_allclose(row["returns"], d["returns"], rtol=1e-6)
            # critic targets: returns = A_pre_whitening + V on assistant tokens
            m = np.array(d["mask"], bool)
            if m.any():
                assert np.all(np.array(row["returns"])[~m] == 0)
        else:
            assert row["returns"] is None


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.permutations(["gae", "grpo", "gigpo", "rloo"]))
def test_export_layout_shared_by_methods(seed, methods):
    """One TrainLayout per batch serves every method (what the export stage does): each method's table equals the
    one built from scratch for it, whatever the order (values are laid out only for methods with returns), and
    the layout needs only the steps columns it names."""
    traj, steps = random_round(seed, max_groups=3, max_group_size=4, max_steps=6)
    tables = process_batch(traj, steps, methods)[0]
    shared = TrainLayout(traj, steps.select(STEP_COLUMNS))
    for method in methods:
        got = shared.table(tables[method])
        fresh = build_train_batch(traj, steps, tables[method])
        assert got.equals(fresh), method
        assert got.column("method").to_pylist() == [method] * got.num_rows
        with_returns = method == "gae"
        assert (got.column("values").null_count == 0) == with_returns or got.num_rows == 0
        assert (got.column("returns").null_count == 0) == with_returns or got.num_rows == 0
    # another batch's advantages do not fit this layout: a clear error, not a silent misalignment
    other_traj, other_steps = random_round(seed + 1, max_groups=3, max_group_size=4, max_steps=6)
    other = process_batch(other_traj, other_steps, ["grpo"])[0]["grpo"]
    if not other.select(["traj_id", "step_idx"]).equals(tables["grpo"].select(["traj_id", "step_idx"])):
        with pytest.raises(ValueError, match="do not cover the same steps|misaligned"):
            shared.table(other)


# ---- CLI end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_process_and_export(tmp_path, lake, prefect_harness):
    from typer.testing import CliRunner

    from flows.cli import app
    from warehouse.rounds import write_round

    traj, steps = random_round(7, max_groups=5, max_group_size=4, max_steps=6, round_=3)
    write_round(lake, 3, traj, steps, batch_groups=2)
    runner = CliRunner()
    r = runner.invoke(
        app,
        [
            "process",
            "--lake",
            str(lake.root),
            "--round",
            "3",
            "--methods",
            "grpo,gae,gigpo,gdpo,rloo,mt_grpo,turn_ppo",
            "--set",
            "grpo.norm_by_std=false",
        ],
    )
    assert r.exit_code == 0, r.output
    adv = lake.read("advantages", 3)
    assert set(adv.column("method").to_pylist()) == {
        "grpo",
        "gae",
        "gigpo",
        "gdpo",
        "rloo",
        "mt_grpo",
        "turn_ppo",
    }
    grpo = adv.filter(pa.compute.equal(adv.column("method"), "grpo"))
    expect = process_batch(traj, steps, ["dr_grpo"])[0]["dr_grpo"]
    got = {
        (t, s): a
        for t, s, a in zip(
            *(grpo.column(c).to_pylist() for c in ("traj_id", "step_idx", "token_adv")), strict=True
        )
    }
    for t, s, a in zip(
        *(expect.column(c).to_pylist() for c in ("traj_id", "step_idx", "token_adv")), strict=True
    ):
        assert got[(t, s)] == a  # --set grpo.norm_by_std=false is Dr.GRPO, batch by batch == whole round

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"lake: {lake.root}\nmethods: [gae]\nstages:\n  gae:\n    gamma: 0.5\n    whiten: false\n")
    r = runner.invoke(app, ["process", "--round", "3", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    out = tmp_path / "gae.parquet"
    r = runner.invoke(
        app, ["export", "--lake", str(lake.root), "--round", "3", "--method", "gae", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    batch = pq.read_table(out)
    ref = build_train_batch(
        traj,
        steps,
        process_batch(traj, steps, ["gae"], Config(stages={"gae": {"gamma": 0.5, "whiten": False}}))[0][
            "gae"
        ],
    )
    assert batch.column("traj_id").to_pylist() == ref.column("traj_id").to_pylist()
    for col in ("advantages", "returns", "values", "input_ids", "loss_mask"):
        assert batch.column(col).to_pylist() == ref.column(col).to_pylist(), col
    r = runner.invoke(app, ["process", "--lake", str(lake.root), "--round", "3", "--set", "grpo.bogus=1"])
    assert r.exit_code != 0
