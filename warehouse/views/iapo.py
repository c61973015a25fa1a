"""IAPO views: per-action routing weights and how far the router is from flat credit."""

from warehouse.views import register_view

register_view(
    "iapo_weights",
    """
    SELECT a.round, a.method, a.traj_id, a.group_id, a.step_idx, a.turn,
           len(a.token_adv) AS tokens,
           sign(a.components.a_hat) AS a_hat_sign,
           CASE WHEN a.components.a_hat > 0 THEN 'positive' WHEN a.components.a_hat < 0 THEN 'negative'
                ELSE 'zero' END AS branch,
           a.components.a_hat AS a_hat,
           a.components.w AS w,
           a.components.m_plus AS m_plus,
           a.components.m_minus AS m_minus,
           a.components.phi_plus AS phi_plus,
           a.components.phi_minus AS phi_minus,
           a.components.d_plus AS d_plus,
           a.components.d_minus AS d_minus,
           a.components.d_in AS d_in
    FROM advantages a
    WHERE a.role = 'assistant' AND a.components.w IS NOT NULL
    """,
    "IAPO per-action routing: method, trajectory, turn, tokens, sign of A_hat (branch), w, m_plus, m_minus, "
    "phi_plus, phi_minus and the degrees d_plus, d_minus, d_in",
)

register_view(
    "iapo_router_summary",
    """
    SELECT round, method, branch,
           count(*) AS actions,
           count(DISTINCT traj_id) AS trajectories,
           avg(w) AS mean_w,
           stddev_pop(w) AS std_w,
           min(w) AS min_w,
           max(w) AS max_w,
           avg(CASE WHEN abs(w - 1) > 0.1 THEN 1.0 ELSE 0.0 END) AS share_moved_10pct,
           sum(tokens * w) / nullif(sum(tokens), 0) AS token_mean_w
    FROM iapo_weights
    GROUP BY ALL
    ORDER BY round, method, branch
    """,
    "how far from flat the IAPO router is, per (round, method, branch = sign of A_hat): std/min/max of w, share "
    "of actions moved more than 10% from flat credit, token-weighted mean w (1 by mass conservation)",
)
