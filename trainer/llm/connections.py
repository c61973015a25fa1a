"""The LLM client's connections, one set per event loop: the semaphore bounding concurrent requests, the
`openai` clients of each endpoint (spread over connection-pool shards), the requests in flight (shared by
identical ones) and the httpx client for the server's own routes (/tokenize)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

from pipeline.llm.types import LLMSettings

POOL_SHARD = 16  # concurrent requests per HTTP connection pool (see LoopState.client)


class LoopState:
    def __init__(self, concurrency: int):
        self.sem = asyncio.Semaphore(concurrency)
        self.clients: dict[str, Any] = {}  # endpoint -> list of AsyncOpenAI clients (connection-pool shards)
        self.turn = itertools.count()
        self.inflight: dict[str, asyncio.Future] = {}
        self.model_lock = asyncio.Lock()
        self.http: Any = None  # httpx.AsyncClient for the server's own routes (/tokenize)

    def client(self, endpoint: str, settings: LLMSettings) -> Any:
        """An HTTP client for the endpoint. Above POOL_SHARD concurrent requests the connections are spread
        over several clients, taken in turn: the HTTP pool scans all its connections on every request and
        response, so one pool of N connections costs O(N) CPU per request, and at 64 that bounds the rate."""
        shards = self.clients.get(endpoint)
        if shards is None:
            try:
                from openai import AsyncOpenAI
            except ModuleNotFoundError as exc:
                raise ModuleNotFoundError(
                    "the LLM client needs openai: pip install 'creditflow[llm]'"
                ) from exc

            n = max(1, -(-settings.concurrency // POOL_SHARD))
            shards = [
                AsyncOpenAI(
                    base_url=endpoint,
                    api_key=settings.api_key,
                    timeout=settings.timeout_s,
                    max_retries=0,
                )
                for _ in range(n)
            ]
            self.clients[endpoint] = shards
        return shards[next(self.turn) % len(shards)]

    def http_client(self, settings: LLMSettings) -> Any:
        """The httpx client for the server's own routes (/tokenize), made when first needed."""
        if self.http is None:
            import httpx

            self.http = httpx.AsyncClient(timeout=settings.timeout_s)
        return self.http

    async def aclose(self) -> None:
        """Close this loop's HTTP clients (errors on closing ignored)."""
        for shards in self.clients.values():
            for c in shards:
                with contextlib.suppress(Exception):
                    await c.close()
        self.clients.clear()
        if self.http is not None:
            with contextlib.suppress(Exception):
                await self.http.aclose()
            self.http = None
