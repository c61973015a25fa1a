"""`tau-bench`: tau-bench v1 results (historical_trajectories/*.json): a JSON list of
`{task_id, reward, info: {task, reward_info, source, user_cost}, traj: [OpenAI messages], trial}`.

group = task_id, sample_idx = trial, traj_id `<file stem>:<task_id>:<trial>`. tau-bench's tools return
errors as text starting with "Error:" (its environment catches the exception and returns the message), so
those tool steps get `is_error`. `meta` keeps `task_id`, `trial` and the whole `info` (task instruction, gold
actions and outputs, reward_info).
"""

from __future__ import annotations

from pipeline.ingest.chat_jsonl import convert_messages
from pipeline.ingest.readers import read_json_list
from pipeline.ingest.records import INVALID_VALUE, Reject, SourceRecord, TrajectoryDraft, as_int, require
from pipeline.ingest.registry import adapter

TOOL_ERROR_PREFIX = "Error:"


@adapter("tau-bench", reader=read_json_list, action_format="openai_tools", extensions=(".json",))
def tau_bench(record: SourceRecord) -> TrajectoryDraft:
    """tau-bench v1 results JSON (list of task runs)."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an object")
    task_id = require(data, "task_id")
    trial = as_int(require(data, "trial"), "trial")
    reward = require(data, "reward")
    steps = convert_messages(require(data, "traj"), "traj", tool_error_prefix=TOOL_ERROR_PREFIX)
    info: dict = data["info"] if isinstance(data.get("info"), dict) else {}
    meta = {"task_id": task_id, "trial": trial, **info}
    meta.update({k: v for k, v in data.items() if k not in {"task_id", "trial", "reward", "traj", "info"}})
    return TrajectoryDraft(
        traj_id=f"{record.stem}:{task_id}:{trial}",
        group_id=str(task_id),
        sample_idx=trial,
        reward=reward,
        meta=meta,
        steps=steps,
    )
