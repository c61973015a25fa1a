"""`chat-jsonl`: one trajectory per line, OpenAI chat messages.

    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ..., "tool_calls": [...],
                   "tool_call_id": ..., "token_ids": [...], "logprobs": [...], "verifier_score": 0.5}, ...],
     "reward": 1.0, "group_id": "...", "traj_id": "...", "sample_idx": 0, "reward_components": {...},
     "tools": [OpenAI tool specs], "policy_version": "...", "meta": {...}, ...}

Defaults: traj_id `<file stem>:L<line>`; group_id a hash of the messages before the first assistant message
(samples of one prompt share it); sample_idx the order of appearance in the group. Other top-level keys go to
`meta` unchanged. `logprobs` may be a list of floats or OpenAI's `{"content": [{"logprob": ...}, ...]}`.
"""

from __future__ import annotations

from typing import Any

from pipeline.ingest.readers import read_jsonl
from pipeline.ingest.records import (
    INVALID_VALUE,
    MISSING_FIELD,
    UNKNOWN_ROLE,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    arguments_text,
    as_int,
    content_text,
    prompt_hash,
    require,
)
from pipeline.ingest.registry import adapter
from pipeline.render import render_assistant

_ROLES = {"system", "user", "assistant", "tool"}


def parse_tool_calls(raw: Any, where: str) -> list[dict]:
    """OpenAI tool calls ({id, type, function: {name, arguments}}, or flat {id, name, arguments})."""
    if not isinstance(raw, list):
        raise Reject(INVALID_VALUE, f"{where} is not a list", where)
    calls = []
    for j, call in enumerate(raw):
        w = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise Reject(INVALID_VALUE, f"{w} is not an object", w)
        fn: dict = call["function"] if isinstance(call.get("function"), dict) else call
        call_id = call.get("id")
        if not call_id:
            raise Reject(MISSING_FIELD, f"'{w}.id' is missing", f"{w}.id")
        name = fn.get("name")
        if not name:
            raise Reject(MISSING_FIELD, f"'{w}.function.name' is missing", f"{w}.function.name")
        calls.append(
            {"id": str(call_id), "name": str(name), "arguments": arguments_text(fn.get("arguments"))}
        )
    return calls


def _logprob_list(raw: Any, where: str) -> list[float] | None:
    if raw is None:
        return None
    if isinstance(raw, dict) and isinstance(raw.get("content"), list):
        raw = [x.get("logprob") if isinstance(x, dict) else x for x in raw["content"]]
    if not isinstance(raw, list):
        raise Reject(INVALID_VALUE, f"{where} is not a list", where)
    return raw


def message_step(msg: Any, w: str) -> tuple[StepDraft, str]:
    """One OpenAI-style message -> its step (role checked, tool calls parsed and rendered into an assistant's
    content) and the message's own text. Shared by the chat-shaped adapters (chat-jsonl, tau-bench, tau2)."""
    role = require(msg, "role", w)
    if role not in _ROLES:
        raise Reject(UNKNOWN_ROLE, f"{w} has role {role!r}", f"{w}.role")
    text = content_text(msg.get("content"), f"{w}.content")
    step = StepDraft(role=role, content=text)
    if msg.get("tool_calls"):
        step.tool_calls = parse_tool_calls(msg["tool_calls"], f"{w}.tool_calls")
        if role == "assistant":
            step.content, _ = render_assistant(text, step.tool_calls)
    return step, text


def convert_messages(
    messages: Any, where: str = "messages", tool_error_prefix: str | None = None
) -> list[StepDraft]:
    """OpenAI chat messages -> steps. Assistant tool calls are rendered into the content (render_assistant)
    and kept structured in `tool_calls`. A tool message is an error when it says so (`is_error`/`error`),
    or, with `tool_error_prefix`, when its content starts with that prefix (tau-bench's convention)."""
    if not isinstance(messages, list):
        raise Reject(
            INVALID_VALUE if messages is not None else MISSING_FIELD, f"'{where}' is not a list", where
        )
    steps = []
    for i, msg in enumerate(messages):
        w = f"{where}[{i}]"
        step, text = message_step(msg, w)
        role = step.role
        if role == "tool":
            step.tool_call_id = str(require(msg, "tool_call_id", w))
            flagged = msg.get("is_error", msg.get("error"))
            step.is_error = bool(flagged) or bool(tool_error_prefix and text.startswith(tool_error_prefix))
        elif msg.get("is_error"):
            step.is_error = True
        if msg.get("token_ids") is not None:
            if not isinstance(msg["token_ids"], list):
                raise Reject(INVALID_VALUE, f"{w}.token_ids is not a list", f"{w}.token_ids")
            step.token_ids = msg["token_ids"]
        step.logprobs = _logprob_list(msg.get("logprobs"), f"{w}.logprobs")
        if msg.get("verifier_score") is not None:
            step.verifier_score = msg["verifier_score"]
        steps.append(step)
    return steps


def prompt_group(messages: list) -> str:
    """Group id of a chat: a hash of the messages before the first assistant message."""
    prefix = []
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") == "assistant":
            break
        prefix.append(f"{msg.get('role')}\x1f{msg.get('content')}")
    return prompt_hash(prefix)


_KNOWN = {
    "messages",
    "reward",
    "group_id",
    "traj_id",
    "sample_idx",
    "reward_components",
    "tools",
    "policy_version",
    "meta",
}


@adapter("chat-jsonl", reader=read_jsonl, action_format="openai_tools", extensions=(".jsonl",))
def chat_jsonl(record: SourceRecord) -> TrajectoryDraft:
    """One OpenAI chat trajectory per JSONL line."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an object")
    messages = require(data, "messages")
    reward = require(data, "reward")
    steps = convert_messages(messages)
    meta = dict(data["meta"]) if isinstance(data.get("meta"), dict) else {}
    if data.get("meta") is not None and not isinstance(data.get("meta"), dict):
        meta["meta"] = data["meta"]
    if data.get("tools") is not None:
        meta["tools"] = data["tools"]
    meta.update({k: v for k, v in data.items() if k not in _KNOWN})
    components = data.get("reward_components")
    if components is not None and not isinstance(components, dict):
        raise Reject(INVALID_VALUE, "reward_components is not an object", "reward_components")
    line = record.location.removeprefix("line ")
    return TrajectoryDraft(
        traj_id=str(data["traj_id"]) if data.get("traj_id") is not None else f"{record.stem}:L{line}",
        group_id=str(data["group_id"]) if data.get("group_id") is not None else prompt_group(messages),
        sample_idx=as_int(data["sample_idx"], "sample_idx") if data.get("sample_idx") is not None else None,
        reward=reward,
        reward_components=components,
        policy_version=str(data["policy_version"]) if data.get("policy_version") is not None else None,
        meta=meta or None,
        steps=steps,
    )
