"""Tokens as the policy saw them: a conversation rendered with the tokenizer's chat template, tokenized once,
and cut back into its messages (pure: the tokenizer object is handed in, loaded by `warehouse.tokenizers`).

A tokenizer with a chat template has `chat_template` (the Jinja source) and `apply_chat_template(messages,
tools=..., tokenize=False, add_generation_prompt=...)` (transformers' method). The rendering is exactly the
template's `apply_chat_template(messages, tools=tools)` of the source's messages (`chat_messages`: OpenAI-style,
assistant tool calls as `tool_calls` with JSON-object arguments, a null content as ""), nothing added: a template
that renders no tools or no tool calls (SmolLM2's) shows the policy none, and the trajectory's
`meta.tokenization` says so (`... (the template renders no tool calls (3 not in the tokens))`).

It is cut at message boundaries found by rendering prefixes: message k starts where the rendering of
messages[:k] stops agreeing with the whole (a template may close a run of tool messages differently when the
run goes on), and an assistant message where the rendering of messages[:k] with the generation prompt ends, so
the `<|im_start|>assistant\\n` header the policy was given belongs to the context before it. Only what the policy
sampled is in an assistant step: its content and the end-of-turn token (the tokenizer's `eos_token`); the
template's text after that token (ChatML's newline) is context of the next step, and after the last message it
is not part of the trajectory at all (the policy stopped at its end-of-turn token). Every other token of the
rendering belongs to one step (the one its first char is in), except a token that runs over the start of an
assistant message (the tokenizer merged the header's last chars with the message's first ones: SmolLM2's
`\n\n` for the header's newline and a leading blank line): it is the assistant message's, as transformers'
assistant mask (`return_assistant_tokens_mask`) counts every token overlapping the generation. The ids are the
tokenization of the whole rendering, transformers' `apply_chat_template(..., tokenize=True)` token for token,
and the loss mask, built from step roles downstream, is its assistant mask. An assistant message of the
agent's context that it did not generate (role `assistant_context`, tau2's greeting) renders as an assistant
turn and is context, like a system or user message. An assistant message right after one the policy sampled
(the template's text between them would be trained), a conversation that opens with one the policy sampled,
and templates whose prefix renderings rewrite earlier turns fall back to plain per-message tokens.

Per-step token offsets stay relative to the step's content (tokens of the template's markup before it count
as char 0, after it as its length), so spans found in the content still map to tokens.

How each trajectory's tokens were made: `source ids` (the source carried token ids: kept as they are),
`chat template <name>`, or `plain` (message by message, no template: the byte tokenizer, a tokenizer without
a template, or a template that failed on this conversation, or text a framework already rendered (meta
`rendered_by`); the reason follows in parentheses). Where the source says how many tokens it had (meta
`source_token_counts`, e.g. AReaL's `prompt_len` / `seqlen`), a different count is added to that line."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from pipeline.render import render_assistant
from schemas.steps import CONTEXT_ROLES

SOURCE_IDS = "source ids"
PLAIN = "plain"
# meta key of a draft whose text is already the rendering the policy saw (AReaL's and verl's dumps decode the
# token ids): it is tokenized as it is, `plain (rendered by <its value>)`, never templated a second time
RENDERED_BY = "rendered_by"
# meta key of a draft whose source says how many tokens each step had (AReaL's prompt_len, seqlen - prompt_len):
# a tokenization that gives other counts says so
SOURCE_TOKEN_COUNTS = "source_token_counts"


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


def _own_text(content: str, calls: list[dict]) -> str | None:
    """The text the assistant wrote before its calls when `content` is that text with the calls rendered after
    it by ingest (`pipeline.render.render_assistant`); None when the content is the policy's own as it is."""
    rendered, _ = render_assistant("", calls)
    if not rendered or not content.endswith(rendered):
        return None
    head = content[: len(content) - len(rendered)]
    return head[:-1] if head.endswith("\n") else head


