"""The `behavior_stats` view: misguided reinforcement (positive credit on undesirable spans of successful
trajectories) is one query, before and after c3, checked against numbers computed by hand."""

import math

import pyarrow as pa
import pytest

from pipeline.config import Config
from pipeline.credit.process import process_batch
from warehouse.catalog import query
from warehouse.rounds import write_round


def test_behavior_stats_by_hand(lake):
    # one group of two trajectories: t1 succeeds (R=1), t0 fails (R=0). GRPO: A = +-0.5/(sqrt(0.5)+1e-6)
    trajs = pa.Table.from_pylist(
        [
            dict(traj_id="t0", group_id="g", sample_idx=0, reward=0.0, source="test"),
            dict(traj_id="t1", group_id="g", sample_idx=1, reward=1.0, source="test"),
        ]
    )
    steps = []
    for tid in ("t0", "t1"):
        steps.append(
            dict(
                traj_id=tid,
                step_idx=0,
                role="user",
                turn=None,
                content="q",
                is_error=False,
                token_ids=[1],
                token_offsets=[0],
                logprobs=None,
            )
        )
        steps.append(
            dict(
                traj_id=tid,
                step_idx=1,
                role="assistant",
                turn=1,
                content="abcd",
                is_error=False,
                token_ids=[1, 2, 3, 4],
                token_offsets=[0, 1, 2, 3],
                logprobs=[math.log(0.5)] * 4,
            )
        )
    steps = pa.Table.from_pylist(steps)
    write_round(lake, 0, trajs, steps)
    # a query-loop span over tokens [1, 3) of each assistant step (severity 1, confidence 0.5)
    spans = pa.Table.from_pylist(
        [
            dict(
                traj_id=t,
                step_idx=1,
                turn=1,
                token_start=1,
                token_end=3,
                char_start=1,
                char_end=3,
                behavior="query_loop",
                severity=1.0,
                rule="test",
                evidence="",
            )
            for t in ("t0", "t1")
        ]
    )
    lake.write_part("spans", 0, spans, part="b00000")
    tables, _ = process_batch(trajs, steps, ["grpo", "grpo+c3"], Config(), {"spans": spans})
    for m, t in tables.items():
        lake.write_part("advantages", 0, t, part=f"b00000.{m}")

    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # (1 - mean 0.5) / unbiased std of [0, 1]
    rows = {r["method"]: r for r in query(lake, "SELECT * FROM behavior_stats").to_pylist()}
    assert set(rows) == {"grpo", "grpo+c3"}
    for r in rows.values():
        assert r["spans"] == 2 and r["tokens"] == 4 and r["share_successful"] == 0.5
    # before: only t1's two span tokens are positive (t0's are negative): 2a over 4 span tokens
    assert rows["grpo+c3"]["mean_pos_credit_before"] == pytest.approx(2 * a / 4, rel=1e-6)
    # after c3: factor 1 - 1 * 1.0 * 0.5 = 0.5 on positive tokens
    assert rows["grpo+c3"]["mean_pos_credit_after"] == pytest.approx(0.5 * 2 * a / 4, rel=1e-5)
    assert rows["grpo"]["mean_pos_credit_after"] == pytest.approx(2 * a / 4, rel=1e-6)
    assert rows["grpo+c3"]["misguided_spans"] == 1
    assert rows["grpo+c3"]["misguided_credit"] == pytest.approx(0.5 * 2 * a, rel=1e-5)
