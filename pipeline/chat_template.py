"""Tokens as the policy saw them: a conversation rendered with the tokenizer's chat template, tokenized once,
and cut back into its messages (pure: the tokenizer object is handed in, loaded by `warehouse.tokenizers`).

A tokenizer with a chat template has `chat_template` (the Jinja source) and `apply_chat_template(messages,
tools=..., tokenize=False, add_generation_prompt=...)` (transformers' method). The rendering of a conversation
is cut at message boundaries found by rendering its prefixes: message k starts where the rendering of
messages[:k] ends, and an assistant message where the rendering of messages[:k] with the generation prompt
ends, so the `<|im_start|>assistant\\n` header the policy was given belongs to the context before it and the
assistant step holds exactly what the policy wrote (its content, end-of-turn token and the template's newline
after it). Every token of the rendering belongs to one step (the one its first char is in); the loss mask,
built from step roles downstream, is therefore 1 on assistant tokens only. A template whose prefix renderings
are not prefixes of the whole (one that rewrites earlier turns) falls back to plain per-message tokens.

Tools: passed to the template as `tools=` (OpenAI specs from the trajectory's `meta.tools`) and tool calls as
`message.tool_calls`. A template that renders neither (SmolLM2's) gets them the Hermes way, as most tool-tuned
chat models write them: the tool specs in a `<tools>` block of the system message, each call as the
`<tool_call>{json}</tool_call>` text ingest already put in the assistant's content; the record then says
`+ hermes tools`.

Per-step token offsets stay relative to the step's content (tokens of the template's markup before it count
as char 0, after it as its length), so spans found in the content still map to tokens.

How each trajectory's tokens were made: `source ids` (the source carried token ids: kept as they are),
`chat template <name>`, or `plain` (message by message, no template: the byte tokenizer, a tokenizer without
a template, or a template that failed on this conversation, or text a framework already rendered (meta `rendered_by`); the
reason follows in parentheses)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from pipeline.render import tool_call_spans

SOURCE_IDS = "source ids"
PLAIN = "plain"
# meta key of a draft whose text is already the rendering the policy saw (AReaL's and verl's dumps decode the
# token ids): it is tokenized as it is, `plain (rendered by <its value>)`, never templated a second time
RENDERED_BY = "rendered_by"


class NotRenderable(ValueError):
    """The template cannot be cut into this conversation's messages."""


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def _arguments(text):
    if not isinstance(text, str):
        return text if text is not None else {}
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_messages(steps, tools: list | None, template_source: str) -> tuple[list[dict], list | None, bool]:
    """OpenAI-style messages for a template from step drafts (role, content, tool_calls, tool_call_id); returns
    (messages, tools to pass, whether the Hermes fallback was used). One message per step, in order.

    The content is what the policy wrote: chat-shaped adapters keep an assistant's calls rendered into it
    (`pipeline.render`, the Hermes `<tool_call>` text), ReAct ones the `Action: ...` text. A template that
    renders `tool_calls` itself gets a chat-shaped content without the rendered calls and the calls as
    structured `tool_calls`; otherwise the content goes as it is (the calls in it, once)."""
    native_calls = "tool_calls" in template_source
    native_tools = "tools" in template_source.replace("tool_calls", "")
    hermes = False
    messages = []
    for step in steps:
        content = step.content
        msg: dict = {"role": step.role, "content": content}
        spans = tool_call_spans(content) if step.tool_calls and step.role == "assistant" else []
        if spans and native_calls:
            msg["content"] = content[: spans[0][0]].rstrip("\n")
            msg["tool_calls"] = [
                {
                    "id": c.get("id"),
                    "type": "function",
                    "function": {"name": c.get("name"), "arguments": _arguments(c.get("arguments"))},
                }
                for c in step.tool_calls
            ]
        elif spans:
            hermes = True
        if step.role == "tool" and step.tool_call_id is not None:
            msg["tool_call_id"] = step.tool_call_id
        messages.append(msg)
    if tools and not native_tools and messages and messages[0]["role"] == "system":
        hermes = True
        block = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        messages[0] = {
            **messages[0],
            "content": f"{messages[0]['content']}\n\n# Tools\n<tools>\n{block}\n</tools>",
        }
        tools = None
    return messages, (tools if native_tools else None), hermes