def chat_messages(steps, tools: list | None, template_source: str) -> tuple[list[dict], list | None, str]:
    """The source's messages for `apply_chat_template` from step drafts (role, content, tool_calls,
    tool_call_id), one per step, in order; returns (messages, tools, what the template leaves out: "" or a
    note). An assistant step's calls go as structured `tool_calls` (arguments as JSON objects, as templates
    expect them) and its content is the text it wrote before them (ingest renders the calls into the stored
    content; a content that does not end with that rendering is the policy's own text and goes as it is)."""
    renders_calls = "tool_calls" in template_source
    renders_tools = "tools" in template_source.replace("tool_calls", "")
    messages = []
    n_calls = 0
    for step in steps:
        # an assistant message the agent did not generate in this run renders as its own assistant turn
        msg: dict = {"role": CONTEXT_ROLES.get(step.role, step.role), "content": step.content or ""}
        if msg["role"] == "assistant" and step.tool_calls:
            own = _own_text(step.content or "", step.tool_calls)
            if own is not None:
                msg["content"] = own
                n_calls += len(step.tool_calls)
            msg["tool_calls"] = [
                {
                    "id": c.get("id"),
                    "type": "function",
                    "function": {"name": c.get("name"), "arguments": _arguments(c.get("arguments"))},
                }
                for c in step.tool_calls
            ]
        if step.role == "tool" and step.tool_call_id is not None:
            msg["tool_call_id"] = step.tool_call_id
        messages.append(msg)
    left_out = []
    if tools and not renders_tools:
        left_out.append("no tools")
    if n_calls and not renders_calls:
        left_out.append(f"no tool calls ({n_calls} not in the tokens)")
    note = f"the template renders {', '.join(left_out)}" if left_out else ""
    return messages, (tools or None), note


def _agree(a: str, b: str) -> int:
    """Length of the common prefix of two strings."""
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # binary search on prefix equality (C-speed slices)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def render(
    tokenizer,
    messages: list[dict],
    tools: list | None = None,
    eos: str | None = None,
    sampled: Sequence[bool] | None = None,
) -> tuple[str, np.ndarray]:
    """The rendering up to where the policy stopped, and the char start of each message in it (plus its end):
    bounds[k] .. bounds[k+1] is message k's span. `sampled[k]`: message k is one the policy generated (default:
    every assistant message; an assistant message of its context that it did not generate, tau2's greeting, is
    rendered as an assistant turn but is context). With `eos` (the end-of-turn token), a sampled message's span
    ends right after its end-of-turn token: the template's text after it goes to the next message, or, after
    the last message, is left out. NotRenderable when a prefix rendering rewrites the whole, a conversation opens
    with a sampled message, or an assistant message follows right after a sampled one."""
    apply = tokenizer.apply_chat_template
    kw = {"tokenize": False} | ({"tools": tools} if tools else {})
    if sampled is None:
        sampled = [m["role"] == "assistant" for m in messages]
    if messages and sampled[0]:
        raise NotRenderable(
            "it starts with an assistant message: no step before it holds the generation prompt"
        )
    try:
        full = apply(messages, **kw)
        bounds = [0]
        relaxed = False
        for k in range(1, len(messages)):
            asst = messages[k]["role"] == "assistant"
            prefix = apply(messages[:k], add_generation_prompt=asst, **kw)
            if full.startswith(prefix):
                bounds.append(len(prefix))
                continue
            # a template may close a message differently when more of its kind follow (a run of tool returns in
            # one turn): the boundary is where the two renderings part, if all of message k-1 is before it
            at = _agree(prefix, full)
            prev = messages[k - 1]["content"] or ""
            if asst or at <= bounds[-1] or (prev and prev not in full[bounds[-1] : at]):
                raise NotRenderable(f"the rendering of the first {k} messages is not a prefix of the whole")
            bounds.append(at)
            relaxed = True
    except NotRenderable:
        raise
    except Exception as exc:  # noqa: BLE001 -- a template raising on this conversation (its own checks)
        raise NotRenderable(f"the template raised {type(exc).__name__}: {exc}") from None
    bounds.append(len(full))
    if eos:
        for k, m in enumerate(messages):
            if not sampled[k]:
                continue
            content = m["content"] or ""
            start = full.find(content, bounds[k], bounds[k + 1]) if content else bounds[k]
            j = full.find(eos, max(start, bounds[k]) + len(content), bounds[k + 1])
            if j < 0 or j + len(eos) == bounds[k + 1]:
                continue
            if k + 1 < len(messages) and sampled[k + 1]:
                raise NotRenderable(
                    "two assistant messages in a row: the template's text between them would be trained"
                )
            bounds[k + 1] = j + len(eos)
            if k + 1 == len(messages):
                full = full[: bounds[k + 1]]
    b = np.asarray(bounds, dtype=np.int64)
    if (np.diff(b) < 0).any():
        raise NotRenderable("message boundaries are not in order")
    for k, m in enumerate(
        messages if relaxed else ()
    ):  # a boundary where renderings part: each message inside
        if m["content"] and m["content"] not in full[b[k] : b[k + 1]]:
            raise NotRenderable(f"message {k} is not inside its span of the rendering")
    return full, b


