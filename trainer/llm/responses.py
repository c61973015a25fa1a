"""What the LLM client (trainer/llm/client.py) makes of a server's answers and errors: chat and completion
responses as results (text, token ids, logprobs, usage; vLLM's extras where present), a 429's Retry-After, and a
context-length refusal as an LLMError carrying the prompt's token count and the context."""

from __future__ import annotations

import re
from typing import Any

from pipeline.llm.types import (
    ChatResult,
    Choice,
    CompletionResult,
    LLMError,
    Usage,
)


def retry_after_s(exc: Any) -> float | None:
    """Seconds from a 429's Retry-After header (delta-seconds form), if any."""
    headers: Any = getattr(getattr(exc, "response", None), "headers", None) or {}
    try:
        return float(headers.get("retry-after"))
    except (TypeError, ValueError):
        return None


_CONTEXT_IS = re.compile(r"maximum context length is (\d+)", re.IGNORECASE)
_PROMPT_IS = re.compile(
    r"(?:request has|resulted in|you requested) (\d+) (?:input )?tokens|(\d+) (?:input tokens|in the messages)",
    re.IGNORECASE,
)


def context_exceeded(exc: Any) -> LLMError | None:
    """A server's answer that the request exceeds its context (vLLM and OpenAI: "This model's maximum context
    length is N tokens. However, your request has M input tokens" or "... you requested T tokens (M in the
    messages, K in the completion)") as a `too_long` error with the server's figures, so that a stage splits
    its request as it does for one the client counted itself (an endpoint without /tokenize). With no prompt
    count in the message, the prompt is taken as the whole context (it does not fit; a lower bound). None:
    another 4xx."""
    msg = getattr(exc, "message", None) or str(exc)
    found = _CONTEXT_IS.search(msg)
    if found is None:
        return None
    context = int(found.group(1))
    counts = [int(g) for m in _PROMPT_IS.finditer(msg) for g in m.groups() if g]
    in_messages = re.search(r"(\d+) in the messages", msg)
    prompt = int(in_messages.group(1)) if in_messages else (counts[0] if counts else context)
    err = LLMError("too_long", f"the server refused it: {msg[:300]}")
    err.prompt_tokens, err.context = prompt, context
    return err


def status_message(exc: Any) -> str:
    msg = getattr(exc, "message", None) or str(exc)
    return f"HTTP {exc.status_code}: {msg}"[:500]


def token_ids_from_strings(tokens: list[str] | None) -> list[int] | None:
    """vLLM's `return_tokens_as_token_ids` renders tokens as 'token_id:123'."""
    if not tokens or not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return None
    try:
        return [int(t.split(":", 1)[1]) for t in tokens]
    except ValueError:
        return None


def extra_field(obj: Any, name: str) -> Any:
    val = getattr(obj, name, None)
    if val is None:
        extra = getattr(obj, "model_extra", None) or {}
        val = extra.get(name)
    return val


def usage_of(raw: Any) -> Usage:
    u = getattr(raw, "usage", None)
    if u is None:
        return Usage()
    return Usage(prompt_tokens=int(u.prompt_tokens or 0), completion_tokens=int(u.completion_tokens or 0))


def parse_chat(raw: Any) -> ChatResult:
    if not getattr(raw, "choices", None) and not isinstance(getattr(raw, "choices", None), list):
        raise ValueError("response has no choices")
    choices = []
    for ch in sorted(raw.choices, key=lambda c: c.index or 0):
        tokens = lps = tops = None
        lp = getattr(ch, "logprobs", None)
        content = getattr(lp, "content", None) if lp is not None else None
        if content is not None:
            tokens = [c.token for c in content]
            lps = [c.logprob for c in content]
            if any(getattr(c, "top_logprobs", None) for c in content):
                tops = [{t.token: t.logprob for t in (c.top_logprobs or [])} for c in content]
        ids = extra_field(ch, "token_ids") or token_ids_from_strings(tokens)
        choices.append(
            Choice(
                text=ch.message.content or "",
                token_ids=list(ids) if ids is not None else None,
                token_logprobs=lps,
                tokens=tokens,
                top_logprobs=tops,
                finish_reason=ch.finish_reason,
            )
        )
    return ChatResult(choices=choices, usage=usage_of(raw))


