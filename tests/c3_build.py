"""Small in-memory batches for the C3 tests: word tokens (a token starts at each non-space run)."""

from __future__ import annotations

import json
import re

import pyarrow as pa

from schemas.steps import SCHEMA as STEPS_SCHEMA
from schemas.trajectories import SCHEMA as TRAJ_SCHEMA


def word_offsets(content: str) -> list[int]:
    return [m.start() for m in re.finditer(r"\S+", content)]


def batch(trajs: list[dict]) -> tuple[pa.Table, pa.Table]:
    """trajs: [{traj_id, group_id?, reward?, action_format?, meta?, steps: [{role, content, turn?, tool_calls?,
    tool_call_id?, is_error?, logprob?|logprobs?, values?}]}] -> (trajectories, steps) Arrow tables."""
    t_rows, s_rows = [], []
    for i, t in enumerate(trajs):
        t_rows.append(
            {
                "round": 0,
                "traj_id": t["traj_id"],
                "group_id": t.get("group_id", "g0"),
                "sample_idx": i,
                "reward": float(t.get("reward", 1.0)),
                "reward_components": None,
                "source": "test",
                "action_format": t.get("action_format"),
                "policy_version": None,
                "meta": json.dumps(t.get("meta", {})),
            }
        )
        turn = 0
        for k, s in enumerate(t["steps"]):
            content = s.get("content", "")
            offs = word_offsets(content)
            role = s.get("role", "assistant")
            if role == "assistant":
                turn += 1
            lp = s.get("logprobs")
            if lp is None and role == "assistant" and s.get("logprob", -0.1) is not None:
                lp = [s.get("logprob", -0.1)] * len(offs)
            s_rows.append(
                {
                    "round": 0,
                    "traj_id": t["traj_id"],
                    "step_idx": k,
                    "role": role,
                    "turn": s.get("turn", turn if turn else None),
                    "content": content,
                    "tool_calls": s.get("tool_calls"),
                    "tool_call_id": s.get("tool_call_id"),
                    "is_error": bool(s.get("is_error", False)),
                    "token_ids": list(range(len(offs))),
                    "token_offsets": offs,
                    "logprobs": lp,
                    "logprob_source": None,
                    "values": s.get("values", [0.0] * len(offs)),
                    "verifier_score": None,
                }
            )
    return pa.Table.from_pylist(t_rows, schema=TRAJ_SCHEMA), pa.Table.from_pylist(s_rows, schema=STEPS_SCHEMA)
