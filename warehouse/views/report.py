"""Views behind the report: sign disagreement between methods, TCPO credit categories, per-round trends."""

from warehouse.views import register_view

register_view(
    "sign_disagreement",
    """
    SELECT a.round, a.method AS method_a, b.method AS method_b,
           sum(len(a.token_adv)) AS tokens,
           sum(list_sum(list_transform(list_zip(a.token_adv, b.token_adv),
               lambda p: CASE WHEN sign(p[1]) <> sign(p[2]) THEN 1 ELSE 0 END))) AS tokens_sign_differs,
           tokens_sign_differs / nullif(tokens, 0) AS share_sign_differs
    FROM advantages a
    JOIN advantages b ON a.round = b.round AND a.traj_id = b.traj_id AND a.step_idx = b.step_idx
         AND a.method < b.method
    WHERE a.role = 'assistant'
    GROUP BY ALL
    """,
    "share of assistant tokens whose advantage sign differs between two methods (every pair of methods)",
)

register_view(
    "tcpo_categories",
    """
    SELECT round, method, turn,
           CASE WHEN components.delta > 0 THEN 'progress'
                WHEN components.c_ret > 0 THEN 'keep'
                WHEN components.c_ret < 0 THEN 'regression'
                WHEN components.b_gate = 1 THEN 'delayed'
                ELSE 'neutral' END AS category,
           count(*) AS turns,
           avg(list_avg(token_adv)) AS mean_adv,
           avg(components.phi) AS mean_phi
    FROM advantages
    WHERE role = 'assistant' AND components.c_ret IS NOT NULL
    GROUP BY ALL
    """,
    "TCPO turns by credit category (progress, keep, regression, delayed, neutral) like the paper's Figure 2",
)

register_view(
    "credit_trends",
    """
    SELECT method, round,
           avg(list_avg(token_adv)) FILTER (WHERE role = 'assistant') AS mean_adv,
           avg(abs(list_avg(token_adv))) FILTER (WHERE role = 'assistant') AS mean_abs_adv,
           count(DISTINCT traj_id) AS trajectories
    FROM advantages
    GROUP BY ALL
    ORDER BY method, round
    """,
    "per-round trend of each method's credit (mean and mean absolute turn advantage)",
)

register_view(
    "reward_trends",
    """
    SELECT round, count(*) AS trajectories, avg(reward) AS mean_reward,
           avg(CASE WHEN reward > 0 THEN 1.0 ELSE 0.0 END) AS success_rate
    FROM trajectories
    GROUP BY ALL
    ORDER BY round
    """,
    "per-round outcome statistics of the rollouts",
)
