"""bench/learning.py (issue 27): the statistics on hand-computed cases, and the `--quick` smoke run through the
real loop (it asserts that the loop ran and recorded curves and train_metrics, never a direction)."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench():
    spec = importlib.util.spec_from_file_location("bench_learning", ROOT / "bench" / "learning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_statistics_hand_computed():
    b = bench()
    assert b.auc([0.0, 1.0]) == 0.5 and b.auc([0.2, 0.4, 0.6]) == pytest.approx(0.4)
    assert b.rounds_to([0.0, 0.9, 0.9, 0.9], 0.8) == 3  # 3-round average 0.9 first at round 3
    assert b.rounds_to([0.0, 0.5, 0.6], 0.8) is None
    m, h = b.mean_ci([1.0, 2.0, 3.0])  # sd 1, t(2) = 4.303
    assert m == 2.0 and h == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(b.mean_ci([1.0])[1])
    assert b.sign_p(5, 0) == pytest.approx(2 / 32) and b.sign_p(0, 0) == 1.0


@pytest.mark.slow
def test_quick_runs_the_loop_and_records_curves(tmp_path):
    out = tmp_path / "runs"
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "learning.py"), "--quick", "--out", str(out), "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = json.loads((out / "curves.json").read_text())
    assert {r["env"] for r in runs} == {"c3_search", "tcpo_refine", "iapo_service"}
    assert len(runs) == 6 and all(r["rc"] == 0 for r in runs)
    for r in runs:
        assert len(r["success"]) == 3 and all(0.0 <= x <= 1.0 for x in r["success"])
        assert len(r["train_steps"]) == 3 and all(n > 0 for n in r["train_steps"])  # train_metrics per round
    # the lake's learning_curve view (what the report can chart) agrees with the bench's own reading
    from warehouse.catalog import query
    from warehouse.lake import Lake

    first = runs[0]
    view = query(
        Lake(Path(first["dir"]) / "lake"), "SELECT round, success_rate, train_steps FROM learning_curve"
    )
    assert view.column("success_rate").to_pylist() == pytest.approx(first["success"])
    assert view.column("train_steps").to_pylist() == first["train_steps"]
    tcpo = next(r for r in runs if r["arm"] == "tcpo")
    assert tcpo["counterfactuals"]["ok"] > 0  # the policy server answered TCPO's counterfactual stage
    assert "Paired by seed" in res.stdout and "c3_search" in res.stdout


def test_sets_override_the_run_config():
    b = bench()
    cfg = {"stages": {"tcpo": {"M": 4}}}
    b.apply_sets(cfg, ["tcpo.mu=3", "train.lr=0.001", "tcpo.M=2"])
    assert cfg["stages"]["tcpo"] == {"M": 2, "mu": 3} and cfg["stages"]["train"]["lr"] == 0.001
    with pytest.raises(SystemExit):
        b.apply_sets(cfg, ["nodot=1"])


# ---- bench/learning_credit.py (issue 32): the oracle, the estimators' plumbing, the statistics, learning ----
def credit_bench():
    if "bench_learning_credit" in sys.modules:
        return sys.modules["bench_learning_credit"]
    spec = importlib.util.spec_from_file_location(
        "bench_learning_credit", ROOT / "bench" / "learning_credit.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_learning_credit"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_credit_statistics_hand_computed():
    b = credit_bench()
    for df, t in ((5, 2.571), (10, 2.228), (20, 2.086), (30, 2.042), (60, 2.000)):
        assert b.t975(df) == pytest.approx(t, abs=0.003)
    # paired t-test, effect size 0.5, 80% power, two-sided 0.05: 34 pairs (G*Power); effect 1.0: 10
    assert b.seeds_for_power(1.0, 0.5) == 34 and b.seeds_for_power(2.0, 2.0) == 10
    assert b.seeds_for_power(1.0, 0.0, cap=99) == 99
    assert b.auc([0.9, 0.0, 1.0]) == 0.5  # round 0 excluded
    assert b.sign_p(9, 1) == pytest.approx(22 / 1024)


@pytest.mark.parametrize("name", ["repair", "multihop", "toolchain"])
def test_oracle_values_are_the_policy_values(name):
    """V(s0) equals the Monte Carlo success of the same policy (4 standard errors), and V = sum_a pi(a) Q(s, a)."""
    import numpy as np

    from trainer.envs.credit_tasks import make_credit_env

    b = credit_bench()
    env = make_credit_env(name)
    task = env.tasks(1, seed=3)[0]
    pol = b.Policy(env)
    rng = np.random.default_rng(0)
    pol.row(env.key(task, env.init(task)))
    pol.theta[0] = rng.normal(0, 1, len(env.actions))  # a non-uniform policy at the first state
    vals = b.Values(env, pol)
    s0 = env.init(task)
    v0 = vals.v(task, s0)
    p0 = pol.probs(pol.row(env.key(task, s0)))
    assert v0 == pytest.approx(float(p0 @ vals.q_all(task, s0)), abs=1e-12)
    batch = b.rollout(env, pol, [task], 4000, rng)
    mc = float(batch.reward.mean())
    se = float(batch.reward.std()) / math.sqrt(4000)
    assert abs(mc - v0) < 4 * se + 1e-9, (mc, v0, se)
    adv = vals.advantages(batch)
    # E_a[Q - V] = 0 at every state: over many samples of the first turn, the mean advantage is near 0
    first = batch.turn == 1
    assert abs(adv[first].mean()) < 4 * adv[first].std() / math.sqrt(first.sum()) + 1e-9


def _batch(name, seed=0, tasks=4, samples=8):
    import numpy as np

    from trainer.envs.credit_tasks import make_credit_env

    b = credit_bench()
    env = make_credit_env(name)
    pol = b.Policy(env)
    rng = np.random.default_rng(seed)
    return b, env, pol, b.rollout(env, pol, env.tasks(tasks, seed=seed), samples, rng), rng


def test_grpo_credit_through_the_registry_is_grpo():
    """The tables the bench builds give the registry's GRPO exactly (R - mean) / (std + 1e-6) on every turn."""
    import numpy as np

    b, env, pol, batch, rng = _batch("repair")
    adv = b.estimator_credit(env, "grpo", batch, pol, rng, 0)
    r = batch.reward.reshape(4, 8)
    want = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).ravel()
    np.testing.assert_allclose(adv, want[batch.traj], atol=1e-5)


