"""edges (IAPO): typed, signed dependency edges src_turn -> dst_turn (src < dst)."""

import pyarrow as pa

from schemas._base import TableSpec, check_in

EDGE_TYPES = {"input", "success_utilization", "failed_utilization"}

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("src_turn", pa.int32(), nullable=False),
        pa.field("dst_turn", pa.int32(), nullable=False),
        pa.field("sign", pa.int8(), nullable=False),
        pa.field("type", pa.string(), nullable=False),
        pa.field("info_unit", pa.string()),
        pa.field("binding", pa.string()),
        pa.field("annotator", pa.string(), nullable=False),
        pa.field("prompt_version", pa.string()),
    ]
)

DOCS = {
    "round": "round partition key",
    "traj_id": "trajectory",
    "src_turn": "source action i",
    "dst_turn": "dependent action j (i < j)",
    "sign": "+1 for E+ (input, success_utilization), -1 for E- (failed_utilization)",
    "type": "input | success_utilization | failed_utilization",
    "info_unit": "the specific information unit the edge carries",
    "binding": "parameter / argument / branch / recovery it binds to",
    "annotator": "annotator id",
    "prompt_version": "annotator prompt version (llm annotator)",
}

SPEC = TableSpec("edges", SCHEMA, DOCS, checks=(check_in("edges", "type", EDGE_TYPES),))


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
