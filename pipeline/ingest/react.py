"""`react`: FireAct-style ReAct trajectories, a JSON object id -> {reward, em, f1, gt, pred, traj, ...}. FireAct
writes `traj` in one of two shapes (its generation.py):
- one string (completion models): an instruction, then `Thought: ...` / `Action: name[arg]` /
  `Observation: ...` lines;
- a list of chat messages (`--chatgpt_format`): `user` (the question), then per iteration `assistant` (the
  model's output, "Thought: ...\\nAction: ...") and `user` ("Observation: ...", the tool's return).

Steps of the string form (contents are verbatim lines, so joining them with "\\n" gives back `traj`):
- user: the instruction part, up to and including the `### Response:` line (or up to the first Thought);
- assistant: each Thought with its Action line (one turn; a Thought without an Action is a turn of its own,
  and so is an Action line that follows another Action);
- tool: each Observation.
Steps of the chat form: a `user` message whose first line is an Observation is a tool step; any other `user` or
`system` message keeps its role; each `assistant` message is one turn (its content verbatim), its first Action
line the turn's action.
In both forms an Observation answers one Action: the one with its number (`Observation 2` -> `Action 2`),
else the first Action since the previous Observation (the one FireAct and ReAct execute); an Action that no
Observation answers gets none. An Action `search[q]`, `lookup[q]` or `finish[a]` becomes a tool call in the
assistant step's `tool_calls` (id `react-<turn>`, arguments `{"query": q}` / `{"answer": a}`) and the Observation
answering it links to it. Other actions (unknown tool names such as `reflect[...]`, unclosed brackets) are
real, malformed behaviour the harness still ran (it answered with an error): a call named by the verb (`reflect`,
else `unparsed`), arguments `{"action": <the line's text>}`, that their Observation links to; C3 flags them
from the content. An Observation that reports an exception ("generated an exception", "Invalid action") gets
`is_error`. reward = float(em); group = the record's id (one sample per question).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pipeline.ingest.readers import read_json_entries
from pipeline.ingest.records import (
    INVALID_VALUE,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    content_text,
    require,
)
from pipeline.ingest.registry import adapter

ACTION = re.compile(r"^Action(?: \d+)?:\s*(?P<name>[A-Za-z_]+)\[(?P<arg>.*)\]\s*$", re.S)
_LINE = re.compile(r"^(?P<kind>Thought|Action|Observation)(?: (?P<num>\d+))?:")
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
    m = _LINE.match(line)
    return m.group("kind") if m else None


def _number(line: str) -> str | None:
    m = _LINE.match(line)
    return m.group("num") if m else None


def parse_action(line: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a well-formed action in the action space, else None."""
    match = ACTION.match(line)
    if match is None or match.group("name") not in TOOLS:
        return None
    name = match.group("name")
    return name, json.dumps({TOOLS[name]: match.group("arg")}, ensure_ascii=False)


@dataclass
class _Pending:
    """Actions since the last Observation: (number, call id or None), in order."""

    actions: list[tuple[str | None, str | None]]

    def add(self, number: str | None, call_id: str | None) -> None:
        self.actions.append((number, call_id))

    def answer(self, number: str | None) -> str | None:
        """The call id the Observation answers (None: a malformed action's, or no action's); clears the rest."""
        found = next((a for a in self.actions if number is not None and a[0] == number), None)
        if found is None and self.actions:
            found = self.actions[0]
        self.actions = []
        return found[1] if found else None


def _observation(line: str, pending: _Pending) -> StepDraft:
    text = line.split(":", 1)[1]
    return StepDraft(
        role="tool",
        content=line,
        tool_call_id=pending.answer(_number(line)),
        is_error=any(m in text for m in ERROR_MARKERS),
    )


