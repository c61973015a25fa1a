"""counterfactuals (TCPO): alternatives sampled under the same history h_{i,k} and re-verified."""

import pyarrow as pa

from schemas._base import TableSpec

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("alt_idx", pa.int32(), nullable=False),
        pa.field("text", pa.string()),
        pa.field("score", pa.float64()),
        pa.field("surprisal", pa.float64()),
        pa.field("sampler", pa.string(), nullable=False),
        pa.field("verifier", pa.string()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
    ]
)

DOCS = {
    "round": "round partition key",
    "traj_id": "trajectory i",
    "turn": "selected turn k",
    "alt_idx": "alternative index 1..M",
    "text": "sampled alternative action",
    "score": "verifier score q_m of the alternative; null when sampling or verifying failed",
    "surprisal": "xi_{i,k} of the original turn (why it was selected)",
    "sampler": "model / endpoint that produced it",
    "verifier": "verifier name",
    "status": "ok | sample_failed | verify_failed",
    "error": "what went wrong, when status is not ok",
}

SPEC = TableSpec("counterfactuals", SCHEMA, DOCS)


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
