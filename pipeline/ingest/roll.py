"""`roll`: ROLL agentic rollout dumps (alibaba/ROLL, commit 8eb27cc, 2026-08).

What ROLL writes: with `rollout_dump_dir` set, `dump_rollout_trajectories` (roll/pipeline/agentic/utils.py)
pops the columns named in the batch's `COLUMMNS_CONFIG` from `non_tensor_batch`, drops the samples where any of
them is None, adds `global_step`, and `write_to_json_process` (roll/pipeline/rlvr/utils.py) writes
`<dir>/rollout_dump_data.step_<global_step>.jsonl`: ONE JSON line per step, column-oriented,

    {"trajectory_data": [JSON text, ...], "messages": [JSON text, ...], "tools": [JSON text, ...],
     "exp_name": [...], "global_step": [...]}

The agentic env managers (agent_native_env_manager.py, proxy_env_manager.py) fill them per trajectory:
`trajectory_data` = {trajectory_id, env_info: {env_id, group_id, tag, seed, episode_id, ...}, reward_info:
{episode_reward, step_rewards | step_reward}, length_info, failure_info, ...}; `messages` = the OpenAI messages of
the trajectory (agent-native: a list holding one message list; proxy: the message list); `tools` = the tool
schemas. Each row (one trajectory) becomes one record (location `line N row i`):
traj_id = `trajectory_id`; group = ROLL's `traj_group_id`, `<tag>_<group_id>_<episode_id>_<seed>` from env_info
(else the hash of the messages before the first assistant message); reward = `episode_reward`; per assistant turn
`step_rewards[k]` -> its `verifier_score` (when there is one per assistant message); policy_version =
`global_step`; `tools`, `exp_name`, env/length/failure info -> meta. The messages are text: tokenized at ingest.

Rows in the older flat shape (one JSON object per line: traj_id, traj_group_id, episode_scores, step_scores,
messages, global_step, ...) are still read. Quarantined: a row whose JSON columns do not parse, no messages, no
episode score, a non-finite score, step_scores of the wrong length, columns of different lengths.
"""

from __future__ import annotations

import json

from pipeline.ingest.chat_jsonl import convert_messages, prompt_group
from pipeline.ingest.readers import read_jsonl
from pipeline.ingest.records import (
    INVALID_VALUE,
    LENGTH_MISMATCH,
    MALFORMED_JSON,
    MISSING_FIELD,
    Reject,
    SourceRecord,
    TrajectoryDraft,
    as_int,
    as_reward,
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


def read_dump(text: str, source_file: str):
    """Each line: a column-oriented step dump (every value a list of one length) -> one record per row;
    else the line is one row (the older flat shape)."""
    for record in read_jsonl(text, source_file):
        data = record.data
        if record.error is not None or not isinstance(data, dict) or "trajectory_data" not in data:
            yield record
            continue
        lens = {k: len(v) if isinstance(v, list) else None for k, v in data.items()}
        if None in lens.values() or len(set(lens.values())) != 1:
            record.error = Reject(
                INVALID_VALUE,
                f"columns are not lists of one length ({', '.join(f'{k}: {n}' for k, n in lens.items())})",
                "trajectory_data",
            )
            yield record
            continue
        for i in range(len(next(iter(data.values())))):
            row = {k: v[i] for k, v in data.items()}
            raw = json.dumps(row, ensure_ascii=False)
            yield SourceRecord(source_file, f"{record.location} row {i}", raw, row, context={"row": i})


def _json_column(row: dict, name: str):
    value = row.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise Reject(MALFORMED_JSON, f"{name} is not JSON text: {exc}", name) from None


def convert_dump_row(record: SourceRecord) -> TrajectoryDraft:
    """One trajectory of a step dump: trajectory_data, messages and tools are JSON texts."""
    row = record.data
    data = _json_column(row, "trajectory_data")
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, "trajectory_data is not an object", "trajectory_data")
    messages = _json_column(row, "messages")
    if messages is None:
        raise Reject(MISSING_FIELD, "'messages' is missing", "messages")
    n_lists = 1
    if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
        n_lists = len(messages)  # agent-native: [messages]; several when branches were kept: the longest
        messages = max(messages, key=len)
    steps = convert_messages(messages)
    raw_info = data.get("reward_info")
    info = raw_info if isinstance(raw_info, dict) else {}
    if info.get("episode_reward") is None:
        raise Reject(MISSING_FIELD, "'trajectory_data.reward_info.episode_reward' is missing", "reward_info")
    reward = as_reward(info["episode_reward"], "reward_info.episode_reward")
    asst = [s for s in steps if s.role == "assistant"]
    scores = info.get("step_rewards")
    if isinstance(scores, list) and len(scores) == len(asst):
        for k, (step, score) in enumerate(zip(asst, scores, strict=True)):
            step.verifier_score = as_reward(score, f"reward_info.step_rewards[{k}]")
    env = data.get("env_info") if isinstance(data.get("env_info"), dict) else None
    if env is not None and all(env.get(k) is not None for k in ("tag", "group_id", "episode_id", "seed")):
        group = f"{env['tag']}_{env['group_id']}_{env['episode_id']}_{env['seed']}"
    else:
        group = prompt_group(messages)
    traj_id = data.get("trajectory_id")
    step_no = row.get("global_step")
    meta = {
        "exp_name": row.get("exp_name"),
        "tools": _json_column(row, "tools"),
        "env_info": env,
        "reward_info": info or None,
        "length_info": data.get("length_info"),
        "failure_info": data.get("failure_info"),
        "message_lists": n_lists if n_lists > 1 else None,
    }
    line = record.location.split()[1]
    return TrajectoryDraft(
        traj_id=str(traj_id) if traj_id else f"{record.stem}:L{line}:{record.context['row']}",
        group_id=group,
        reward=reward,
        policy_version=str(as_int(step_no, "global_step")) if step_no is not None else None,
        meta={k: v for k, v in meta.items() if v is not None},
        steps=steps,
    )


@adapter("roll", reader=read_dump, action_format="openai_tools", extensions=(".jsonl",))
def roll(record: SourceRecord) -> TrajectoryDraft:
    """ROLL agentic rollout dump (rollout_dump_data.step_N.jsonl, column-oriented; or flat rows)."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an object")
    if "trajectory_data" in data:
        return convert_dump_row(record)
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