def test_c3_damps_only_repeated_queries_with_positive_credit():
    import numpy as np

    b, env, pol, batch, rng = _batch("multihop", tasks=8, samples=16)
    env.prior = lambda key: np.array([1.5, 0.7, 0.0, 0.3])  # enough successes (positive credit) with loops
    pol = b.Policy(env)
    batch = b.rollout(env, pol, env.tasks(16, seed=1), 16, rng)
    base = b.estimator_credit(env, "grpo", batch, pol, rng, 0)
    c3 = b.estimator_credit(env, "grpo+c3", batch, pol, rng, 0)
    repeat = np.array([env.is_repeat(s, int(a)) for s, a in zip(batch.states, batch.action, strict=True)])
    assert repeat.any()
    changed = ~np.isclose(c3, base, atol=1e-6)
    assert batch.success.any() and changed.any() and not changed[~repeat].any()  # only the loops found
    assert (base[changed] > 0).all() and (c3[changed] < base[changed]).all() and (c3[changed] >= 0).all()


def test_iapo_routes_credit_by_the_true_graph():
    """IAPO's weights keep each trajectory's credit mass (sum over turns = turns x A_hat) and move credit away
    from error calls in successful trajectories relative to GRPO."""
    import numpy as np

    b, env, pol, batch, rng = _batch("toolchain", tasks=8, samples=16)
    base = b.estimator_credit(env, "grpo", batch, pol, rng, 0)
    iapo = b.estimator_credit(env, "grpo+iapo", batch, pol, rng, 0)
    np.testing.assert_allclose(
        np.bincount(batch.traj, iapo), np.bincount(batch.traj, base), rtol=1e-4, atol=1e-4
    )
    pos = base > 0
    assert pos.any() and (np.sign(iapo) == np.sign(base)).all()
    err = batch.error.astype(bool) & pos
    assert err.any() and (iapo[err] < base[err]).mean() > 0.9


def test_tcpo_credit_runs_with_counterfactuals():
    import numpy as np

    b, env, pol, batch, rng = _batch("repair", tasks=8, samples=8)
    adv = b.estimator_credit(env, "tcpo", batch, pol, rng, 0)
    mt = b.estimator_credit(env, "mt_grpo", batch, pol, rng, 0)
    assert np.isfinite(adv).all() and np.isfinite(mt).all()
    # per-turn credit: TCPO's advantages vary within trajectories (GRPO's never do)
    spread = np.array([np.ptp(adv[batch.traj == i]) for i in range(len(batch.reward))])
    assert (spread > 1e-6).mean() > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["repair", "multihop", "toolchain"])
def test_grpo_learns_on_held_out_tasks(name):
    """GRPO's held-out greedy success rises: the mean over 3 seeds of its last 3 rounds beats round 0 by 0.15."""
    b = credit_bench()
    cfg = {
        "rounds": 12,
        "prompts": 8,
        "samples": 16,
        "train_tasks": 64,
        "lr": None,
        "ent": None,
        "critic_lr": 0.3,
        "diag_every": 0,
        "keep_turns": -1,
    }
    runs = [b.run_one(name, "grpo", seed, cfg) for seed in range(3)]
    start = sum(r["curves"]["greedy"][0] for r in runs) / 3
    end = sum(sum(r["curves"]["greedy"][-3:]) / 3 for r in runs) / 3
    assert end > start + 0.15, (start, end, [r["curves"]["greedy"] for r in runs])


@pytest.mark.slow
def test_credit_quick_runs(tmp_path):
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "learning_credit.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert {r["env"] for r in runs} == {"repair", "multihop", "toolchain"} and len(runs) == 9
    for r in runs:
        assert len(r["curves"]["greedy"]) == 4 and r["diag"]  # rounds 0..3, oracle diagnostics each round
    assert "oracle − grpo" in res.stdout
