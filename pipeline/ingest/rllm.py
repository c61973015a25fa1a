"""`rllm`: rLLM episodes, in the two shapes rLLM code produces (rllm-org/rllm, commit 9beb6e0, 2026-08):

1. what rLLM writes to disk while training: `EpisodeLogger.log_episodes_batch` (rllm/utils/episode_logger.py),
   one folder per step `<episode_log_dir>/episodes/<mode>_step_<step>_epoch_<epoch>/` holding one pretty-printed
   JSON file per episode, `episode_hash<task hash>_id<episode id>.json`:

       {"training_step", "epoch", "episode_id": "<task_id>:<rollout_idx>", "session_id", "task", "task_hash",
        "is_correct", "termination_reason", "metrics", "metadata", "timing",
        "trajectories": [{"name", "uid", "reward", "num_steps", "timing",
                          "steps": [{"observation", "thought", "action", "reward", "done", "model_response",
                                     "chat_completions", "timing"}, ...]}, ...]}

   plus `batch_summary.json` (counts only: not a record, skipped). No token ids or logprobs are written: every
   step's text is tokenized at ingest.
2. `Episode.to_dict()` (rllm/types.py), one object per line or a JSON list: the same trajectories with `id` and,
   per step, `prompt_ids`, `response_ids`, `logprobs` (what the policy sampled; kept exactly).

One creditflow trajectory per rLLM trajectory: traj_id `<episode id>/<name>` (`/<uid>` appended when a name
repeats in the episode), group `<task_id>:<name>` (rLLM's TrajectoryGroup id: all rollouts of a task, per agent
role), sample_idx the rollout index; for logger files both are prefixed with the step folder
(`train_step_7_epoch_0/`), since every training step logs its own episodes. Steps: the context messages of each
rLLM step that are new since the previous step (from `chat_completions`, else the step's `observation` as a user
message), then one assistant step whose token ids and logprobs are the step's `response_ids` / `logprobs` when
given and whose text is `model_response` (else the last assistant message); the assistant's tool calls are those
of the last assistant message of `chat_completions`. Reward: the trajectory's `reward`, else the sum of step
rewards; per-step rewards go to `verifier_score` of each assistant step when any is non-zero. Quarantined: no
trajectories, no steps, logprobs not as long as response_ids, no reward at all.
"""

from __future__ import annotations

import json
from pathlib import PurePath

from pipeline.ingest.chat_jsonl import convert_messages, parse_tool_calls
from pipeline.ingest.readers import read_json_list, read_jsonl
from pipeline.ingest.records import (
    INVALID_VALUE,
    LENGTH_MISMATCH,
    MISSING_FIELD,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    content_text,
    require,
)
from pipeline.ingest.registry import adapter
from pipeline.render import render_assistant

SUMMARY_FILE = "batch_summary.json"  # EpisodeLogger's per-step counts, beside the episode files


def read_episodes(text: str, source_file: str):
    """JSONL (one episode per line), a JSON list of episodes, or one JSON episode (EpisodeLogger's files);
    EpisodeLogger's `batch_summary.json` holds no episode and gives no record."""
    if PurePath(source_file).name == SUMMARY_FILE:
        return
    head = text.lstrip()[:1]
    if head == "[":
        yield from read_json_list(text, source_file)
    elif head == "{" and "\n" not in text.strip():
        yield from read_jsonl(text, source_file)
    elif head == "{":
        try:
            data = json.loads(text)
        except ValueError:
            yield from read_jsonl(text, source_file)  # JSONL: one object per line
            return
        yield SourceRecord(source_file, "$", text, data)
    else:
        yield from read_jsonl(text, source_file)


