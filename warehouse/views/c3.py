"""C3 views: how much positive credit the detected behaviour spans get, per method, before and after c3."""

from warehouse.views import register_view

register_view(
    "behavior_stats",
    r"""
    WITH per_span AS (
        SELECT s.round, s.behavior, a.method,
               regexp_replace(a.method, '\+c3$', '') AS base_method,
               s.token_end - s.token_start AS tokens,
               coalesce(list_sum(list_transform(list_slice(a.token_adv, s.token_start + 1, s.token_end),
                                                lambda x: greatest(x, 0))), 0) AS pos_after,
               coalesce(list_sum(list_transform(list_slice(b.token_adv, s.token_start + 1, s.token_end),
                                                lambda x: greatest(x, 0))), 0) AS pos_before,
               t.reward > 0 AS successful
        FROM spans s
        JOIN advantages a ON a.round = s.round AND a.traj_id = s.traj_id AND a.step_idx = s.step_idx
        LEFT JOIN advantages b ON b.round = s.round AND b.traj_id = s.traj_id AND b.step_idx = s.step_idx
                              AND b.method = regexp_replace(a.method, '\+c3$', '')
        LEFT JOIN trajectories t ON t.round = s.round AND t.traj_id = s.traj_id
    )
    SELECT round, behavior, method, any_value(base_method) AS base_method,
           count(*) AS spans,
           sum(tokens) AS tokens,
           sum(pos_before) / nullif(sum(tokens), 0) AS mean_pos_credit_before,
           sum(pos_after) / nullif(sum(tokens), 0) AS mean_pos_credit_after,
           avg(CASE WHEN successful THEN 1.0 ELSE 0.0 END) AS share_successful,
           count(*) FILTER (WHERE successful AND pos_after > 0) AS misguided_spans,
           coalesce(sum(pos_after) FILTER (WHERE successful), 0) AS misguided_credit
    FROM per_span
    GROUP BY round, behavior, method
    ORDER BY round, behavior, method
    """,
    "behaviour x method: spans, tokens, mean positive credit per span token before (base method = the method "
    "without '+c3') and after, share of spans in successful trajectories (reward > 0), and the misguided "
    "reinforcement: spans of successful trajectories that still get positive credit, and that credit",
)
