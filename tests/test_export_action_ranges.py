"""OpenRLHF action_ranges on arbitrary turn ids (repeated, out of order, interrupted, empty rows) against a
per-token Python reference: per (row, turn k), [first position, last position + 1) of turn k's tokens in the
sequence (OpenRLHF 0.11's agents return action_ranges in sequence positions)."""

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layouts import to_padded

row_st = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3)), min_size=0, max_size=12)  # (mask, turn id)


@settings(max_examples=60, deadline=None)
@given(st.lists(row_st, min_size=1, max_size=5))
def test_action_ranges_match_per_token_reference(rows):
    cols = {k: [] for k in ("input_ids", "loss_mask", "old_logprobs", "advantages", "turn_ids")}
    for toks in rows:
        cols["input_ids"].append(list(range(1, len(toks) + 1)))
        cols["loss_mask"].append([m for m, _ in toks])
        cols["old_logprobs"].append([0.0] * len(toks))
        cols["advantages"].append([0.0] * len(toks))
        cols["turn_ids"].append([k for _, k in toks])
    n = len(rows)
    table = pa.table(
        {
            "traj_id": [f"t{i}" for i in range(n)],
            "group_id": ["g"] * n,
            "reward": [0.0] * n,
            "input_ids": pa.array(cols["input_ids"], pa.list_(pa.int32())),
            "loss_mask": pa.array(cols["loss_mask"], pa.list_(pa.int8())),
            "old_logprobs": pa.array(cols["old_logprobs"], pa.list_(pa.float32())),
            "advantages": pa.array(cols["advantages"], pa.list_(pa.float32())),
            "values": pa.nulls(n, pa.list_(pa.float32())),
            "returns": pa.nulls(n, pa.list_(pa.float32())),
            "turn_ids": pa.array(cols["turn_ids"], pa.list_(pa.int16())),
        }
    )
    got = to_padded(table, "openrlhf")["action_ranges"]
    expect: dict[tuple[int, int], list[int]] = {}
    for r, toks in enumerate(rows):
        for j in range(len(toks)):
            if toks[j][1] > 0:
                expect.setdefault((r, toks[j][1]), []).append(j)
    max_turn = max((k for _, k in expect), default=0)
    assert got.shape == (n, max(max_turn, 1), 2)
    for r in range(n):
        for k in range(1, got.shape[1] + 1):
            c = expect.get((r, k))
            assert tuple(got[r, k - 1]) == ((min(c), max(c) + 1) if c else (-1, -1))
    assert np.all(got[..., 0] <= got[..., 1])
