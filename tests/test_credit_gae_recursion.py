"""GAE (lam < 1 and = 1) on hypothesis-generated batches against verl's loop written out position by position,
on every path of the recursion: runs of one length (a verl-style padded batch), runs of like lengths (zero
padded rows), the log-step scan, each forced by the size threshold; observation tokens carry through."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import Config
from pipeline.credit import CreditBatch, ops, run_methods


def build(trajectories: list[list[tuple[str, int]]], seed: int) -> tuple[pa.Table, pa.Table]:
    """Trajectories as lists of (role, n_tokens) steps; critic values on the assistant tokens."""
    rng = np.random.default_rng(seed)
    ids = [f"t{i:03d}" for i in range(len(trajectories))]
    trajs = pa.table(
        {
            "traj_id": pa.array(ids, pa.string()),
            "group_id": pa.array([f"g{i // 3}" for i in range(len(ids))], pa.string()),
            "reward": pa.array(rng.normal(size=len(ids)) * 3),
        }
    )
    rows: dict[str, list] = {k: [] for k in ("traj_id", "step_idx", "role", "turn", "token_ids", "values")}
    for tid, steps in zip(ids, trajectories, strict=True):
        turn = 0
        for i, (role, n) in enumerate(steps):
            turn += role == "assistant"
            rows["traj_id"].append(tid)
            rows["step_idx"].append(i)
            rows["role"].append(role)
            rows["turn"].append(turn if role == "assistant" else None)
            rows["token_ids"].append(list(range(n)))
            rows["values"].append(rng.normal(size=n).tolist() if role == "assistant" else None)
    n_steps = len(rows["traj_id"])
    steps_table = pa.table(
        {
            "traj_id": pa.array(rows["traj_id"], pa.string()),
            "step_idx": pa.array(rows["step_idx"], pa.int32()),
            "role": pa.array(rows["role"], pa.string()),
            "turn": pa.array(rows["turn"], pa.int32()),
            "is_error": pa.array([False] * n_steps),
            "verifier_score": pa.nulls(n_steps, pa.float64()),
            "token_ids": pa.array(rows["token_ids"], pa.list_(pa.int32())),
            "values": pa.array(rows["values"], pa.list_(pa.float32())),
        }
    )
    return trajs, steps_table


def verl_loop(trajs: pa.Table, steps: pa.Table, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """verl's compute_gae_advantage_return, literally, per trajectory over its whole token sequence (mask-0
    positions carry nextvalues and lastgaelam); the reward on the last assistant token. (A, returns) on the
    assistant tokens, in order."""
    adv, ret = [], []
    traj_ids, roles = steps["traj_id"].to_pylist(), steps["role"].to_pylist()
    tokens, values = steps["token_ids"].to_pylist(), steps["values"].to_pylist()
    for tid, reward in zip(trajs["traj_id"].to_pylist(), trajs["reward"].to_pylist(), strict=True):
        toks = []  # (value, mask) per token of the trajectory
        for i in (i for i, t in enumerate(traj_ids) if t == tid):
            for j in range(len(tokens[i])):
                mask = roles[i] == "assistant"
                toks.append((float(values[i][j]) if mask else 0.0, mask))
        last = max((i for i, (_, m) in enumerate(toks) if m), default=None)
        nextvalues, lastgaelam = 0.0, 0.0
        advs = [0.0] * len(toks)
        for i in reversed(range(len(toks))):
            v, mask = toks[i]
            delta = (reward if i == last else 0.0) + gamma * nextvalues - v
            lastgaelam_ = delta + gamma * lam * lastgaelam
            if mask:
                nextvalues, lastgaelam = v, lastgaelam_
            advs[i] = lastgaelam
        for i, (v, mask) in enumerate(toks):
            if mask:
                adv.append(advs[i])
                ret.append(advs[i] + v)
    return np.array(adv), np.array(ret)


STEP = st.tuples(st.sampled_from(["assistant", "assistant", "tool", "user"]), st.integers(0, 12))
# `same`: every trajectory one assistant step of `same` tokens (the one-length rows); else free shapes
BATCH = st.one_of(
    st.tuples(st.integers(1, 6), st.integers(1, 40)).map(lambda p: [[("assistant", p[1])]] * p[0]),
    st.lists(st.lists(STEP, min_size=1, max_size=6), min_size=1, max_size=6),
)


@pytest.mark.parametrize("path", ["compiled", "scan"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=BATCH,
    gamma_lam=st.sampled_from([(0.99, 0.95), (0.5, 0.0), (0.9, 0.9), (1.0, 0.95), (0.99, 1.0), (1.0, 1.0)]),
    whiten=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_gae_matches_verls_loop(path: str, batch, gamma_lam, whiten: bool, seed: int) -> None:
    trajs, steps = build(batch, seed)
    gamma, lam = gamma_lam
    cfg = Config(stages={"gae": {"gamma": gamma, "lam": lam, "whiten": whiten}})
    old = ops._COMPILED_RECURSION_MIN
    ops._COMPILED_RECURSION_MIN = 0 if path == "compiled" else 1 << 62
    try:
        ctx = CreditBatch.from_arrow(trajs, steps, config=cfg)
        res = run_methods(ctx, ["gae"])["gae"]
    finally:
        ops._COMPILED_RECURSION_MIN = old
    A, R = verl_loop(trajs, steps, gamma, lam)
    m = ctx.tok_mask
    got_A, got_R = res.adv_per_token()[m], res.returns_per_token()[m]
    # the returns (before whitening) to rounding: the recursion's multiply-adds, in order
    np.testing.assert_allclose(got_R, R, rtol=1e-12, atol=1e-12)
    if whiten and len(A):
        A = (A - A.mean()) / np.sqrt((A.var(ddof=1) if len(A) > 1 else 0.0) + 1e-8)
        np.testing.assert_allclose(got_A, A, rtol=1e-9, atol=1e-9)  # (divided by a std as small as 1e-4)
    else:
        np.testing.assert_allclose(got_A, A, rtol=1e-12, atol=1e-12)
    assert not res.adv_per_token()[~m].any()


def test_one_length_rows_by_hand() -> None:
    # two trajectories of 3 assistant tokens, V = 0: delta = [0, 0, R]; A = [(g l)^2 R, g l R, R]
    trajs, steps = build([[("assistant", 3)], [("assistant", 3)]], seed=0)
    steps = steps.set_column(
        steps.schema.get_field_index("values"), "values", pa.array([[0.0] * 3] * 2, pa.list_(pa.float32()))
    )
    R = np.array(trajs["reward"].to_pylist())
    cfg = Config(stages={"gae": {"gamma": 0.5, "lam": 0.5, "whiten": False}})
    old = ops._COMPILED_RECURSION_MIN
    ops._COMPILED_RECURSION_MIN = 0
    try:
        ctx = CreditBatch.from_arrow(trajs, steps, config=cfg)
        res = run_methods(ctx, ["gae"])["gae"]
    finally:
        ops._COMPILED_RECURSION_MIN = old
    expect = np.concatenate([[r / 16, r / 4, r] for r in R])
    np.testing.assert_array_equal(res.adv_per_token()[ctx.tok_mask], expect)  # powers of two: exact


# ---- gamma = lam = 1: the statistics pass from the steps' value moments ----------------------------------


def _stats_batch(traj, steps):
    from pipeline.credit.registry import statistics_step_columns

    cfg = Config(methods=["gae"])
    cols = statistics_step_columns(["gae"], cfg)
    assert "values" not in cols and {"values_mean", "values_m2"} <= set(cols)
    return CreditBatch.from_arrow(traj, steps.select(cols), cols, config=cfg)


def test_telescoped_moments_by_hand():
    """R = 1; assistant steps with values [0.5, 0.25] and [0.0]: A = 1 - V = [0.5, 0.75, 1.0], n = 3,
    mean 0.75, m2 = 0.0625 + 0 + 0.0625 = 0.125."""
    from pipeline.credit.methods.gae import GAESettings, gae_statistics
    from schemas import TABLES

    traj = TABLES["trajectories"].validate(
        pa.Table.from_pylist(
            [{"round": 0, "traj_id": "t", "group_id": "g", "sample_idx": 0, "reward": 1.0, "source": "x"}],
            schema=TABLES["trajectories"].schema,
        )
    )
    rows = [("user", None, [7], None), ("assistant", 1, [1, 2], [0.5, 0.25]), ("tool", 1, [3], None)]
    rows += [("assistant", 2, [4], [0.0])]
    steps = TABLES["steps"].validate(
        pa.Table.from_pylist(
            [
                {
                    "round": 0,
                    "traj_id": "t",
                    "step_idx": i,
                    "role": role,
                    "turn": turn,
                    "content": "abcd",
                    "is_error": False,
                    "token_ids": ids,
                    "token_offsets": list(range(len(ids))),
                    "values": v,
                }
                for i, (role, turn, ids, v) in enumerate(rows)
            ],
            schema=TABLES["steps"].schema,
        )
    )
    got = gae_statistics(_stats_batch(traj, steps), GAESettings())["gae"]
    assert (got.n, got.mean, got.m2) == pytest.approx((3.0, 0.75, 0.125), abs=1e-15)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 100_000))
def test_telescoped_moments_equal_the_token_path(seed):
    """At gamma = lam = 1 the statistics pass reads the steps' value moments, not the values: its moments of A
    equal those of Eq. 1-3 over the tokens, and a missing critic value names the same trajectory."""
    from credit_rounds import random_round

    from pipeline.credit.methods.gae import GAESettings, gae_advantages, gae_statistics
    from pipeline.credit.registry import MethodError

    traj, steps = random_round(seed, max_groups=4, max_group_size=4, max_steps=6)
    if seed % 5 == 0:  # a trajectory's values missing on one assistant step
        vals = steps["values"].to_pylist()
        roles = steps["role"].to_pylist()
        hit = [i for i, (r, v) in enumerate(zip(roles, vals, strict=True)) if r == "assistant" and v]
        if hit:
            vals[hit[0]] = None
            from schemas import TABLES

            steps = TABLES["steps"].validate(
                steps.set_column(
                    steps.schema.get_field_index("values"), "values", pa.array(vals, pa.list_(pa.float32()))
                )
            )
    full = CreditBatch.from_arrow(traj, steps, None, config=Config(methods=["gae"]))
    try:
        want = gae_advantages(full, GAESettings(), "gae", moments=True).moments
    except MethodError as exc:
        with pytest.raises(MethodError) as got_exc:
            gae_statistics(_stats_batch(traj, steps), GAESettings())
        assert str(got_exc.value).split(";")[0] == str(exc).split(";")[0]
        return
    got = gae_statistics(_stats_batch(traj, steps), GAESettings())["gae"]
    want = want or ops.Moments()
    assert (got.n, got.mean, got.m2) == pytest.approx((want.n, want.mean, want.m2), rel=1e-9, abs=1e-9)


def test_moments_given_beside_the_values_are_not_trusted():
    """An in-memory steps table whose value moments disagree with its values (a caller's own, or values replaced
    after the table was built: the lake recomputes them on every write, a caller's table is not the lake's):
    the statistics pass takes the moments of the values."""
    from credit_rounds import random_round

    from pipeline.credit.methods.gae import GAESettings, gae_statistics
    from pipeline.credit.process import batch_statistics

    traj, steps = random_round(7, max_groups=3, max_group_size=3, max_steps=5)
    cfg = Config(methods=["gae"])
    want = batch_statistics(traj, steps, ["gae"], cfg)["gae"]
    assert want.n > 0
    for name in ("values_mean", "values_m2"):  # hostile moments: every step's off by 3
        col = pc.add(steps.column(name), 3.0)
        steps = steps.set_column(steps.schema.get_field_index(name), name, col)
    got = batch_statistics(traj, steps, ["gae"], cfg)["gae"]
    assert (got.n, got.mean, got.m2) == pytest.approx((want.n, want.mean, want.m2), rel=1e-12)
    assert got.mean != pytest.approx(gae_statistics(_stats_batch(traj, steps), GAESettings())["gae"].mean)
