"""Small TCPO batches for tests and the benchmark: per-turn verifier scores -> trajectories + steps tables.

Each trajectory: a user prompt, then per turn an assistant step (scored) and a user feedback step."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa


def make_batch(
    groups: list[list[list[float | None]]],
    *,
    tokens_per_turn: int = 3,
    logprobs=None,
    meta: dict | None = None,
    action_format: str = "chat",
    contents=None,
    round_: int = 0,
) -> tuple[pa.Table, pa.Table]:
    """groups[g][i] = the turn scores of trajectory i of prompt g. logprobs[g][i][k] = the constant
    behaviour logprob of the tokens of turn k (default -1.0). contents[g][i][k] = the assistant text."""
    traj_rows, step_rows = [], []
    for g, trajs in enumerate(groups):
        for i, scores in enumerate(trajs):
            tid = f"g{g:03d}-t{i:02d}"
            traj_rows.append(
                {
                    "round": round_,
                    "traj_id": tid,
                    "group_id": f"g{g:03d}",
                    "sample_idx": i,
                    "reward": float(max([s for s in scores if s is not None], default=0.0)),
                    "source": "test",
                    "action_format": action_format,
                    "meta": json.dumps(meta if meta is not None else {"task": f"prompt {g}"}),
                }
            )
            steps = [("user", None, f"prompt {g}", None, None)]
            for k, s in enumerate(scores, start=1):
                lp = -1.0 if logprobs is None else logprobs[g][i][k - 1]
                text = f"answer {g}.{i}.{k}" if contents is None else contents[g][i][k - 1]
                steps.append(("assistant", k, text, s, lp))
                steps.append(("user", k, f"feedback {k}", None, None))
            for idx, (role, turn, content, score, lp) in enumerate(steps):
                n = tokens_per_turn if role == "assistant" else 2
                step_rows.append(
                    {
                        "round": round_,
                        "traj_id": tid,
                        "step_idx": idx,
                        "role": role,
                        "turn": turn,
                        "content": content,
                        "is_error": False,
                        "token_ids": list(range(n)),
                        "token_offsets": list(range(n)),
                        "logprobs": [float(lp)] * n if role == "assistant" else None,
                        "values": None,
                        "verifier_score": score,
                    }
                )
    from schemas import TABLES
    from schemas.steps import SCHEMA as STEPS
    from schemas.trajectories import SCHEMA as TRAJ

    traj = pa.Table.from_pylist(traj_rows, schema=TRAJ)
    steps = TABLES["steps"].conform(pa.Table.from_pylist(step_rows, schema=STEPS))  # (n_tokens)
    return traj, steps


def random_groups(
    rng: np.random.Generator, n_groups: int, group_size: int, max_turns: int, levels=(0.0, 0.2, 0.5, 1.0)
) -> list[list[list[float]]]:
    return [
        [
            list(rng.choice(levels, size=int(rng.integers(1, max_turns + 1))))
            for _ in range(int(rng.integers(1, group_size + 1)))
        ]
        for _ in range(n_groups)
    ]
