"""spans (C3): undesirable behaviour spans found by the rule detectors."""

import pyarrow as pa

from schemas._base import TableSpec

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("step_idx", pa.int32(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("token_start", pa.int32(), nullable=False),
        pa.field("token_end", pa.int32(), nullable=False),
        pa.field("char_start", pa.int32(), nullable=False),
        pa.field("char_end", pa.int32(), nullable=False),
        pa.field("behavior", pa.string(), nullable=False),
        pa.field("severity", pa.float64(), nullable=False),
        pa.field("rule", pa.string(), nullable=False),
        pa.field("evidence", pa.string()),
        pa.field("reason", pa.string()),
    ]
)

DOCS = {
    "round": "round partition key",
    "traj_id": "trajectory",
    "step_idx": "assistant step holding the span",
    "turn": "1-based turn k",
    "token_start": "first token of the span within the step's token_ids",
    "token_end": "one past the last token (half-open)",
    "char_start": "char start of the span in the step's content",
    "char_end": "char end (half-open)",
    "behavior": "invalid_action | query_loop | near_repetition | user-registered behaviour",
    "severity": "s in [0,1] (Table 5: 1.0, 1.0, 0.5)",
    "rule": "detector rule that fired, e.g. search_r1.malformed",
    "evidence": "what the rule saw (repeated query, earlier turn, error text)",
    "reason": "one sentence: why this span is undesirable (for a repeat: what it repeats and that nothing it "
    "depends on changed in between)",
}

SPEC = TableSpec("spans", SCHEMA, DOCS)


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
