"""trajectories: one row per rollout (an episode of one prompt)."""

import pyarrow as pa

from schemas._base import TableSpec, check_finite, check_unique

ACTION_FORMATS = {"openai_tools", "search_r1", "react", "webshop", "code", "chat"}

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("sample_idx", pa.int32(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("reward_components", pa.map_(pa.string(), pa.float64())),
        pa.field("source", pa.string(), nullable=False),
        pa.field("action_format", pa.string()),
        pa.field("policy_version", pa.string()),
        pa.field("meta", pa.string()),
    ]
)

DOCS = {
    "round": "collect/process/train round this rollout belongs to (hive partition key)",
    "traj_id": "unique id of the trajectory within the lake",
    "group_id": "prompt id x: all samples of one prompt share it (GRPO group)",
    "sample_idx": "index of the sample within its group (0-based)",
    "reward": "outcome reward R_i",
    "reward_components": "per-component rewards R_i^c (GDPO); null when there is one reward",
    "source": "where the record came from: format and file",
    "action_format": "how actions are written: openai_tools, search_r1, react, webshop, code, chat",
    "policy_version": "checkpoint that generated the rollout",
    "meta": "JSON object: task, tools (OpenAI tool specs), gold answers, env info, sampling params",
}

SPEC = TableSpec(
    "trajectories",
    SCHEMA,
    DOCS,
    checks=(check_unique("trajectories", "traj_id"), check_finite("trajectories", "reward")),
)


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
