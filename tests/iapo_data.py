"""Small builders for IAPO tests: a credit context from per-trajectory action lengths, annotation frames from
plain edge lists, and a per-trajectory reference implementation of the routing written with Python loops."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pyarrow as pa

from pipeline.credit.batch import CreditBatch
from pipeline.credit.result import CreditResult

EDGE_SIGN = {"input": 1, "success_utilization": 1, "failed_utilization": -1}


def make_ctx(trajs: list[dict], annotations: dict | None = None) -> CreditBatch:
    """trajs: [{"id": str, "group": str, "reward": float, "L": [len of action 1, ...]}]; each action is preceded
    by a user step of 3 tokens (mask 0)."""
    t_rows = {"traj_id": [], "group_id": [], "reward": []}
    s_rows = {
        k: []
        for k in (
            "traj_id",
            "step_idx",
            "role",
            "turn",
            "content",
            "is_error",
            "token_ids",
            "token_offsets",
            "logprobs",
            "values",
        )
    }
    for t in trajs:
        t_rows["traj_id"].append(t["id"])
        t_rows["group_id"].append(t.get("group", t["id"]))
        t_rows["reward"].append(float(t.get("reward", 0.0)))
        k = 0
        for turn, n in enumerate(t["L"], start=1):
            for role, size in (("user", 3), ("assistant", int(n))):
                s_rows["traj_id"].append(t["id"])
                s_rows["step_idx"].append(k)
                s_rows["role"].append(role)
                s_rows["turn"].append(turn)
                s_rows["content"].append("x" * size)
                s_rows["is_error"].append(False)
                s_rows["token_ids"].append(list(range(size)))
                s_rows["token_offsets"].append(list(range(size)))
                s_rows["logprobs"].append(None)
                s_rows["values"].append(None)
                k += 1
    traj = pa.table(
        {
            "traj_id": pa.array(t_rows["traj_id"], pa.string()),
            "group_id": pa.array(t_rows["group_id"], pa.string()),
            "reward": pa.array(t_rows["reward"], pa.float64()),
        }
    )
    steps = pa.table(
        {
            "traj_id": pa.array(s_rows["traj_id"], pa.string()),
            "step_idx": pa.array(s_rows["step_idx"], pa.int32()),
            "role": pa.array(s_rows["role"], pa.string()),
            "turn": pa.array(s_rows["turn"], pa.int32()),
            "content": pa.array(s_rows["content"], pa.string()),
            "is_error": pa.array(s_rows["is_error"], pa.bool_()),
            "token_ids": pa.array(s_rows["token_ids"], pa.list_(pa.int32())),
            "token_offsets": pa.array(s_rows["token_offsets"], pa.list_(pa.int32())),
            "logprobs": pa.array(s_rows["logprobs"], pa.list_(pa.float32())),
            "values": pa.array(s_rows["values"], pa.list_(pa.float32())),
        }
    )
    return CreditBatch.from_arrow(traj, steps, annotations=annotations or {})


def base_result(ctx: CreditBatch, a_hat: dict[str, float]) -> CreditResult:
    per_traj = np.array([a_hat.get(t, 0.0) for t in ctx.trajectories["traj_id"].to_list()])
    return CreditResult.per_token(ctx.broadcast_traj(per_traj), {"a_hat": ctx.traj_to_steps(per_traj)})


def annotations(edges: list[tuple], nodes: list[tuple] | None = None, annotator: str = "test") -> dict:
    """edges: (traj_id, src, dst, type); nodes: (traj_id, turn, error, u_dir[, parse_failed])."""
    e = pl.DataFrame(
        {
            "traj_id": [x[0] for x in edges],
            "src_turn": [x[1] for x in edges],
            "dst_turn": [x[2] for x in edges],
            "type": [x[3] for x in edges],
            "sign": [EDGE_SIGN.get(x[3], 1) for x in edges],
            "annotator": [annotator] * len(edges),
        },
        schema={
            "traj_id": pl.String,
            "src_turn": pl.Int32,
            "dst_turn": pl.Int32,
            "type": pl.String,
            "sign": pl.Int8,
            "annotator": pl.String,
        },
    )
    nodes = nodes or []
    n = pl.DataFrame(
        {
            "traj_id": [x[0] for x in nodes],
            "turn": [x[1] for x in nodes],
            "error": [x[2] for x in nodes],
            "u_dir": [x[3] for x in nodes],
            "parse_failed": [bool(x[4]) if len(x) > 4 else False for x in nodes],
            "annotator": [annotator] * len(nodes),
        },
        schema={
            "traj_id": pl.String,
            "turn": pl.Int32,
            "error": pl.Int8,
            "u_dir": pl.Int32,
            "parse_failed": pl.Boolean,
            "annotator": pl.String,
        },
    )
    return {"edges": e, "nodes": n}


def reference_weights(
    L: list[int],
    edges: list[tuple[int, int, str]],
    errors: dict[int, int],
    u_dir: dict[int, int],
    a_hat: float,
    beta_plus=0.05,
    c=0.25,
    eps=1e-6,
    negative="cons",
    beta_minus=0.05,
    parse_failed=False,
) -> dict[int, float]:
    """Spec section 4 for one trajectory, with loops. Returns {turn: w} for actions with L > 0."""
    acts = [k + 1 for k, n in enumerate(L) if n > 0]
    if parse_failed:
        edges, errors, u_dir = [], {}, {}
    Lmap = {a: float(L[a - 1]) for a in acts}
    valid = set()
    for i, j, typ in edges:
        if typ in EDGE_SIGN and i in Lmap and j in Lmap and i < j:
            valid.add((i, j, EDGE_SIGN[typ]))
    d_plus = {a: len({j for (i, j, s) in valid if i == a and s > 0}) for a in acts}
    d_minus = {a: len({j for (i, j, s) in valid if i == a and s < 0}) for a in acts}
    d_in = {a: u_dir.get(a, 0) + len({i for (i, j, s) in valid if j == a and s > 0}) for a in acts}
    e = {a: 1 if (errors.get(a, 0) or d_minus[a] > 0) else 0 for a in acts}
    phi_p = {a: math.log(1 + d_plus[a] + d_in[a]) for a in acts}
    phi_m = {a: math.log(1 + e[a] * (1 + d_minus[a] + d_in[a])) for a in acts}
    Ltot = sum(Lmap.values())

    def bounded(phi):
        mean = sum(Lmap[a] * phi[a] for a in acts) / Ltot
        var = sum(Lmap[a] * (phi[a] - mean) ** 2 for a in acts) / Ltot
        const = len({phi[a] for a in acts}) <= 1
        z = {a: 0.0 if const else (phi[a] - mean) / (math.sqrt(var) + eps) for a in acts}
        ez = {a: math.exp(min(max(z[a], -c), c)) for a in acts}
        norm = sum(Lmap[a] * ez[a] for a in acts) / Ltot
        return {a: ez[a] / norm for a in acts}, mean, const

    m_p, _, _ = bounded(phi_p)
    m_m, mean_m, const_m = bounded(phi_m)
    psi = {a: 0.0 if const_m else phi_m[a] - mean_m for a in acts}

    def tilt(beta):
        den = sum(Lmap[a] * m_p[a] * math.exp(beta * psi[a]) for a in acts)
        return {a: Ltot * m_p[a] * math.exp(beta * psi[a]) / den for a in acts}

    if a_hat > 0:
        return tilt(-beta_plus)
    if a_hat < 0:
        return m_m if negative == "cons" else tilt(beta_minus)
    return {a: 1.0 for a in acts}
