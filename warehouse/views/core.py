"""Core credit views: credit by method and turn, one summary row per method."""

from warehouse.views import register_view

register_view(
    "credit_by_turn",
    """
    SELECT a.round, a.method, a.turn,
           count(*) AS steps,
           sum(len(a.token_adv)) AS tokens,
           avg(list_avg(a.token_adv)) AS mean_adv,
           avg(CASE WHEN list_avg(a.token_adv) > 0 THEN 1.0 ELSE 0.0 END) AS share_positive
    FROM advantages a
    WHERE a.role = 'assistant'
    GROUP BY ALL
    """,
    "credit by method x assistant turn index: mean token advantage and share of positive turns",
)

register_view(
    "credit_summary",
    """
    SELECT a.round, a.method,
           count(DISTINCT a.traj_id) AS trajectories,
           sum(len(a.token_adv)) FILTER (WHERE a.role = 'assistant') AS assistant_tokens,
           avg(list_avg(a.token_adv)) FILTER (WHERE a.role = 'assistant') AS mean_adv,
           avg(list_aggregate(a.token_adv, 'stddev_pop')) FILTER (WHERE a.role = 'assistant') AS mean_within_step_std,
           min(list_min(a.token_adv)) AS min_adv,
           max(list_max(a.token_adv)) AS max_adv,
           sum(len(list_filter(a.token_adv, lambda x: x > 0))) AS positive_tokens,
           sum(len(list_filter(a.token_adv, lambda x: x < 0))) AS negative_tokens
    FROM advantages a
    GROUP BY ALL
    ORDER BY a.round, a.method
    """,
    "one row per (round, method): tokens, mean/min/max advantage, positive and negative token counts",
)