def parse_completion(raw: Any, echo: bool) -> CompletionResult:
    if not isinstance(getattr(raw, "choices", None), list):
        raise ValueError("response has no choices")
    usage = usage_of(raw)
    choices = []
    for ch in sorted(raw.choices, key=lambda c: c.index or 0):
        lp = getattr(ch, "logprobs", None)
        tokens = list(lp.tokens) if lp is not None and lp.tokens is not None else None
        lps = list(lp.token_logprobs) if lp is not None and lp.token_logprobs is not None else None
        tops = None
        if lp is not None and lp.top_logprobs:
            tops = [dict(t or {}) for t in lp.top_logprobs]
        ids = extra_field(ch, "token_ids") or token_ids_from_strings(tokens)
        choices.append(
            Choice(
                text=ch.text or "",
                token_ids=list(ids) if ids is not None else None,
                token_logprobs=lps,
                tokens=tokens,
                top_logprobs=tops,
                finish_reason=ch.finish_reason,
            )
        )
    res = CompletionResult(choices=choices, usage=usage)
    if raw.choices:
        ch0 = sorted(raw.choices, key=lambda c: c.index or 0)[0]
        pids = extra_field(ch0, "prompt_token_ids")
        if pids is not None:
            res.prompt_token_ids = list(pids)
        plp = extra_field(ch0, "prompt_logprobs")
        if plp is not None:  # vLLM: [None, {token_id: {logprob, rank, decoded_token}}, ...]
            vals: list[float | None] = []
            toks: list[str] = []
            ids_: list[int] = []
            for i, entry in enumerate(plp):
                if not entry:
                    vals.append(None)
                    toks.append("")
                    ids_.append(res.prompt_token_ids[i] if res.prompt_token_ids else -1)
                    continue
                chosen_id = (
                    res.prompt_token_ids[i]
                    if res.prompt_token_ids and i < len(res.prompt_token_ids)
                    else None
                )
                key_ = (
                    str(chosen_id) if chosen_id is not None and str(chosen_id) in entry else next(iter(entry))
                )
                info = entry[key_]
                vals.append(float(info["logprob"]) if isinstance(info, dict) else float(info))
                toks.append(info.get("decoded_token", "") if isinstance(info, dict) else "")
                ids_.append(int(key_))
            res.prompt_logprobs = vals
            res.prompt_tokens = toks
            if res.prompt_token_ids is None:
                res.prompt_token_ids = ids_
        elif echo and choices and choices[0].token_logprobs is not None:
            k = usage.prompt_tokens or 0
            if k:
                res.prompt_logprobs = choices[0].token_logprobs[:k]
                res.prompt_tokens = (choices[0].tokens or [])[:k] or None
                if res.prompt_token_ids is None and choices[0].token_ids and len(choices[0].token_ids) >= k:
                    res.prompt_token_ids = choices[0].token_ids[:k]
    return res


def as_llm_error(exc: BaseException, timeout_s: float) -> LLMError:
    """An error of one call (the openai client's, or an unreadable response) as the LLMError it means: timeout,
    connection, rate_limit (with its Retry-After), too_long (a server's context refusal), server / client (the
    status), malformed."""
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return LLMError("timeout", f"no answer within {timeout_s}s")
    if isinstance(exc, openai.APIConnectionError):
        return LLMError("connection", str(exc) or type(exc).__name__)
    if isinstance(exc, openai.RateLimitError):
        err = LLMError("rate_limit", status_message(exc), status=exc.status_code)
        err.retry_after = retry_after_s(exc)
        return err
    if isinstance(exc, openai.APIStatusError):
        too_long = context_exceeded(exc) if exc.status_code in (400, 413, 422) else None
        if too_long is not None:  # a server without /tokenize refused the prompt as too long
            too_long.status = exc.status_code
            return too_long
        kind = "server" if exc.status_code >= 500 else "client"
        return LLMError(kind, status_message(exc), status=exc.status_code)
    return LLMError("malformed", f"unreadable response: {type(exc).__name__}: {exc}")
