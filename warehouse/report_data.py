"""Everything the HTML report shows, gathered from the lake with DuckDB (small aggregates + a few sample
trajectories), as plain Python data."""

from __future__ import annotations

import json

from warehouse.catalog import connect
from warehouse.lake import Lake


def _rows(con, sql: str, params: list | dict | None = None) -> list[dict]:
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


def _in_rounds(rounds: list[int]) -> str:
    return "(" + ", ".join(str(int(r)) for r in rounds) + ")" if rounds else "(NULL)"


def turn_intervals(con, rounds: list[int]) -> list[dict]:
    """Per (round, method, turn): assistant turns counted, their mean advantage and a normal 95% interval
    (a turn's credit is the mean of its token advantages; each trajectory's turn counts once)."""
    return _rows(
        con,
        f"""
        SELECT round, method, turn, count(*) AS n, avg(m) AS mean_adv,
               1.96 * coalesce(stddev_samp(m), 0) / sqrt(count(*)) AS ci95,
               avg(CASE WHEN m > 0 THEN 1.0 ELSE 0.0 END) AS share_positive
        FROM (SELECT round, method, turn, list_avg(token_adv) AS m FROM advantages
              WHERE role = 'assistant' AND turn IS NOT NULL AND len(token_adv) > 0
                AND round IN {_in_rounds(rounds)})
        GROUP BY ALL ORDER BY round, method, turn
        """,
    )


def outcome_split(con, rounds: list[int]) -> list[dict]:
    """Per (round, method): the mean turn advantage of successful (reward > 0) and failed trajectories."""
    return _rows(
        con,
        f"""
        SELECT a.round, a.method,
               CASE WHEN t.reward > 0 THEN 'success' ELSE 'failure' END AS outcome,
               count(DISTINCT a.traj_id) AS trajectories, count(*) AS n,
               avg(list_avg(a.token_adv)) AS mean_adv,
               1.96 * coalesce(stddev_samp(list_avg(a.token_adv)), 0) / sqrt(count(*)) AS ci95
        FROM advantages a JOIN trajectories t ON t.round = a.round AND t.traj_id = a.traj_id
        WHERE a.role = 'assistant' AND len(a.token_adv) > 0 AND a.round IN {_in_rounds(rounds)}
        GROUP BY ALL ORDER BY a.round, a.method, outcome
        """,
    )


HIST_BINS = 40


def advantage_histograms(con, round_: int, bins: int = HIST_BINS) -> list[dict]:
    """Token-advantage histogram per method of one round: equal-width bins between the method's min and max
    (bin centre, width, tokens). One pass over the tokens in DuckDB; only the counts leave it."""
    return _rows(
        con,
        f"""
        WITH r AS (
          SELECT method, min(list_min(token_adv)) AS lo, max(list_max(token_adv)) AS hi
          FROM advantages WHERE role = 'assistant' AND round = ? GROUP BY method
        ), b AS (
          SELECT a.method, r.lo, greatest(r.hi - r.lo, 1e-9) / {int(bins)} AS w, unnest(a.token_adv) AS x
          FROM advantages a JOIN r USING (method) WHERE a.role = 'assistant' AND a.round = ?
        )
        SELECT method, lo + (least(floor((x - lo) / w), {int(bins) - 1}) + 0.5) * w AS x, w AS width,
               count(*) AS tokens
        FROM b WHERE isfinite(x) GROUP BY method, lo, w, least(floor((x - lo) / w), {int(bins) - 1})
        ORDER BY method, x
        """,
        [round_, round_],
    )


def sign_disagreement(con, round_: int) -> list[dict]:
    return _rows(
        con,
        "SELECT method_a, method_b, tokens, share_sign_differs FROM sign_disagreement WHERE round = ? "
        "ORDER BY method_a, method_b",
        [round_],
    )


