"""The IAPO SQL views over a processed lake (grpo and grpo+iapo on real tau-bench trajectories)."""

from __future__ import annotations

import pytest


def test_iapo_views(real_data, lake):
    from test_iapo_rules import _ingest

    from pipeline.annotate import run_annotator
    from pipeline.config import Config
    from pipeline.credit.process import process_batch
    from warehouse.catalog import query

    res = _ingest("tau-bench", real_data / "tau_bench_v1/gpt-4o-airline.json")
    cfg = Config()
    ann = run_annotator(res.steps, cfg)
    tables, _ = process_batch(res.trajectories, res.steps, ["grpo", "grpo+iapo"], cfg, ann.tables)
    for method, t in tables.items():
        lake.write_part("advantages", 0, t, part=f"b0.{method.replace('+', '-')}")
    w = query(lake, "SELECT method, count(*) AS n, min(w) AS lo, max(w) AS hi FROM iapo_weights GROUP BY ALL")
    rows = w.to_pylist()
    assert [r["method"] for r in rows] == ["grpo+iapo"]  # grpo has no routing weights
    assert 0.5 < rows[0]["lo"] <= 1.0 <= rows[0]["hi"] < 2.0
    s = {r["branch"]: r for r in query(lake, "SELECT * FROM iapo_router_summary").to_pylist()}
    assert set(s) == {"positive", "negative", "zero"}
    assert s["zero"]["std_w"] == 0.0 and s["zero"]["share_moved_10pct"] == 0.0
    for b in ("positive", "negative"):
        assert s[b]["token_mean_w"] == pytest.approx(1.0, abs=1e-6)
    assert s["positive"]["std_w"] > 0.05 and s["positive"]["share_moved_10pct"] > 0.3