def split_react(traj: str) -> list[StepDraft]:
    lines = traj.split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    if RESPONSE_HEADER in lines:
        start = lines.index(RESPONSE_HEADER) + 1
    else:
        start = next((i for i, line in enumerate(lines) if _kind(line) == "Thought"), len(lines))
    steps = [StepDraft(role="user", content="\n".join(lines[:start]))]
    pending = _Pending([])
    open_turn = False  # the last step is an assistant Thought still waiting for its Action
    turn = 0
    for line in lines[start:]:
        kind = _kind(line)
        if kind == "Action" and open_turn:
            steps[-1].content += "\n" + line
            pending.add(_number(line), _attach_action(steps[-1], line, turn))
            open_turn = False
        elif kind in ("Thought", "Action"):
            turn += 1
            steps.append(StepDraft(role="assistant", content=line, tool_calls=[]))
            if kind == "Action":
                pending.add(_number(line), _attach_action(steps[-1], line, turn))
            open_turn = kind == "Thought"
        elif kind == "Observation":
            steps.append(_observation(line, pending))
            open_turn = False
        else:  # a continuation line: it belongs to the step before
            steps[-1].content += "\n" + line
    return steps


def chat_react(messages: list) -> list[StepDraft]:
    """Steps of FireAct's chat-format `traj` (see the module doc)."""
    steps: list[StepDraft] = []
    pending = _Pending([])
    turn = 0
    for i, msg in enumerate(messages):
        where = f"traj[{i}]"
        if not isinstance(msg, dict):
            raise Reject(INVALID_VALUE, f"{where} is {type(msg).__name__}, expected a message object", where)
        role = msg.get("role")
        content = content_text(msg.get("content"), f"{where}.content")
        if role == "assistant":
            turn += 1
            step = StepDraft(role="assistant", content=content, tool_calls=[])
            action = next((line for line in content.split("\n") if _kind(line) == "Action"), None)
            pending.actions = []  # a new generation: an unanswered earlier action stays unanswered
            if action is not None:
                pending.add(_number(action), _attach_action(step, action, turn))
            steps.append(step)
        elif role == "user" and _kind(content) == "Observation" and turn:
            steps.append(_observation(content, pending))
        elif role in ("user", "system"):
            steps.append(StepDraft(role=role, content=content))
        else:
            raise Reject(
                INVALID_VALUE, f"{where}.role is {role!r}, expected user, assistant or system", where
            )
    return steps


_VERB = re.compile(r"^Action(?: \d+)?:\s*(?P<name>[A-Za-z_]\w*)")


def _attach_action(step: StepDraft, line: str, turn: int) -> str:
    """The turn's executed action as a tool call: `search` / `lookup` / `finish` with their argument; any other
    action line ran too (the harness answered it, usually with an error), so it is a call named by its verb
    (`reflect`; `unparsed` when it has none) with the line's text as `{"action": ...}`: its Observation links to
    it. C3 reads the content, not these calls, so such an action stays an invalid action."""
    parsed = parse_action(line)
    call_id = f"react-{turn}"
    if parsed is None:
        verb = _VERB.match(line)
        text = line.split(":", 1)[1].strip() if ":" in line else line
        parsed = (
            verb.group("name") if verb else "unparsed",
            json.dumps({"action": text}, ensure_ascii=False),
        )
    step.tool_calls = [{"id": call_id, "name": parsed[0], "arguments": parsed[1]}]
    return call_id


@adapter("react", reader=read_json_entries, action_format="react", extensions=(".json",))
def react(record: SourceRecord) -> TrajectoryDraft:
    """FireAct / ReAct trajectories (id -> {em, f1, gt, pred, traj}); traj is one string or chat messages."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an object")
    traj = require(data, "traj")
    em = require(data, "em")
    key = record.context.get("key", record.location)
    meta = {"id": key, "question": None, "tools": TOOL_SPECS}
    meta.update({k: v for k, v in data.items() if k not in {"traj", "traj_by_line"}})
    if isinstance(traj, str):
        steps = split_react(traj)
        instruction = steps[0].content.split("### Instruction:", 1)
        if len(instruction) == 2:
            meta["question"] = instruction[1].replace(RESPONSE_HEADER, "").strip()
    elif isinstance(traj, list):
        steps = chat_react(traj)
        meta["traj_shape"] = "chat"
        first_user = next((s for s in steps if s.role == "user"), None)
        meta["question"] = first_user.content.strip() if first_user else None
    else:
        raise Reject(INVALID_VALUE, "traj is neither a string nor a list of chat messages", "traj")
    return TrajectoryDraft(
        traj_id=f"{record.run}:{key}",
        group_id=str(key),
        sample_idx=0,
        reward=em,
        policy_version=record.run,  # FireAct names a run's file by its model and sampling settings
        meta=meta,
        steps=steps,
    )
