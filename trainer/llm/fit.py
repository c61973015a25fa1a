"""Requests that fit the context: a prompt is counted by the server's own tokenizer and chat template (vLLM's
POST /tokenize, which also reports the served context) before it is sent; prompt + max_tokens over the
context (`context_tokens`, else the server's) fails as `LLMError` kind `too_long` without a call. An endpoint
without /tokenize (or with an answer it cannot read) is remembered and not checked again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.llm.types import LLMError, LLMSettings
from trainer.llm.cache import stable_hash


class TokenCounter:
    """Prompt counts per (endpoint, request body), and the endpoints without /tokenize, for one client."""

    def __init__(self, settings: LLMSettings):
        self.settings = settings
        self._no_tokenize: set[str] = set()
        self._counts: dict[tuple[str, str], tuple[int, int | None]] = {}  # (endpoint, body hash) -> count

    async def count_prompt(
        self, http: Callable[[], Any], endpoint: str, model: str, content: dict[str, Any], tools: Any = None
    ) -> tuple[int, int | None] | None:
        """(prompt tokens, the served context) through `http()` (this event loop's httpx.AsyncClient, made
        when first needed), or None when the endpoint has no /tokenize. Raises LLMError when it cannot be reached."""
        import httpx

        if endpoint in self._no_tokenize:
            return None
        prompt: Any = content.get("prompt")
        body: dict[str, Any] = {"model": model}
        ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if ids:  # token ids count themselves; the server is asked only for its context (once)
            known = await self.count_prompt(http, endpoint, model, {"prompt": ""})
            return None if known is None else (len(prompt), known[1])
        if "messages" in content:
            body.update(messages=content["messages"], add_generation_prompt=True)
            if tools:
                body["tools"] = tools
        else:
            body["prompt"] = prompt if isinstance(prompt, str) else "".join(map(str, prompt or []))
        key = (endpoint, stable_hash(body))
        if key in self._counts:
            return self._counts[key]
        base = endpoint[: -len("/v1")] if endpoint.endswith("/v1") else endpoint
        try:
            resp = await http().post(
                base + "/tokenize", json=body, headers={"Authorization": f"Bearer {self.settings.api_key}"}
            )
        except httpx.TimeoutException as exc:
            raise LLMError("timeout", f"/tokenize: no answer within {self.settings.timeout_s}s") from exc
        except httpx.HTTPError as exc:
            raise LLMError("connection", f"/tokenize: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (404, 405, 501):
            self._no_tokenize.add(endpoint)
            return None
        if resp.status_code >= 500:
            raise LLMError("server", f"/tokenize: HTTP {resp.status_code}", status=resp.status_code)
        if resp.status_code != 200:
            return None  # a request /tokenize cannot read (it is sent unchecked; the server says why)
        try:
            data = resp.json()
            out = (int(data["count"]), int(data["max_model_len"]) if data.get("max_model_len") else None)
        except (ValueError, KeyError, TypeError):
            self._no_tokenize.add(endpoint)
            return None
        self._counts[key] = out
        return out

    async def check_fit(
        self, http: Callable[[], Any], endpoint: str, model: str, content: dict, req: dict, body: dict
    ) -> None:
        """Raise `LLMError.too_long` when the prompt + max_tokens does not fit the endpoint's context."""
        if not self.settings.count_tokens:
            return
        counted = await self.count_prompt(http, endpoint, model, content, tools=body.get("tools"))
        if counted is None:
            return
        prompt_tokens, served = counted
        context = self.settings.context_tokens or served
        answer = int(req.get("max_tokens") or 0) or 1
        if context and prompt_tokens + answer > context:
            err = LLMError.too_long(prompt_tokens, answer, context)
            err.endpoint = endpoint
            raise err