def within_trajectory_spread(con, round_: int) -> list[dict]:
    """Per method: the share of its token-advantage variance that lies within trajectories (0 for credit that
    is constant along a trajectory, like GRPO's) and the mean within-trajectory standard deviation, from
    per-step sums (one pass, no token unnesting)."""
    return _rows(
        con,
        """
        WITH s AS (
          SELECT method, traj_id, sum(len(token_adv)) AS n, sum(list_sum(token_adv)) AS s1,
                 sum(list_sum(list_transform(token_adv, lambda x: x * x))) AS s2
          FROM advantages WHERE role = 'assistant' AND round = ? AND len(token_adv) > 0
          GROUP BY method, traj_id
        ), t AS (
          SELECT method, n, s1, s2, greatest(s2 / n - (s1 / n) ^ 2, 0) AS var_within FROM s
        )
        SELECT method,
               sum(var_within * n) / sum(n) AS within_var,
               greatest(sum(s2) / sum(n) - (sum(s1) / sum(n)) ^ 2, 0) AS total_var,
               avg(sqrt(var_within)) AS mean_within_std
        FROM t GROUP BY method ORDER BY method
        """,
        [round_],
    )


def default_method(spread: list[dict]) -> str | None:
    """The method whose credit varies most within trajectories: largest within share of the variance (scale
    free), then largest within-trajectory standard deviation."""

    def key(r: dict) -> tuple[float, float]:
        total = r["total_var"] or 0.0
        return ((r["within_var"] or 0.0) / total if total > 1e-12 else 0.0, r["mean_within_std"] or 0.0)

    return max(spread, key=key)["method"] if spread else None


def train_curves(con) -> list[dict]:
    """The trainer's optimizer steps (table train_metrics), in order, for the training-curve chart."""
    return _rows(
        con,
        "SELECT round, coalesce(method, '') AS method, step, epoch, loss, pg_loss, kl, entropy, grad_norm, "
        "clip_frac FROM train_metrics ORDER BY method, round, step",
    )


def pick_group(con, round_: int) -> list[str]:
    """One prompt's samples for the group view: a group with both outcomes if any, favouring detector spans and
    dependency edges, then short trajectories; at most 8 samples."""
    rows = _rows(
        con,
        """
        WITH sp AS (SELECT traj_id, count(*) AS n FROM spans WHERE round = $r GROUP BY 1),
        ed AS (SELECT traj_id, count(*) AS n FROM edges WHERE round = $r GROUP BY 1),
        tk AS (SELECT traj_id, sum(len(token_ids)) AS n FROM steps WHERE round = $r GROUP BY 1),
        t AS (
          SELECT t.group_id, t.traj_id, t.sample_idx, t.reward,
                 coalesce(sp.n, 0) + coalesce(ed.n, 0) AS marks, coalesce(tk.n, 0) AS n_tok
          FROM trajectories t LEFT JOIN sp USING (traj_id) LEFT JOIN ed USING (traj_id)
               LEFT JOIN tk USING (traj_id)
          WHERE t.round = $r
        ), g AS (
          SELECT group_id, count(DISTINCT reward > 0) > 1 AS mixed, sum(marks) AS marks, max(n_tok) AS n_tok
          FROM t GROUP BY group_id
        )
        SELECT traj_id FROM t
        WHERE group_id = (SELECT group_id FROM g ORDER BY mixed DESC, marks DESC, n_tok, group_id LIMIT 1)
        ORDER BY sample_idx, traj_id LIMIT 8
        """,
        {"r": round_},
    )
    return [r["traj_id"] for r in rows]


_CATEGORIES = """
    SELECT round, method,
           sum(CASE WHEN components.delta > 0 THEN 1 ELSE 0 END) AS progress,
           sum(CASE WHEN components.delta = 0 AND components.c_ret > 0 THEN 1 ELSE 0 END) AS keep,
           sum(CASE WHEN components.c_ret < 0 THEN 1 ELSE 0 END) AS regression,
           sum(CASE WHEN components.b_gate = 1 AND components.c_del <> 0 THEN 1 ELSE 0 END) AS delayed,
           sum(CASE WHEN components.c_ret = 0 AND coalesce(components.c_del, 0) = 0 THEN 1 ELSE 0 END) AS neutral
    FROM advantages WHERE role = 'assistant' AND components.c_ret IS NOT NULL
    GROUP BY ALL ORDER BY round, method
    """