def cut(
    ids: Sequence[int],
    offsets: Sequence[int],
    text: str,
    bounds: np.ndarray,
    contents: list[str],
    lengths: list[int] | None = None,
    sampled: Sequence[bool] | None = None,
):
    """Per message: (token ids, offsets relative to its content, clipped to [0, lengths[k]]; default the
    content's length). A token goes to the message its first char is in, except a token that runs over the
    start of a sampled message (`sampled[k]`): it goes to that message. The tokenizer may merge the template's
    text before a message with the message's first chars (SmolLM2: the header's newline and a leading blank line
    are one token, `\n\n`); transformers' assistant mask (`apply_chat_template(...,
    return_assistant_tokens_mask=True)`) marks every token that overlaps the generation, so the token is the
    message's, and the blank line is not lost to the header. The ids stay the tokenization of the whole
    rendering. The content is looked up in the message's span (offsets count from the span's start when it is
    not found)."""
    ids_a = np.asarray(ids, dtype=np.int64)
    offs = np.asarray(offsets, dtype=np.int64)
    owner = np.searchsorted(bounds, offs, side="right") - 1
    owner = np.clip(owner, 0, len(contents) - 1)
    if sampled is not None and len(offs):
        starts = np.asarray(bounds[:-1], dtype=np.int64)[np.asarray(sampled, dtype=bool)]
        ks = np.flatnonzero(np.asarray(sampled, dtype=bool))
        last_before = np.searchsorted(offs, starts, side="left") - 1  # the last token starting before it
        nxt = np.append(offs, len(text))[last_before + 1]  # where that token ends
        over = (last_before >= 0) & (nxt > starts)  # no token starts at the message: the one before runs over
        owner[last_before[over]] = ks[over]
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
    eos = getattr(tokenizer, "eos_token", None) if templated else None
    eos = eos if isinstance(eos, str) and eos else None
    made: list[str] = []
    rendered: dict[int, tuple[str, np.ndarray, str, list[dict]]] = {}
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
        messages, tools, left_out = chat_messages(d.steps, tools if isinstance(tools, list) else None, source)
        sampled = [s.role == "assistant" for s in d.steps]
        try:
            rendered[i] = (*render(tokenizer, messages, tools, eos, sampled), left_out, messages)
        except NotRenderable as exc:
            made.append(f"{PLAIN} (chat template {name}: {exc})")
            continue
        made.append(f"chat template {name}" + (f" ({left_out})" if left_out else ""))
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
            sampled = [s.role == "assistant" for s in steps]
            per_draft[i] = cut(ids, offs, text, bounds, lookup, [len(s.content) for s in steps], sampled)
        else:
            per_draft.setdefault(i, []).append((list(ids), list(offs)))
    for i, d in enumerate(drafts):  # the source's own token counts, where it says them
        want = d.meta.get(SOURCE_TOKEN_COUNTS) if isinstance(d.meta, dict) else None
        got = [len(ids) for ids, _ in per_draft.get(i, [])]
        if made[i] != SOURCE_IDS and isinstance(want, list) and len(want) == len(got) and want != got:
            made[i] += (
                f"; {sum(got)} tokens ({'/'.join(map(str, got))}) where the source counted {sum(want)} "
                f"({'/'.join(map(str, want))}): not the policy's tokenizer?"
            )
    all_ids = [ids for i in range(len(drafts)) for ids, _ in per_draft.get(i, [])]
    all_offs = [offs for i in range(len(drafts)) for _, offs in per_draft.get(i, [])]
    return all_ids, all_offs, made