def _context_steps(step: dict, seen: int, where: str) -> tuple[list[StepDraft], int]:
    """New non-assistant messages of this step's chat_completions (after the first `seen`)."""
    chat = step.get("chat_completions") or []
    if not isinstance(chat, list):
        raise Reject(INVALID_VALUE, f"{where}.chat_completions is not a list", f"{where}.chat_completions")
    if chat:
        new = [m for m in chat[seen:] if isinstance(m, dict) and m.get("role") != "assistant"]
        # the step's own answer may be the last message; it is the assistant step below
        return convert_messages(
            [
                {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id")}
                for m in new
            ],
            f"{where}.chat_completions",
        ), len(chat)
    obs = step.get("observation")
    if obs is None or obs == "":
        return [], seen
    text = obs if isinstance(obs, str) else json.dumps(obs, ensure_ascii=False, default=str)
    return [StepDraft(role="user", content=text)], seen


def _assistant(step: dict, where: str) -> StepDraft:
    ids = step.get("response_ids")
    lps = step.get("logprobs")
    if ids is not None and not isinstance(ids, list):
        raise Reject(INVALID_VALUE, f"{where}.response_ids is not a list", f"{where}.response_ids")
    if lps is not None and not isinstance(lps, list):
        raise Reject(INVALID_VALUE, f"{where}.logprobs is not a list", f"{where}.logprobs")
    ids = ids or None
    lps = lps or None
    if lps is not None and ids is not None and len(lps) != len(ids):
        raise Reject(
            LENGTH_MISMATCH, f"{where}: {len(ids)} response_ids but {len(lps)} logprobs", f"{where}.logprobs"
        )
    text = step.get("model_response")
    if not text:
        chat = step.get("chat_completions") or []
        last = chat[-1] if chat and isinstance(chat[-1], dict) else {}
        text = last.get("content") if last.get("role") == "assistant" else ""
    content = content_text(text, f"{where}.model_response")
    chat = step.get("chat_completions") or []
    last = chat[-1] if isinstance(chat, list) and chat and isinstance(chat[-1], dict) else {}
    calls = None
    if last.get("role") == "assistant" and last.get("tool_calls"):
        calls = parse_tool_calls(last["tool_calls"], f"{where}.chat_completions[-1].tool_calls")
        content, _ = render_assistant(content, calls)
    return StepDraft(role="assistant", content=content, token_ids=ids, logprobs=lps, tool_calls=calls)


def convert_trajectory(
    episode: dict, traj: dict, t_index: int, names: dict[str, int], folder: str = ""
) -> TrajectoryDraft:
    """One rLLM trajectory; `folder`: the EpisodeLogger step folder (prefix of traj and group ids)."""
    where = f"trajectories[{t_index}]"
    id_key = "episode_id" if "episode_id" in episode else "id"  # EpisodeLogger file / Episode.to_dict()
    ep_id = str(episode.get(id_key) or "")
    if not ep_id:
        raise Reject(MISSING_FIELD, f"'{id_key}' is missing", id_key)
    task_id, _, rollout = ep_id.rpartition(":")
    if not task_id:
        task_id, rollout = ep_id, ""
    steps_raw = require(traj, "steps", where)
    if not isinstance(steps_raw, list) or not steps_raw:
        raise Reject(MISSING_FIELD, f"{where} has no steps", f"{where}.steps")
    steps: list[StepDraft] = []
    seen = 0
    prompt_tokens = []
    step_rewards = []
    for k, step in enumerate(steps_raw):
        w = f"{where}.steps[{k}]"
        if not isinstance(step, dict):
            raise Reject(INVALID_VALUE, f"{w} is not an object", w)
        context, seen = _context_steps(step, seen, w)
        steps.extend(context)
        asst = _assistant(step, w)
        steps.append(asst)
        prompt_tokens.append(len(step.get("prompt_ids") or []))
        step_rewards.append(step.get("reward"))
    reward = traj.get("reward")
    numeric = [r for r in step_rewards if isinstance(r, (int, float)) and not isinstance(r, bool)]
    if reward is None:
        if not numeric:
            raise Reject(MISSING_FIELD, f"{where} has no reward and no step rewards", f"{where}.reward")
        reward = float(sum(numeric))
    if any(r != 0 for r in numeric):
        asst_steps = [s for s in steps if s.role == "assistant"]
        for s, r in zip(asst_steps, step_rewards, strict=True):
            s.verifier_score = r
    name = str(traj.get("name") or "default_traj_name")
    names[name] = names.get(name, 0) + 1
    traj_id = f"{ep_id}/{name}" if names[name] == 1 else f"{ep_id}/{name}/{traj.get('uid') or t_index}"
    prefix = f"{folder}/" if folder else ""
    sample_idx = int(rollout) if rollout.isdigit() else None
    meta = {
        "episode_id": ep_id,
        "trajectory_uid": traj.get("uid"),
        "name": name,
        "is_correct": episode.get("is_correct"),
        "termination_reason": episode.get("termination_reason"),
        "prompt_tokens": prompt_tokens if any(prompt_tokens) else None,
        "training_step": episode.get("training_step"),
        "epoch": episode.get("epoch"),
        "task_hash": episode.get("task_hash"),
        "info": traj.get("info") or None,
        "metrics": episode.get("metrics") or None,
    }
    return TrajectoryDraft(
        traj_id=prefix + traj_id,
        group_id=f"{prefix}{task_id}:{name}",
        sample_idx=sample_idx,
        reward=reward,
        steps=steps,
        policy_version=str(episode["training_step"]) if episode.get("training_step") is not None else None,
        meta={k: v for k, v in meta.items() if v is not None},
    )


def _split(text: str, source_file: str):
    """One record per rLLM trajectory (an episode may hold several); an episode-level error is one record."""
    for record in read_episodes(text, source_file):
        data = record.data
        if (
            record.error is not None
            or not isinstance(data, dict)
            or not isinstance(data.get("trajectories"), list)
            or not data["trajectories"]
        ):
            yield record
            continue
        names: dict[str, int] = {}
        for i, traj in enumerate(data["trajectories"]):
            sub = SourceRecord(
                record.source_file,
                f"{record.location}.trajectories[{i}]",
                record.raw,
                data,
                context={"t_index": i, "names": names, "traj": traj},
            )
            yield sub


@adapter("rllm", reader=_split, action_format=None, extensions=(".jsonl", ".json"))
def rllm(record: SourceRecord) -> TrajectoryDraft:
    """rLLM Episode JSON (Episode.to_dict): trajectories -> steps with response_ids, logprobs, reward."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an episode object")
    if "traj" not in record.context:
        trajs = data.get("trajectories")
        if trajs is None or trajs == []:
            raise Reject(MISSING_FIELD, "episode has no trajectories", "trajectories")
        raise Reject(INVALID_VALUE, "'trajectories' is not a list", "trajectories")
    traj = record.context["traj"]
    if not isinstance(traj, dict):
        raise Reject(
            INVALID_VALUE, "trajectory is not an object", f"trajectories[{record.context['t_index']}]"
        )
    folder = PurePath(record.source_file).parent.name if "episode_id" in data else ""
    return convert_trajectory(data, traj, record.context["t_index"], record.context["names"], folder)
