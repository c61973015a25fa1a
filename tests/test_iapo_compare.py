"""`creditflow annotators compare`: the agreement figures on hand-made tables and end to end on a lake."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from pipeline.annotate.compare import cohen_kappa, compare, spearman


def _tables(edges, nodes, ann):
    e = pa.table(
        {
            "traj_id": [x[0] for x in edges],
            "src_turn": pa.array([x[1] for x in edges], pa.int32()),
            "dst_turn": pa.array([x[2] for x in edges], pa.int32()),
            "type": [x[3] for x in edges],
            "sign": pa.array([-1 if x[3] == "failed_utilization" else 1 for x in edges], pa.int8()),
            "annotator": [ann] * len(edges),
        },
        schema=pa.schema(
            [
                ("traj_id", pa.string()),
                ("src_turn", pa.int32()),
                ("dst_turn", pa.int32()),
                ("type", pa.string()),
                ("sign", pa.int8()),
                ("annotator", pa.string()),
            ]
        ),
    )
    n = pa.table(
        {
            "traj_id": [x[0] for x in nodes],
            "turn": pa.array([x[1] for x in nodes], pa.int32()),
            "error": pa.array([x[2] for x in nodes], pa.int8()),
            "u_dir": pa.array([0] * len(nodes), pa.int32()),
            "parse_failed": [False] * len(nodes),
            "annotator": [ann] * len(nodes),
        }
    )
    return n, e


def test_metrics_by_hand():
    traj = pa.table({"traj_id": ["a", "b"], "group_id": ["g", "g"], "reward": [1.0, 0.0]})
    steps_rows = []
    for t in ("a", "b"):
        for k in range(4):
            steps_rows.append(
                {"traj_id": t, "step_idx": k, "role": "assistant", "turn": k + 1, "token_ids": [1, 2, 3, 4]}
            )
    steps = pa.Table.from_pylist(steps_rows)
    ea = [("a", 1, 2, "input"), ("a", 1, 3, "success_utilization"), ("b", 2, 4, "failed_utilization")]
    eb = [
        ("a", 1, 2, "input"),
        ("a", 2, 3, "success_utilization"),
        ("b", 2, 4, "failed_utilization"),
        ("b", 1, 3, "input"),
    ]
    na, ea_t = _tables(
        ea,
        [
            ("a", 1, 0),
            ("a", 2, 0),
            ("a", 3, 0),
            ("a", 4, 0),
            ("b", 1, 0),
            ("b", 2, 1),
            ("b", 3, 0),
            ("b", 4, 0),
        ],
        "A",
    )
    nb, eb_t = _tables(
        eb,
        [
            ("a", 1, 0),
            ("a", 2, 1),
            ("a", 3, 0),
            ("a", 4, 0),
            ("b", 1, 0),
            ("b", 2, 1),
            ("b", 3, 0),
            ("b", 4, 0),
        ],
        "B",
    )
    res = compare(traj, steps, na, ea_t, nb, eb_t)
    # 2 common of 3 + 4 edges
    assert res["edge_f1"] == pytest.approx(2 * 2 / 7)
    # consumers: (a,2): {1} vs {1} = 1; (a,3): {1} vs {2} = 0; (b,4): {2} vs {2} = 1; (b,3): {} vs {1} = 0
    assert res["source_jaccard"] == pytest.approx(0.5)
    # errors: A = 0000 0100, B = 0100 0100 -> po = 7/8, pA = 1/8, pB = 2/8, pe = 1/32 + 21/32 = 22/32
    assert res["error_kappa"] == pytest.approx((7 / 8 - 22 / 32) / (1 - 22 / 32))
    assert -1 <= res["spearman_m_plus"] <= 1
    assert 0 <= res["routed_sign_agreement"] <= 1


def test_rank_stats():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert cohen_kappa([1, 0, 1, 0], [1, 0, 1, 0]) == pytest.approx(1.0)
    assert cohen_kappa([0, 0], [0, 0]) == 1.0


def test_compare_command_end_to_end(real_data, tmp_path, llm_standin):
    from test_iapo_rules import _ingest

    from flows.cli import app
    from warehouse.lake import Lake
    from warehouse.rounds import write_round

    res = _ingest("tau-bench", real_data / "tau_bench_v1/gpt-4o-airline.json")
    keep = res.trajectories.slice(0, 24)
    steps = res.steps.filter(pa.compute.is_in(res.steps.column("traj_id"), keep.column("traj_id")))
    lake = Lake(tmp_path / "lake")
    write_round(lake, 0, keep, steps, batch_groups=3)
    runner = CliRunner()
    # rules against itself (another id): perfect agreement
    r = runner.invoke(
        app,
        [
            "annotators",
            "compare",
            "rules",
            "rules",
            "--lake",
            str(lake.root),
            "--round",
            "0",
            "--id-b",
            "rules-copy",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["edge_f1"] == 1.0 and out["source_jaccard"] == 1.0 and out["error_kappa"] == 1.0
    assert out["spearman_m_plus"] == pytest.approx(1.0) and out["routed_sign_agreement"] == 1.0
    # rules vs rules without text values: a real difference
    r = runner.invoke(
        app,
        [
            "annotators",
            "compare",
            "rules",
            "rules",
            "--lake",
            str(lake.root),
            "--round",
            "0",
            "--id-b",
            "rules-args-only",
            "--set-b",
            "annotate_rules.text_values=false",
            "--json",
        ],
    )
    out = json.loads(r.output.strip().splitlines()[-1])
    assert 0 < out["edge_f1"] < 1 and out["edges_b"] < out["edges_a"]

    # rules vs an llm (the stand-in answers "each action uses the one before it")
    def chain(body, kind, i):
        user = body["messages"][1]["content"]
        items = json.loads(user.split("<transcript>\n", 1)[1].rsplit("\n</transcript>", 1)[0])
        acts = [int(x["id"].split(":")[1]) for x in items if x["id"].startswith("action:")]
        return json.dumps(
            {
                "actions": [
                    {
                        "action_id": a,
                        "error": 0,
                        "error_kind": "none",
                        "sources": [
                            {"source": f"action:{p}", "type": "input", "info_unit": "u", "binding": "b"}
                        ],
                    }
                    for p, a in zip(acts, acts[1:], strict=False)
                ]
            },
            separators=(",", ":"),  # one stand-in token: within any answer budget
        )

    llm_standin.behaviour = chain
    r = runner.invoke(
        app,
        [
            "annotators",
            "compare",
            "rules",
            "llm",
            "--lake",
            str(lake.root),
            "--round",
            "0",
            "--set",
            f"llm.endpoints=[{llm_standin.url}]",
            "--set",
            f"llm.cache_dir={tmp_path}/c",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["annotator_b"] == "llm:standin-model"
    assert 0 < out["edge_f1"] < 1 and out["parse_failed_b"] == 0
    first_llm = out

    # any OpenAI-compatible endpoint the user points at (--endpoint, its model named as llm=MODEL): here one
    # without vLLM's /tokenize whose context holds the instructions and about half a trajectory, which it only
    # enforces by refusing (HTTP 400 "maximum context length"); the long trajectories go in windows, none fails
    llm_standin.tokenize_route, llm_standin.max_model_len = False, 1400
    llm_standin.requests.clear()
    r = runner.invoke(
        app,
        [
            "annotators",
            "compare",
            "rules",
            "llm=standin-model",
            "--lake",
            str(lake.root),
            "--round",
            "0",
            "--endpoint",
            llm_standin.url.removesuffix("/v1"),
            "--id-b",
            "llm-elsewhere",
            "--set",
            "annotate_llm.max_tokens=128",
            "--set",
            f"llm.cache_dir={tmp_path}/c2",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["annotator_b"] == "llm-elsewhere" and out["parse_failed_b"] == 0
    assert {b["model"] for b in llm_standin.requests} == {"standin-model"}
    windows = [b for b in llm_standin.requests if "of a longer trajectory" in b["messages"][1]["content"]]
    assert windows and len(windows) < len(llm_standin.requests), len(windows)
    # windows change what the model sees (an excerpt's first action cites nothing), not the kind of answer
    assert 0 < out["edge_f1"] < 1 and out["edges_b"] < first_llm["edges_b"]

    # both annotators' rows coexist in the lake, keyed by annotator
    from warehouse.catalog import query

    ids = query(lake, "SELECT DISTINCT annotator FROM edges ORDER BY 1").column(0).to_pylist()
    assert ids == ["llm-elsewhere", "llm:standin-model", "rules", "rules-args-only", "rules-copy"]
