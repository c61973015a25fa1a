"""Views over the training loop: how the policy's outcomes and the trainer's statistics move round by round
(`creditflow loop` writes one lake partition per round: the collected trajectories of policy P_r, and the
train_metrics of the update that made P_{r+1})."""

from warehouse.views import register_view

register_view(
    "learning_curve",
    """
    WITH t AS (
      SELECT round, count(*) AS episodes, avg(reward) AS mean_reward,
             avg(CASE WHEN reward >= 1 THEN 1.0 ELSE 0.0 END) AS success_rate,
             1.96 * coalesce(stddev_samp(CASE WHEN reward >= 1 THEN 1.0 ELSE 0.0 END), 0) / sqrt(count(*))
               AS success_ci95
      FROM trajectories GROUP BY round
    ), m AS (
      SELECT round, string_agg(DISTINCT method, ',') AS method, count(*) AS train_steps, sum(tokens) AS train_tokens,
             avg(loss) AS loss, avg(pg_loss) AS pg_loss, avg(entropy) AS entropy, avg(approx_kl) AS approx_kl,
             avg(clip_frac) AS clip_frac, avg(grad_norm) AS grad_norm
      FROM train_metrics GROUP BY round
    )
    SELECT t.round, m.method, t.episodes, t.mean_reward, t.success_rate, t.success_ci95,
           m.train_steps, m.train_tokens, m.loss, m.pg_loss, m.entropy, m.approx_kl, m.clip_frac, m.grad_norm
    FROM t LEFT JOIN m USING (round)
    ORDER BY t.round
    """,
    "per round: the collected episodes' mean reward and success rate (reward >= 1, with a normal 95% interval) "
    "of the policy that collected them, beside the mean train_metrics of the update trained on that round",
)
