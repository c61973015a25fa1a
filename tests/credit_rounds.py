"""Random small rounds for the credit tests: groups of size 1..n, random roles, zero-length turns, rewards
with ties, missing logprobs / verifier scores, interleaved group order (traj ids are random)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from schemas import steps as steps_schema
from schemas import trajectories as traj_schema

ANCHORS = ["obs A", "obs B", "obs A!", "the tool said: ok", "the tool said: no", ""]


def random_round(
    seed: int,
    max_groups: int = 4,
    max_group_size: int = 4,
    max_steps: int = 7,
    max_tokens: int = 5,
    components: bool = True,
    values: bool = True,
    round_: int = 0,
) -> tuple[pa.Table, pa.Table]:
    rng = np.random.default_rng(seed)
    traj_rows, step_rows = [], []
    ids = rng.permutation(10_000)
    k = 0
    for g in range(int(rng.integers(1, max_groups + 1))):
        for s in range(int(rng.integers(1, max_group_size + 1))):
            traj_id = f"t{ids[k]:05d}"
            k += 1
            rc = None
            if components and rng.random() < 0.8:
                rc = [
                    (name, float(rng.choice([0.0, 0.5, 1.0])))
                    for name in ("acc", "fmt")
                    if rng.random() < 0.85
                ]
            traj_rows.append(
                {
                    "round": round_,
                    "traj_id": traj_id,
                    "group_id": f"g{g}",
                    "sample_idx": s,
                    "reward": float(rng.choice([0.0, 0.5, 1.0, 2.0])),
                    "reward_components": rc,
                    "source": "test",
                }
            )
            turn = 0
            n_steps = int(rng.integers(0, max_steps + 1))
            for i in range(n_steps):
                role = str(rng.choice(["system", "user", "assistant", "tool"], p=[0.1, 0.2, 0.45, 0.25]))
                if role == "assistant":
                    turn += 1
                n = int(rng.integers(0, max_tokens + 1))
                step_rows.append(
                    {
                        "round": round_,
                        "traj_id": traj_id,
                        "step_idx": i,
                        "role": role,
                        "turn": turn if role == "assistant" else (turn or None),
                        "content": str(rng.choice(ANCHORS))
                        if role != "assistant"
                        else f"act {rng.integers(3)}",
                        "is_error": bool(rng.random() < 0.2),
                        "token_ids": rng.integers(0, 1000, n).tolist(),
                        "token_offsets": list(range(n)),
                        "logprobs": None if rng.random() < 0.3 else (-rng.random(n)).tolist(),
                        "values": rng.normal(size=n).round(3).tolist() if values else None,
                        "verifier_score": float(rng.choice([0.0, 0.5, 1.0]))
                        if role == "assistant" and rng.random() < 0.85
                        else None,
                    }
                )
    traj = traj_schema.validate(pa.Table.from_pylist(traj_rows, schema=traj_schema.SCHEMA))
    steps = steps_schema.validate(pa.Table.from_pylist(step_rows, schema=steps_schema.SCHEMA))
    return traj, steps
