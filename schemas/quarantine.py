"""quarantine: every rejected input record, verbatim, with the reason and where it came from."""

import pyarrow as pa

from schemas._base import TableSpec

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("source_file", pa.string(), nullable=False),
        pa.field("location", pa.string(), nullable=False),
        pa.field("record_id", pa.string()),
        pa.field("field", pa.string()),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string()),
        pa.field("raw", pa.string(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
    ]
)

DOCS = {
    "round": "round partition key",
    "source_file": "input file the record came from",
    "location": "line number (JSONL) or index path (JSON) of the record",
    "record_id": "record id when one could be read",
    "field": "the offending field",
    "reason": "why it was rejected: a stable category (malformed_json, missing_field, invalid_value, "
    "length_mismatch, non_finite_reward, duplicate_traj_id, unknown_role, unmatched_tool_result, "
    "schema_violation, adapter_error, invalid_tokens, invalid_utf8, unreadable_file), for GROUP BY",
    "detail": "what exactly, in words, for this record (the value, the position, the file read first)",
    "raw": "the record verbatim",
    "stage": "ingest adapter or pipeline stage that rejected it",
}

SPEC = TableSpec("quarantine", SCHEMA, DOCS)


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
