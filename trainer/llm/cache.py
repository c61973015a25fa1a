"""The LLM client's response cache: the key of a request and the answers kept on disk (diskcache: SQLite,
safe across threads and processes, size-bounded). Only answers are stored, never a failure; a cache that
cannot be read or written is a miss, never an error."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from pipeline.llm.types import ChatResult, CompletionResult, LLMSettings
from trainer.llm.structured import response_format_parts

CACHE_VERSION = 1


def stable_hash(obj: Any) -> str:
    """sha256 of the object's JSON (keys sorted; what JSON cannot hold as its str)."""
    return hashlib.sha256(
        json.dumps(obj, sort_keys=True, default=str, ensure_ascii=False).encode()
    ).hexdigest()


def request_key(
    model: str,
    kind: str,
    content: dict[str, Any],
    params: dict[str, Any],
    response_format: Any,
    extra_body: dict[str, Any] | None,
) -> str:
    """The cache key of a request: the model, the whole request, its sampling parameters and schema."""
    rf_key = None
    if response_format is not None:
        name, schema, _ = response_format_parts(response_format)
        rf_key = {"name": name, "schema": schema}
    return stable_hash(
        {
            "v": CACHE_VERSION,
            "model": model,
            "kind": kind,
            "content": content,
            "params": params,
            "response_format": rf_key,
            "extra": extra_body or {},
        }
    )


class ResponseCache:
    """Answers by request key under `cache_dir` (off when `settings.cache` is false); opened on first use."""

    def __init__(self, cache_dir: Path, settings: LLMSettings):
        self.cache_dir = cache_dir
        self.settings = settings

    @functools.cached_property
    def _store(self) -> Any:
        import diskcache

        return diskcache.Cache(str(self.cache_dir), size_limit=self.settings.cache_size_limit)

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored answer ({"v", "kind", "result"}) or None (off, absent, unreadable, another version)."""
        if not self.settings.cache:
            return None
        try:
            data = self._store.get(key)
        except Exception:  # noqa: BLE001 - an unreadable cache is a miss, never a failure
            return None
        return data if isinstance(data, dict) and data.get("v") == CACHE_VERSION else None

    def put(self, key: str, result: ChatResult) -> None:
        if not self.settings.cache:
            return
        value = {"v": CACHE_VERSION, "kind": type(result).__name__, "result": result.model_dump(mode="json")}
        try:
            self._store.set(key, value)
        except Exception:  # noqa: BLE001 - a cache that cannot be written is a miss next time
            pass


async def cached_answer(
    responses: ResponseCache, inflight: dict[str, asyncio.Future], key: str, kind: str, t0: float
) -> ChatResult | CompletionResult | None:
    """The answer a request already has, marked cached: from the on-disk cache, or shared with the same
    request on its way in this loop (`inflight`; its answer awaited); None: it must be sent."""
    hit = responses.get(key)
    if hit is not None:
        result_cls = ChatResult if kind == "chat" else CompletionResult
        res = result_cls.model_validate(hit["result"])
        return res.model_copy(update={"cached": True, "latency_s": time.perf_counter() - t0})
    sent = inflight.get(key)
    if sent is not None:  # the same request is already on its way: share its answer
        res = await asyncio.shield(sent)
        return res.model_copy(update={"cached": True})
    return None
