"""`roll`: ROLL agentic rollout dumps. ROLL's `dump_rollout_trajectories` (roll/pipeline/agentic/utils.py,
alibaba/ROLL main, read 2025) writes the batch's `non_tensor_batch` columns, one row per sample, plus
`global_step`, to a table or file. This adapter reads such rows as JSONL, one trajectory per line, with ROLL's
agentic column names:

    {"traj_id": "...", "traj_group_id": "...", "episode_scores": 1.0, "step_scores": [0.0, 1.0],
     "messages": [OpenAI chat messages] (or "messages_list"), "global_step": 3, "env_ids": 5, "tags": "..."}

group = `traj_group_id` (the rollouts of one environment seed/prompt; ROLL normalises scores within it),
reward = `episode_scores`, per assistant turn `step_scores[k]` -> that turn's `verifier_score` (when given as a
list, it must have one score per assistant message), traj_id = `traj_id` (default `<file stem>:L<line>`).
Token ids / logprobs on messages are kept as in `chat-jsonl`. Other columns go to meta. Quarantined: no
messages, no episode score, a non-finite score, step_scores of the wrong length.
"""

from __future__ import annotations

from pipeline.ingest.chat_jsonl import convert_messages, prompt_group
from pipeline.ingest.core import (
    INVALID_VALUE,
    LENGTH_MISMATCH,
    MISSING_FIELD,
    Reject,
    SourceRecord,
    TrajectoryDraft,
    as_int,
    as_reward,
    read_jsonl,
)
from pipeline.ingest.registry import adapter

_KNOWN = {
    "traj_id",
    "traj_group_id",
    "episode_scores",
    "step_scores",
    "messages",
    "messages_list",
    "global_step",
}


def _scalar(value, name: str):
    if isinstance(value, list):
        if len(value) != 1:
            raise Reject(INVALID_VALUE, f"{name} is a list of {len(value)}, expected one score", name)
        value = value[0]
    return as_reward(value, name)


@adapter("roll", reader=read_jsonl, action_format="openai_tools", extensions=(".jsonl",))
def roll(record: SourceRecord) -> TrajectoryDraft:
    """ROLL agentic rollout dump rows (traj_id, traj_group_id, episode_scores, step_scores, messages)."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an object")
    messages = data.get("messages", data.get("messages_list"))
    if messages is None:
        raise Reject(MISSING_FIELD, "'messages' is missing", "messages")
    if data.get("episode_scores") is None:
        raise Reject(MISSING_FIELD, "'episode_scores' is missing", "episode_scores")
    reward = _scalar(data["episode_scores"], "episode_scores")
    steps = convert_messages(messages)
    scores = data.get("step_scores")
    if scores is not None:
        asst = [s for s in steps if s.role == "assistant"]
        scores = scores if isinstance(scores, list) else [scores] * len(asst)
        if len(scores) != len(asst):
            raise Reject(
                LENGTH_MISMATCH, f"{len(scores)} step_scores for {len(asst)} assistant turns", "step_scores"
            )
        for k, (step, score) in enumerate(zip(asst, scores, strict=True)):
            step.verifier_score = as_reward(score, f"step_scores[{k}]")
    line = record.location.removeprefix("line ")
    step_no = data.get("global_step")
    return TrajectoryDraft(
        traj_id=str(data["traj_id"]) if data.get("traj_id") is not None else f"{record.stem}:L{line}",
        group_id=str(data["traj_group_id"])
        if data.get("traj_group_id") is not None
        else prompt_group(messages),
        reward=reward,
        policy_version=str(as_int(step_no, "global_step")) if step_no is not None else None,
        meta={k: v for k, v in data.items() if k not in _KNOWN} or None,
        steps=steps,
    )
