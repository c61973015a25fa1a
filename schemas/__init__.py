"""Arrow schemas of every lake table, one module each. `TABLES[name].validate(table)` checks a table."""

from schemas import (
    advantages,
    counterfactuals,
    edges,
    nodes,
    quarantine,
    spans,
    steps,
    train_batch,
    trajectories,
)
from schemas._base import SchemaError, TableSpec

TABLES: dict[str, TableSpec] = {
    m.SPEC.name: m.SPEC
    for m in (trajectories, steps, spans, nodes, edges, counterfactuals, advantages, train_batch, quarantine)
}


def register_table(spec: TableSpec) -> TableSpec:
    """Add a table owned by a later stage (llm_calls, train_metrics, ...) to the catalog."""
    TABLES[spec.name] = spec
    return spec


__all__ = ["TABLES", "SchemaError", "TableSpec", "register_table"]
