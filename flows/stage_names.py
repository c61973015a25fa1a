"""The names a round's batch stages and their parts share (flows.batch runs the stages, flows.caching keys them;
both read these, so neither imports the other for them)."""

from __future__ import annotations

from pipeline.config import Config
from warehouse.lake import safe_part_name

CREDIT, EXPORT = "credit", "export"
# the statistics pass: the sufficient statistics of every batch-level statistic taken over the round
STATS = "credit_stats"


def method_slug(method: str) -> str:
    return safe_part_name(method.replace("+", "-"))


def advantages_part(batch: str, method: str) -> str:
    return f"{batch}.{method_slug(method)}"


def statistics_methods(config: Config) -> list[str]:
    """The estimators of the round's methods whose batch-level statistics span the round (empty: no pass)."""
    from pipeline.credit.registry import round_statistics_methods

    return [stage.name for stage in round_statistics_methods(config.methods, config)]