def render(tokenizer, messages: list[dict], tools: list | None = None) -> tuple[str, np.ndarray]:
    """The whole rendering and the char start of each message in it (plus its end): bounds[k] .. bounds[k+1]
    is message k's span. NotRenderable when a prefix rendering is not a prefix of the whole."""
    apply = tokenizer.apply_chat_template
    kw = {"tokenize": False} | ({"tools": tools} if tools else {})
    if messages and messages[0]["role"] == "assistant":
        raise NotRenderable(
            "it starts with an assistant message: no step before it holds the generation prompt"
        )
    try:
        full = apply(messages, **kw)
        bounds = [0]
        for k in range(1, len(messages)):
            prefix = apply(messages[:k], add_generation_prompt=messages[k]["role"] == "assistant", **kw)
            if not full.startswith(prefix):
                raise NotRenderable(f"the rendering of the first {k} messages is not a prefix of the whole")
            bounds.append(len(prefix))
    except NotRenderable:
        raise
    except Exception as exc:  # noqa: BLE001 -- a template raising on this conversation (its own checks)
        raise NotRenderable(f"the template raised {type(exc).__name__}: {exc}") from None
    bounds.append(len(full))
    b = np.asarray(bounds, dtype=np.int64)
    if (np.diff(b) < 0).any():
        raise NotRenderable("message boundaries are not in order")
    return full, b


def cut(
    ids: Sequence[int],
    offsets: Sequence[int],
    text: str,
    bounds: np.ndarray,
    contents: list[str],
    lengths: list[int] | None = None,
):
    """Per message: (token ids, offsets relative to its content, clipped to [0, lengths[k]]; default the
    content's length). A token goes to the message its first char is in; the content is looked up in the
    message's span (offsets count from the span's start when it is not found)."""
    ids_a = np.asarray(ids, dtype=np.int64)
    offs = np.asarray(offsets, dtype=np.int64)
    owner = np.searchsorted(bounds, offs, side="right") - 1
    owner = np.clip(owner, 0, len(contents) - 1)
    splits = np.searchsorted(owner, np.arange(1, len(contents)), side="left")  # owner is non-decreasing
    out = []
    for k, (tok, off) in enumerate(zip(np.split(ids_a, splits), np.split(offs, splits), strict=True)):
        content = contents[k]
        start = text.find(content, int(bounds[k]), int(bounds[k + 1])) if content else -1
        base = start if start >= 0 else int(bounds[k])
        rel = np.clip(off - base, 0, len(content) if lengths is None else lengths[k])
        out.append((tok.tolist(), rel.tolist()))
    return out


def tokenize_steps(drafts, tokenizer) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Token ids and content offsets of every step of every draft (flat, in order), and how each draft's
    tokens were made. Steps that carry token ids get the plain tokenization of their content here (ingest
    keeps the given ids and uses these only to find offsets)."""
    name = getattr(tokenizer, "name", "tokenizer")
    templated = has_chat_template(tokenizer)
    source = (getattr(tokenizer, "chat_template", "") or "") if templated else ""
    made: list[str] = []
    rendered: dict[int, tuple[str, np.ndarray, bool, list[dict]]] = {}
    for i, d in enumerate(drafts):
        if any(s.token_ids is not None for s in d.steps):
            made.append(SOURCE_IDS)
            continue
        rendered_by = d.meta.get(RENDERED_BY) if isinstance(d.meta, dict) else None
        if rendered_by:  # the text already is the policy's rendering (a framework decoded its token ids)
            made.append(f"{PLAIN} (rendered by {rendered_by})")
            continue
        if not templated:
            made.append(PLAIN)
            continue
        if any(s.logprobs is not None for s in d.steps):
            made.append(f"{PLAIN} (logprobs without token ids are per message)")
            continue
        tools = (d.meta or {}).get("tools") if isinstance(d.meta, dict) else None
        messages, tools, hermes = chat_messages(d.steps, tools if isinstance(tools, list) else None, source)
        try:
            rendered[i] = (*render(tokenizer, messages, tools), hermes, messages)
        except NotRenderable as exc:
            made.append(f"{PLAIN} (chat template {name}: {exc})")
            continue
        made.append(f"chat template {name}" + (" + hermes tools" if hermes else ""))
    # one batched tokenizer call: whole renderings for the rendered drafts, step contents for the rest
    texts: list[str] = []
    where: list[tuple[int, int | None]] = []
    for i, d in enumerate(drafts):
        if i in rendered:
            texts.append(rendered[i][0])
            where.append((i, None))
        else:
            for j, s in enumerate(d.steps):
                texts.append(s.content)
                where.append((i, j))
    enc_ids, enc_offs = tokenizer.encode_batch(texts) if texts else ([], [])
    per_draft: dict[int, list] = {}
    for (i, step_j), ids, offs, text in zip(where, enc_ids, enc_offs, texts, strict=True):
        if step_j is None:
            bounds = rendered[i][1]
            steps = drafts[i].steps
            lookup = [m["content"] for m in rendered[i][3]]
            per_draft[i] = cut(ids, offs, text, bounds, lookup, [len(s.content) for s in steps])
        else:
            per_draft.setdefault(i, []).append((list(ids), list(offs)))
    all_ids = [ids for i in range(len(drafts)) for ids, _ in per_draft.get(i, [])]
    all_offs = [offs for i in range(len(drafts)) for _, offs in per_draft.get(i, [])]
    return all_ids, all_offs, made
