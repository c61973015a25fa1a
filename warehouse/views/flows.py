"""Flow run views: what each stage did over a round (from the `stage_runs` run log)."""

from schemas import stage_runs as _stage_runs  # noqa: F401  (registers the table before the catalog is built)
from warehouse.views import register_view

register_view(
    "stage_summary",
    """
    SELECT r.round, r.stage,
           count(*) AS batches,
           sum(r.trajectories) AS trajectories,
           sum(r.tokens) AS tokens,
           sum(r.seconds) AS seconds,
           sum(len(r.warnings)) AS warnings
    FROM stage_runs r
    GROUP BY ALL
    ORDER BY r.round, min(r.finished_at)
    """,
    "one row per (round, flow stage): batches, trajectories, tokens, summed stage seconds, warnings",
)
