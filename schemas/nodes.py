"""nodes (IAPO): one row per assistant action with its error flag and direct-user citation count."""

import pyarrow as pa

from schemas._base import TableSpec

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("error", pa.int8(), nullable=False),
        pa.field("error_kind", pa.string()),
        pa.field("u_dir", pa.int32(), nullable=False),
        pa.field("annotator", pa.string(), nullable=False),
        pa.field("parse_failed", pa.bool_()),
    ]
)

DOCS = {
    "round": "round partition key",
    "traj_id": "trajectory",
    "turn": "action index i (= assistant turn, 1-based)",
    "error": "e_i in {0,1}: tool/schema/runtime/rule failure or explicit rejection",
    "error_kind": "tool | schema | runtime | rule | rejection | none",
    "u_dir": "number of cited user turns with no assistant elicitor",
    "annotator": "annotator id (rules, llm:<model>)",
    "parse_failed": "the annotator's answer could not be used: empty graph, uniform fallback",
}

SPEC = TableSpec("nodes", SCHEMA, DOCS)


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
