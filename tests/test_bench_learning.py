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
