"""How structured actions become text. Assistant tool calls are rendered into the step's `content` (the
Hermes/SmolLM2 `<tool_call>` convention) so that every action has a char range, and a token range where the chat
template renders the calls (`pipeline.chat_template`: SmolLM2's does not, and then the calls are not in the tokens)."""

from __future__ import annotations

import json

TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"


def render_tool_call(name: str, arguments: str) -> str:
    """One call as text. Arguments that are valid JSON are embedded as an object, others verbatim."""
    try:
        args = json.loads(arguments) if arguments else {}
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False, sort_keys=False)
    except (TypeError, ValueError):
        body = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ' + str(arguments) + "}"
    return TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE


def render_assistant(text: str | None, calls: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Content of an assistant step and the char range [start, end) of each rendered call (tags included)."""
    content = text or ""
    spans = []
    for call in calls:
        if content:
            content += "\n"
        start = len(content)
        content += render_tool_call(call.get("name") or "", call.get("arguments") or "")
        spans.append((start, len(content)))
    return content, spans


def tool_call_spans(content: str) -> list[tuple[int, int]]:
    """Char ranges of the rendered `<tool_call>...</tool_call>` blocks in a content string."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while True:
        start = content.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            return spans
        end = content.find(TOOL_CALL_CLOSE, start)
        if end < 0:
            return spans
        end += len(TOOL_CALL_CLOSE)
        spans.append((start, end))
        pos = end


def canonical_arguments(arguments: str | None) -> str:
    """Canonical JSON of a call's arguments (sorted keys, no spaces) for comparing calls; raw text if invalid."""
    if not arguments:
        return "{}"
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return arguments.strip()