def _annotations(con) -> dict:
    """Every round's C3 categories, refiner weights (a sample), detector spans and quarantined records."""
    return {
        "categories": _rows(con, _CATEGORIES),
        "weights": _rows(
            con,
            "SELECT round, method, components.w AS w FROM advantages WHERE role = 'assistant' "
            "AND components.w IS NOT NULL USING SAMPLE 20000 ROWS",
        ),
        "behaviors": _rows(
            con,
            "SELECT round, behavior, count(*) AS spans, avg(severity) AS severity FROM spans "
            "GROUP BY ALL ORDER BY round, behavior",
        ),
        "quarantine": _rows(
            con, "SELECT round, reason, count(*) AS n FROM quarantine GROUP BY ALL ORDER BY round, n DESC"
        ),
    }


def _viewer(con, rounds: list[int], n_traj: int) -> tuple[list[dict], list[dict]]:
    """The trajectories the viewer shows (`n_traj` per round) and each round's group (its members' indexes
    in the trajectory list; a member not picked for the viewer is added as `group_only`)."""
    trajs: list[dict] = []
    groups: list[dict] = []
    for r in rounds:
        methods = [
            row["method"]
            for row in _rows(con, "SELECT DISTINCT method FROM advantages WHERE round = ? ORDER BY 1", [r])
        ]
        for tid in pick_trajectories(con, r, n_traj):
            payload = trajectory_payload(con, r, tid, methods)
            payload["round"] = r
            trajs.append(payload)
        members = []
        known = {(t["round"], t["traj_id"]): i for i, t in enumerate(trajs)}
        for tid in pick_group(con, r):
            if (r, tid) not in known:
                payload = trajectory_payload(con, r, tid, methods)
                payload["round"] = r
                payload["group_only"] = True
                trajs.append(payload)
                known[(r, tid)] = len(trajs) - 1
            members.append(known[(r, tid)])
        if members:
            groups.append({"round": r, "group_id": trajs[members[0]]["group_id"], "members": members})
    return trajs, groups


def gather(lake: Lake, rounds: list[int] | None = None, n_traj: int = 8) -> dict:
    """Everything the report shows, from the lake's views: `rounds` (default: every round with advantages)."""
    con = connect(lake)
    try:
        all_rounds = [r["round"] for r in _rows(con, "SELECT DISTINCT round FROM advantages ORDER BY 1")]
        rounds = [r for r in rounds or all_rounds if r in all_rounds]
        last = rounds[-1] if rounds else None
        spread = within_trajectory_spread(con, last) if last is not None else []
        trajs, groups = _viewer(con, rounds, n_traj)
        return {
            "lake": lake.uri,
            "rounds": rounds,
            "summary": _rows(con, "SELECT * FROM credit_summary ORDER BY round, method"),
            "by_turn": turn_intervals(con, rounds),
            "outcomes": outcome_split(con, rounds),
            "histograms": advantage_histograms(con, last) if last is not None else [],
            "hist_round": last,
            "disagreement": sign_disagreement(con, last) if last is not None else [],
            "credit_trends": _rows(con, "SELECT * FROM credit_trends ORDER BY method, round"),
            "reward_trends": _rows(con, "SELECT * FROM reward_trends ORDER BY round"),
            "train": train_curves(con),
            "spread": spread,
            "default_method": default_method(spread),
            **_annotations(con),
            "trajectories": trajs,
            "groups": groups,
        }
    finally:
        con.close()


def to_json(data: dict) -> str:
    return json.dumps(data, default=float, separators=(",", ":"))
