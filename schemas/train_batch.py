"""train_batch: the flat per-trajectory layout external trainers (verl, OpenRLHF, TRL) consume."""

import pyarrow as pa

from schemas._base import TableSpec, check_same_length

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("method", pa.string(), nullable=False),
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("old_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("advantages", pa.list_(pa.float32()), nullable=False),
        pa.field("values", pa.list_(pa.float32())),
        pa.field("returns", pa.list_(pa.float32())),
        pa.field("turn_ids", pa.list_(pa.int16()), nullable=False),
        pa.field("logprobs_known", pa.bool_()),
    ]
)

DOCS = {
    "round": "round",
    "method": "credit method chain",
    "traj_id": "trajectory",
    "group_id": "prompt group (verl uid)",
    "reward": "outcome reward",
    "input_ids": "all tokens of the trajectory, in order",
    "loss_mask": "1 on assistant tokens (trained), 0 on system/user/tool tokens",
    "old_logprobs": "behaviour logprobs (0 where unknown or masked)",
    "advantages": "per-token advantage (0 where masked)",
    "values": "critic values (gae only)",
    "returns": "critic targets (gae only)",
    "turn_ids": "assistant turn of each token (0 on masked tokens)",
    "logprobs_known": "old_logprobs are the behaviour policy's on every trained token (false: 0-filled, unknown)",
}

SPEC = TableSpec(
    "train_batch",
    SCHEMA,
    DOCS,
    checks=(
        check_same_length(
            "train_batch",
            "input_ids",
            "loss_mask",
            "old_logprobs",
            "advantages",
            "values",
            "returns",
            "turn_ids",
        ),
    ),
)


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
