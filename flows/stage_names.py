"""The names a round's batch stages and their parts share (flows.batch runs the stages, flows.caching keys them;
both read these, so neither imports the other for them). The stages themselves are declared in pipeline/
(pipeline.stages.BatchStage); these are the names the flows' callers use."""

from __future__ import annotations

from pipeline.credit.process import CREDIT, STATS, statistics_methods
from pipeline.export import EXPORT
from pipeline.stages import BatchStage
from warehouse.lake import safe_part_name

__all__ = [
    "CREDIT",
    "EXPORT",
    "STATS",
    "advantages_part",
    "method_slug",
    "stage_parts",
    "stage_reads",
    "stage_writes",
    "statistics_methods",
]


def method_slug(method: str) -> str:
    return safe_part_name(method.replace("+", "-"))


def advantages_part(batch: str, method: str) -> str:
    return f"{batch}.{method_slug(method)}"


def stage_parts(
    tables: tuple[str, ...], per_method: tuple[str, ...], batch: str, methods: list[str]
) -> list[tuple[str, str, str]]:
    """(table, part, key in the stage's inputs / outputs) of one batch: a part named like the batch per table,
    one per method (`<batch>.<method>`) per per-method table."""
    from pipeline.stages import method_key

    out = [(t, batch, t) for t in tables]
    out += [(t, advantages_part(batch, m), method_key(t, m)) for t in per_method for m in methods]
    return out


def stage_reads(stage: BatchStage, batch: str, config) -> list[tuple[str, str, str]]:
    """What a stage reads of one batch besides trajectories and steps: (table, part, key in `inputs`)."""
    return stage_parts(stage.tables_needed(config), stage.needs_per_method, batch, list(config.methods))


def stage_writes(stage: BatchStage, batch: str, methods: list[str]) -> list[tuple[str, str, str]]:
    """What a stage writes for one batch: (table, part, key in its StageOutput.tables)."""
    return stage_parts(stage.produces, stage.produces_per_method, batch, methods)
