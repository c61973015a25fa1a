"""`react`: FireAct-style ReAct trajectories, a JSON object id -> {reward, em, f1, gt, pred, traj, ...} where
`traj` is one string: an instruction, then `Thought: ...` / `Action: name[arg]` / `Observation: ...` lines.

Steps (contents are verbatim lines, so joining them with "\\n" gives back `traj`):
- user: the instruction part, up to and including the `### Response:` line (or up to the first Thought);
- assistant: each Thought with its Action line (one turn; a Thought without an Action is a turn of its own);
- tool: each Observation, answering the turn before it.
An Action `search[q]`, `lookup[q]` or `finish[a]` becomes a tool call in the assistant step's `tool_calls`
(id `react-<turn>`, arguments `{"query": q}` / `{"answer": a}`) and its Observation links to it. Other actions
(unknown tool names such as `reflect[...]`, unclosed brackets) are real, malformed behaviour: the assistant
step keeps empty `tool_calls` and the Observation has no `tool_call_id`. An Observation that reports an
exception ("generated an exception", "Invalid action") gets `is_error`.
reward = float(em); group = the record's id (one sample per question).
"""

from __future__ import annotations

import json
import re

from pipeline.ingest.core import (
    INVALID_VALUE,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    read_json_entries,
    require,
)
from pipeline.ingest.registry import adapter

ACTION = re.compile(r"^Action(?: \d+)?:\s*(?P<name>[A-Za-z_]+)\[(?P<arg>.*)\]\s*$", re.S)
TOOLS = {"search": "query", "lookup": "query", "finish": "answer"}
ERROR_MARKERS = ("generated an exception", "Invalid action")
RESPONSE_HEADER = "### Response:"

TOOL_SPECS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]},
        },
    }
    for name, arg in TOOLS.items()
]


def _kind(line: str) -> str | None:
    for prefix in ("Thought", "Action", "Observation"):
        if re.match(rf"^{prefix}(?: \d+)?:", line):
            return prefix
    return None


def parse_action(line: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a well-formed action in the action space, else None."""
    match = ACTION.match(line)
    if match is None or match.group("name") not in TOOLS:
        return None
    name = match.group("name")
    return name, json.dumps({TOOLS[name]: match.group("arg")}, ensure_ascii=False)


def split_react(traj: str) -> list[StepDraft]:
    lines = traj.split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    if RESPONSE_HEADER in lines:
        start = lines.index(RESPONSE_HEADER) + 1
    else:
        start = next((i for i, line in enumerate(lines) if _kind(line) == "Thought"), len(lines))
    steps = [StepDraft(role="user", content="\n".join(lines[:start]))]
    pending_call: str | None = None  # id of the last turn's call, for its Observation
    open_turn = False  # the last step is an assistant Thought still waiting for its Action
    turn = 0
    for line in lines[start:]:
        kind = _kind(line)
        if kind == "Action" and open_turn:
            steps[-1].content += "\n" + line
            pending_call = _attach_action(steps[-1], line, turn)
            open_turn = False
        elif kind in ("Thought", "Action"):
            turn += 1
            steps.append(StepDraft(role="assistant", content=line, tool_calls=[]))
            pending_call = _attach_action(steps[-1], line, turn) if kind == "Action" else None
            open_turn = kind == "Thought"
        elif kind == "Observation":
            text = line.split(":", 1)[1].strip()
            steps.append(
                StepDraft(
                    role="tool",
                    content=line,
                    tool_call_id=pending_call,
                    is_error=any(m in text for m in ERROR_MARKERS),
                )
            )
            pending_call, open_turn = None, False
        else:  # a continuation line: it belongs to the step before
            steps[-1].content += "\n" + line
    return steps


def _attach_action(step: StepDraft, line: str, turn: int) -> str | None:
    parsed = parse_action(line)
    if parsed is None:
        return None
    call_id = f"react-{turn}"
    step.tool_calls = [{"id": call_id, "name": parsed[0], "arguments": parsed[1]}]
    return call_id


@adapter("react", reader=read_json_entries, action_format="react", extensions=(".json",))
def react(record: SourceRecord) -> TrajectoryDraft:
    """FireAct / ReAct trajectories (id -> {em, f1, gt, pred, traj})."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an object")
    traj = require(data, "traj")
    if not isinstance(traj, str):
        raise Reject(INVALID_VALUE, "traj is not a string", "traj")
    em = require(data, "em")
    key = record.context.get("key", record.location)
    meta = {"id": key, "question": None, "tools": TOOL_SPECS}
    meta.update({k: v for k, v in data.items() if k not in {"traj", "traj_by_line"}})
    steps = split_react(traj)
    instruction = steps[0].content.split("### Instruction:", 1)
    if len(instruction) == 2:
        meta["question"] = instruction[1].replace(RESPONSE_HEADER, "").strip()
    return TrajectoryDraft(
        traj_id=f"{record.stem}:{key}",
        group_id=str(key),
        sample_idx=0,
        reward=em,
        meta=meta,
        steps=steps,
    )
