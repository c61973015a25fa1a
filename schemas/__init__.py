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
from schemas._base import SchemaError, TableSpec, is_text, one_chunk, round_column, strictly_increasing

TABLES: dict[str, TableSpec] = {
    m.SPEC.name: m.SPEC
    for m in (trajectories, steps, spans, nodes, edges, counterfactuals, advantages, train_batch, quarantine)
}


def register_table(spec: TableSpec) -> TableSpec:
    """Add a table owned by a later stage (llm_calls, train_metrics, ...) to the catalog."""
    TABLES[spec.name] = spec
    return spec


def _load_all() -> None:
    """Import every other table module of this package: each registers itself (llm_calls, train_metrics, ...)."""
    import importlib
    import pkgutil

    for mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if not mod.startswith("_"):
            importlib.import_module(f"schemas.{mod}")


_load_all()

__all__ = [
    "TABLES",
    "SchemaError",
    "TableSpec",
    "register_table",
    "is_text",
    "one_chunk",
    "round_column",
    "strictly_increasing",
]
