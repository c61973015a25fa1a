"""Everything the HTML report shows, gathered from the lake with DuckDB (small aggregates + a few sample
trajectories), as plain Python data."""

from __future__ import annotations

import json

from warehouse.catalog import connect
from warehouse.lake import Lake


def _rows(con, sql: str, params: list | None = None) -> list[dict]:
    rel = con.execute(sql, params or [])
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, r, strict=True)) for r in rel.fetchall()]


def pick_trajectories(con, round_: int, n: int) -> list[str]:
    """A mix: successful and failed, with and without detector spans, favouring short ones."""
    rows = _rows(
        con,
        """
        WITH t AS (
          SELECT t.traj_id, t.reward, t.group_id,
                 (SELECT count(*) FROM spans s WHERE s.traj_id = t.traj_id AND s.round = t.round) AS n_spans,
                 (SELECT sum(len(token_ids)) FROM steps st WHERE st.traj_id = t.traj_id AND st.round = t.round) AS n_tok
          FROM trajectories t WHERE t.round = ?
        )
        SELECT traj_id, reward, n_spans, n_tok FROM t ORDER BY n_tok LIMIT 400
        """,
        [round_],
    )
    buckets = {
        "success_span": [r for r in rows if r["reward"] > 0 and r["n_spans"] > 0],
        "fail_span": [r for r in rows if r["reward"] <= 0 and r["n_spans"] > 0],
        "success": [r for r in rows if r["reward"] > 0 and r["n_spans"] == 0],
        "fail": [r for r in rows if r["reward"] <= 0 and r["n_spans"] == 0],
    }
    chosen: list[str] = []
    while len(chosen) < n and any(buckets.values()):
        for key in buckets:
            if buckets[key] and len(chosen) < n:
                chosen.append(buckets[key].pop(0)["traj_id"])
    return chosen


def _compact(values: list[float]) -> float | list[float]:
    """A step's token advantages: one number when constant (trajectory/turn-level credit), else the list."""
    if not values:
        return 0.0
    first = values[0]
    if all(v == first for v in values):
        return round(float(first), 4)
    return [round(float(v), 4) for v in values]


def trajectory_payload(con, round_: int, traj_id: str, methods: list[str]) -> dict:
    traj = _rows(
        con,
        "SELECT traj_id, group_id, reward, source, action_format FROM trajectories WHERE round = ? AND traj_id = ?",
        [round_, traj_id],
    )[0]
    steps = _rows(
        con,
        "SELECT step_idx, role, turn, content, token_offsets, verifier_score, is_error FROM steps "
        "WHERE round = ? AND traj_id = ? ORDER BY step_idx",
        [round_, traj_id],
    )
    adv = _rows(
        con,
        "SELECT method, step_idx, token_adv FROM advantages WHERE round = ? AND traj_id = ? ORDER BY method, step_idx",
        [round_, traj_id],
    )
    by_method: dict[str, dict[int, object]] = {m: {} for m in methods}
    for row in adv:
        if row["method"] in by_method:
            by_method[row["method"]][row["step_idx"]] = _compact(row["token_adv"])
    spans = _rows(
        con,
        "SELECT step_idx, turn, token_start, token_end, behavior, severity, rule, evidence FROM spans "
        "WHERE round = ? AND traj_id = ? ORDER BY step_idx, token_start",
        [round_, traj_id],
    )
    edges = _rows(
        con,
        "SELECT DISTINCT src_turn, dst_turn, type, sign, info_unit FROM edges WHERE round = ? AND traj_id = ? "
        "ORDER BY src_turn, dst_turn",
        [round_, traj_id],
    )
    out_steps = []
    for s in steps:
        content = s["content"] or ""
        offs = list(s["token_offsets"] or [])
        pieces = (
            [content[a:b] for a, b in zip(offs, offs[1:] + [len(content)], strict=True)]
            if offs
            else [content]
        )
        if len(content) > 6000:  # keep the page light: long tool outputs are cut, tokens stay aligned
            keep = sum(1 for o in offs if o < 6000)
            pieces = pieces[:keep] + ["…"]
        out_steps.append(
            {
                "i": s["step_idx"],
                "role": s["role"],
                "turn": s["turn"],
                "pieces": pieces,
                "score": s["verifier_score"],
                "err": bool(s["is_error"]),
            }
        )
    return {
        **traj,
        "steps": out_steps,
        "adv": {m: {str(k): v for k, v in d.items()} for m, d in by_method.items()},
        "spans": spans,
        "edges": edges,
    }


def gather(lake: Lake, rounds: list[int] | None = None, n_traj: int = 8) -> dict:
    con = connect(lake)
    try:
        all_rounds = [r["round"] for r in _rows(con, "SELECT DISTINCT round FROM advantages ORDER BY 1")]
        rounds = rounds or all_rounds
        rounds = [r for r in rounds if r in all_rounds]
        summary = _rows(con, "SELECT * FROM credit_summary ORDER BY round, method")
        by_turn = _rows(
            con,
            "SELECT round, method, turn, mean_adv, share_positive, tokens FROM credit_by_turn "
            "WHERE turn IS NOT NULL ORDER BY round, method, turn",
        )
        categories = _rows(
            con,
            """
            SELECT round, method,
                   sum(CASE WHEN components.delta > 0 THEN 1 ELSE 0 END) AS progress,
                   sum(CASE WHEN components.delta = 0 AND components.c_ret > 0 THEN 1 ELSE 0 END) AS keep,
                   sum(CASE WHEN components.c_ret < 0 THEN 1 ELSE 0 END) AS regression,
                   sum(CASE WHEN components.b_gate = 1 AND components.c_del <> 0 THEN 1 ELSE 0 END) AS delayed,
                   sum(CASE WHEN components.c_ret = 0 AND coalesce(components.c_del, 0) = 0 THEN 1 ELSE 0 END) AS neutral
            FROM advantages WHERE role = 'assistant' AND components.c_ret IS NOT NULL
            GROUP BY ALL ORDER BY round, method
            """,
        )
        weights = _rows(
            con,
            "SELECT round, method, components.w AS w FROM advantages WHERE role = 'assistant' "
            "AND components.w IS NOT NULL",
        )
        behaviors = _rows(
            con,
            "SELECT round, behavior, count(*) AS spans, avg(severity) AS severity FROM spans "
            "GROUP BY ALL ORDER BY round, behavior",
        )
        quarantine = _rows(
            con, "SELECT round, reason, count(*) AS n FROM quarantine GROUP BY ALL ORDER BY round, n DESC"
        )
        trajs = []
        for r in rounds:
            methods = [
                row["method"]
                for row in _rows(
                    con, "SELECT DISTINCT method FROM advantages WHERE round = ? ORDER BY 1", [r]
                )
            ]
            for tid in pick_trajectories(con, r, n_traj):
                payload = trajectory_payload(con, r, tid, methods)
                payload["round"] = r
                trajs.append(payload)
    finally:
        con.close()
    return {
        "lake": str(lake.root),
        "rounds": rounds,
        "summary": summary,
        "by_turn": by_turn,
        "categories": categories,
        "weights": weights,
        "behaviors": behaviors,
        "quarantine": quarantine,
        "trajectories": trajs,
    }


def to_json(data: dict) -> str:
    return json.dumps(data, default=float, separators=(",", ":"))
