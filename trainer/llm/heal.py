"""Healing and retrying for the LLM client. A request to the managed vLLM server (`creditflow llm serve`, or a
`healer` passed in) that fails with a connection error, a 5xx or a timeout has its supervisor
(trainer.llm.supervisor.Supervisor) check /health and restart a dead or unhealthy server; requests that failed
meanwhile share that restart (the supervisor's generation tells) and are sent again. Retries of retryable
failures are tenacity's, with exponential backoff and a server's Retry-After honoured."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.llm.types import LLMError, LLMSettings, normalize_endpoint

HEAL_KINDS = frozenset(
    {"connection", "server", "timeout"}
)  # failures after which a managed server is checked


class Healers:
    """The supervisor of each endpoint's managed server (None: not managed, or healing off), and the restarts
    this client's requests met."""

    def __init__(self, settings: LLMSettings, healer: Any = None):
        self.settings = settings
        self._healers: dict[str, Any] = {}
        self._restarts_seen: set[tuple[int, int]] = set()  # (healer, generation) this client's requests met
        if healer is not None:
            self._healers[normalize_endpoint(healer.url)] = healer

    def healer(self, endpoint: str) -> Any:
        """The supervisor of the managed server at `endpoint` (None: not managed, or healing off)."""
        if endpoint in self._healers:
            return self._healers[endpoint]
        sup = None
        if self.settings.heal:
            try:
                from trainer.llm.supervisor import supervisor

                sup = supervisor(endpoint, max_restarts=self.settings.max_restarts)
            except Exception:  # noqa: BLE001 - an unreadable state file: not managed
                sup = None
        self._healers[endpoint] = sup
        return sup

    async def heal(self, healer: Any, seen: int | None) -> bool:
        """Have `healer` check its server, which was at generation `seen` when the request failed (restart it,
        or wait for the restart another request started). True: it was restarted since (counted once)."""
        await asyncio.to_thread(healer.heal, seen)
        if healer.generation == seen:
            return False
        self._restarts_seen.add((id(healer), healer.generation))
        return True

    @property
    def restarts(self) -> int:
        """Restarts of a managed server that this client's failed requests waited for (each counted once)."""
        return len(self._restarts_seen)


def retrying(settings: LLMSettings) -> Any:
    """tenacity's AsyncRetrying for one request: `max_retries` retries of a retryable `LLMError`, waiting
    `backoff_s * 2**k` (at least a 429's Retry-After), capped at `backoff_max_s`; the last error re-raised."""
    from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt

    def wait(retry_state: Any) -> float:
        backoff = settings.backoff_s * 2 ** (retry_state.attempt_number - 1)
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        retry_after = getattr(exc, "retry_after", None) or 0.0
        return min(max(backoff, retry_after), settings.backoff_max_s)

    return AsyncRetrying(
        stop=stop_after_attempt(settings.max_retries + 1),
        wait=wait,
        retry=retry_if_exception(lambda exc: isinstance(exc, LLMError) and exc.retryable),
        sleep=asyncio.sleep,
        reraise=True,
    )


async def listed_model(endpoints: list[str], settings: LLMSettings, st: Any, healers: Healers) -> str:
    """The first model the endpoints serve, asked in order through `st` (the loop's LoopState); a managed
    server that does not answer is healed once, then asked again. LLMError "config" when none lists one."""
    last: Exception | None = None
    for ep in endpoints:
        healer = healers.healer(ep)
        for _ in range(2):
            seen = healer.generation if healer is not None else None
            try:
                page = await st.client(ep, settings).models.list()
                ids = [m.id for m in page.data]
                if ids:
                    return ids[0]
                break
            except Exception as exc:  # noqa: BLE001 - try the next endpoint
                last = exc
                if healer is None or not await healers.heal(healer, seen):
                    break
    raise LLMError("config", f"no model configured and none listed by {endpoints}: {last}")
