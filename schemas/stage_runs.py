"""stage_runs: one row per (stage, batch) a flow ran: what went in and out, how long it took, what degraded.
The run summary (`creditflow stats`) is read from here, so it survives the process and needs no Prefect."""

import pyarrow as pa

from schemas import register_table
from schemas._base import TableSpec

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("batch", pa.string(), nullable=False),
        pa.field("seconds", pa.float64(), nullable=False),
        pa.field("trajectories", pa.int64(), nullable=False),
        pa.field("steps", pa.int64(), nullable=False),
        pa.field("tokens", pa.int64(), nullable=False),
        pa.field("rows_out", pa.map_(pa.string(), pa.int64()), nullable=False),
        pa.field("notes", pa.map_(pa.string(), pa.float64()), nullable=False),
        pa.field("warnings", pa.list_(pa.string()), nullable=False),
        pa.field("cache_key", pa.string()),
        pa.field("finished_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)

DOCS = {
    "round": "round partition key",
    "stage": "detect | annotate | counterfactual | credit | export (a flow stage)",
    "batch": "batch part name (b00000, ...)",
    "seconds": "wall seconds of the stage on this batch (the run that produced the current outputs)",
    "trajectories": "trajectories in the batch",
    "steps": "steps in the batch",
    "tokens": "tokens in the batch (0 where the stage reads none: GDPO's statistics pass by default)",
    "rows_out": "rows written per output table",
    "notes": "the stage's counters: LLM calls, cache hits, fallbacks, ... (methods' notes as method.key)",
    "warnings": "degraded but completed: endpoint down, fallbacks used, ...",
    "cache_key": "the flow cache key of the run (inputs + settings + code version)",
    "finished_at": "when the stage finished on this batch",
}

SPEC = register_table(TableSpec("stage_runs", SCHEMA, DOCS))


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
