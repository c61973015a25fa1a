"""The LLM client's call records: one `CallRecord` per request (endpoint, model, latency, tokens, cache hit,
error, attempts, purpose tag), kept in order and safe to append from several threads."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from pipeline.llm.types import CallRecord, LLMError


class CallLog:
    def __init__(self) -> None:
        self._records: list[CallRecord] = []
        self._lock = threading.Lock()

    def all(self) -> list[CallRecord]:
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def add(self, rec: CallRecord) -> None:
        with self._lock:
            self._records.append(rec)


def call_record(
    kind: str,
    purpose: str | None,
    endpoint: str | None,
    model: str,
    key: str,
    res: Any,
    err: LLMError | None,
    attempts: int,
    params: dict[str, Any],
    latency: float | None = None,
) -> CallRecord:
    """The record of one request: its answer `res` (None when it failed with `err`)."""
    return CallRecord(
        call_id=uuid.uuid4().hex,
        ts=time.time(),
        purpose=purpose,
        kind=kind,
        endpoint=endpoint,
        model=model,
        request_hash=key,
        latency_s=float(latency if latency is not None else (res.latency_s if res else 0.0)),
        prompt_tokens=res.usage.prompt_tokens if res else None,
        completion_tokens=res.usage.completion_tokens if res else None,
        n=int(params.get("n", 1)),
        cached=bool(res.cached) if res else False,
        attempts=attempts,
        error=str(err) if err else None,
        structured=res.structured if res else None,
    )
