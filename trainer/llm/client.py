"""The shared LLM client: every LLM stage (IAPO annotator, TCPO counterfactual sampler, rescoring) calls
OpenAI-compatible endpoints (vLLM servers) through this module, never through `openai` directly.

    settings = LLMSettings.from_config(cfg)           # cfg.llm (+ cfg.stages["llm"]) -> validated settings
    client = LLMClient(settings)
    res = await client.chat([{"role": "user", "content": "hi"}], n=4, temperature=0.8, max_tokens=64,
                            logprobs=True, purpose="tcpo")
    res.choices[0].text, res.choices[0].token_logprobs, res.cached
    results = client.run_batch([LLMRequest.chat(msgs, max_tokens=32, purpose="iapo"), ...])  # sync
    lake_rows = client.records_table()                 # per-call records, schema `llm_calls`

What it does for every request (libraries where they exist, our code where they do not):
- bounded concurrency: one `asyncio.Semaphore(concurrency)` per event loop;
- the request itself through the `openai` SDK (`chat.completions.create` / `completions.create`, its errors
  and response models; its own retries off, since endpoint failover is ours);
- round-robin over `endpoints`; a connection error fails over to the next endpoint not yet tried, at once
  (ours: the SDK talks to one base URL);
- retries by tenacity: timeouts, 5xx, 429 and malformed bodies are retried with exponential backoff
  (`backoff_s * 2**k`, capped at `backoff_max_s`, at least a 429's `Retry-After`) up to `max_retries` times;
  other 4xx are not retried;
- structured output: `response_format` (a pydantic model class, a JSON schema dict, or an OpenAI
  response_format dict) is sent as `json_schema` when `structured_output` is "auto"/"json_schema"; in "auto"
  a server that rejects it (400/422) is remembered and the request is re-sent as plain text with the schema
  in a system instruction; either way each choice is parsed and validated (`Choice.parsed`,
  `Choice.parse_error`);
- a response cache (diskcache: SQLite, safe across threads and processes, size-bounded) keyed by
  sha256(model, kind, request content, sampling params, seed, response format): a re-run makes no call
  twice; identical requests in flight at once share one call (ours);
- a `CallRecord` per request (endpoint, model, latency, tokens, cache hit, error, attempts, purpose tag);
- requests that fit (`count_tokens`): before a request is sent its prompt is counted by the server's own
  tokenizer and chat template (vLLM's POST /tokenize, which also reports the served context); when prompt +
  max_tokens exceeds the context (`context_tokens`, else the server's) it is not sent and fails with
  `LLMError` kind `too_long` (prompt_tokens, context), which the stage reads (the IAPO annotator then splits
  the trajectory into windows). An endpoint without /tokenize is remembered and not checked; its own refusal
  of a prompt over its context (HTTP 400 "maximum context length is N tokens", vLLM's and OpenAI's wording)
  becomes the same `too_long` error, with the figures the server gave;
- a service that heals (`heal`): when a request to the managed vLLM server (`creditflow llm serve`, or a
  `healer` passed in) fails with a connection error, a 5xx or a timeout, its supervisor
  (trainer.llm.supervisor.Supervisor) checks /health and restarts a dead or unhealthy server (bounded by
  `max_restarts`, logged); requests that failed meanwhile share that restart and are sent again at once,
  spending none of their retries. Nothing from a dead endpoint is cached (only answers are).

vLLM extras: with `vllm_extras` on (default) requests carry `return_token_ids` so vLLM returns the token
ids of the completion (`Choice.token_ids`); completions may ask for `prompt_logprobs`. Servers that ignore
unknown fields (vLLM does) are unaffected; turn it off for strict servers.

`run_batch` never raises for a failed request: that request's slot holds an `LLMError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.llm.types import (
    CallRecord,
    ChatResult,
    CompletionResult,
    LLMError,
    LLMRequest,
    LLMSettings,
    default_cache_dir,
    normalize_endpoint,
)
from trainer.llm.responses import (
    as_llm_error,
    context_exceeded,
    parse_chat,
    parse_completion,
)
from trainer.llm.structured import response_format_parts, schema_instruction, validate_output

CACHE_VERSION = 1

# ---------------------------------------------------------------------------------------------------------
# the client


def _hash(obj: Any) -> str:
    return hashlib.sha256(
        json.dumps(obj, sort_keys=True, default=str, ensure_ascii=False).encode()
    ).hexdigest()


_HEAL_KINDS = frozenset(
    {"connection", "server", "timeout"}
)  # failures after which a managed server is checked
_POOL_SHARD = 16  # concurrent requests per HTTP connection pool (see LLMClient._client)


class _LoopState:
    def __init__(self, concurrency: int):
        self.sem = asyncio.Semaphore(concurrency)
        self.clients: dict[str, Any] = {}  # endpoint -> list of AsyncOpenAI clients (connection-pool shards)
        self.turn = itertools.count()
        self.inflight: dict[str, asyncio.Future] = {}
        self.model_lock = asyncio.Lock()
        self.http: Any = None  # httpx.AsyncClient for the server's own routes (/tokenize)


class LLMClient:
    """See the module docstring. Safe to share between coroutines and between threads (each event loop
    gets its own HTTP clients and semaphore)."""

    def __init__(self, settings: LLMSettings | None = None, *, healer: Any = None, **overrides: Any):
        if settings is None:
            settings = LLMSettings(**overrides)
        elif overrides:
            settings = settings.model_copy(update=overrides)
        self.settings = settings
        endpoints = list(settings.endpoints)
        if not endpoints:
            endpoints = _service_endpoints() or ["http://127.0.0.1:8000/v1"]
        self.endpoints = [normalize_endpoint(e) for e in endpoints]
        self.cache_dir = Path(settings.cache_dir).expanduser() if settings.cache_dir else default_cache_dir()
        self._model: str | None = settings.model
        self._rr = itertools.count()
        self._rr_lock = threading.Lock()
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._states_lock = threading.Lock()
        self._no_json_schema: set[str] = set()
        self._records: list[CallRecord] = []
        self._records_lock = threading.Lock()
        self.calls_made = 0  # HTTP requests actually sent (attempts), for tests and benchmarks
        self._restarts_seen: set[tuple[int, int]] = set()  # (healer, generation) this client's requests met
        self._healers: dict[str, Any] = {}
        if healer is not None:
            self._healers[normalize_endpoint(healer.url)] = healer
        self._no_tokenize: set[str] = set()
        self._counts: dict[tuple[str, str], tuple[int, int | None]] = {}  # (endpoint, body hash) -> count

    # ---- small helpers -------------------------------------------------------------------------------
    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        with self._states_lock:
            st = self._states.get(loop)
            if st is None:
                st = _LoopState(self.settings.concurrency)
                self._states[loop] = st
            return st

    def _client(self, st: _LoopState, endpoint: str):
        """An HTTP client for the endpoint. Above _POOL_SHARD concurrent requests the connections are spread
        over several clients, taken in turn: the HTTP pool scans all its connections on every request and
        response, so one pool of N connections costs O(N) CPU per request, and at 64 that bounds the rate."""
        shards = st.clients.get(endpoint)
        if shards is None:
            try:
                from openai import AsyncOpenAI
            except ModuleNotFoundError as exc:
                raise ModuleNotFoundError(
                    "the LLM client needs openai: pip install 'creditflow[llm]'"
                ) from exc

            n = max(1, -(-self.settings.concurrency // _POOL_SHARD))
            shards = [
                AsyncOpenAI(
                    base_url=endpoint,
                    api_key=self.settings.api_key,
                    timeout=self.settings.timeout_s,
                    max_retries=0,
                )
                for _ in range(n)
            ]
            st.clients[endpoint] = shards
        return shards[next(st.turn) % len(shards)]

    def _next_start(self) -> int:
        with self._rr_lock:
            return next(self._rr)

    @property
    def records(self) -> list[CallRecord]:
        with self._records_lock:
            return list(self._records)

    def clear_records(self) -> None:
        with self._records_lock:
            self._records.clear()

    def _record(self, rec: CallRecord) -> None:
        with self._records_lock:
            self._records.append(rec)

    async def aclose(self) -> None:
        """Close this event loop's HTTP clients."""
        st = self._state()
        for shards in st.clients.values():
            for c in shards:
                with contextlib.suppress(Exception):
                    await c.close()
        st.clients.clear()
        if st.http is not None:
            with contextlib.suppress(Exception):
                await st.http.aclose()
            st.http = None

    async def model_name(self) -> str:
        """The configured model, or the first model the endpoints serve (asked once)."""
        if self._model:
            return self._model
        st = self._state()
        async with st.model_lock:
            if self._model:
                return self._model
            last: Exception | None = None
            for ep in self.endpoints:
                healer = self._healer(ep)
                for _ in range(2):  # a managed server that does not answer is healed once, then asked again
                    seen = healer.generation if healer is not None else None
                    try:
                        page = await self._client(st, ep).models.list()
                        ids = [m.id for m in page.data]
                        if ids:
                            self._model = ids[0]
                            return self._model
                        break
                    except Exception as exc:  # noqa: BLE001 - try the next endpoint
                        last = exc
                        if healer is None:
                            break
                        await asyncio.to_thread(healer.heal, seen)
                        if healer.generation == seen:
                            break
                        self._restarts_seen.add((id(healer), healer.generation))
            raise LLMError("config", f"no model configured and none listed by {self.endpoints}: {last}")

    # ---- cache (diskcache: SQLite-backed, safe across threads and processes) ------------------------------
    @functools.cached_property
    def _cache(self) -> Any:
        import diskcache

        return diskcache.Cache(str(self.cache_dir), size_limit=self.settings.cache_size_limit)

    def _cache_get(self, key: str) -> dict[str, Any] | None:
        if not self.settings.cache:
            return None
        try:
            data = self._cache.get(key)
        except Exception:  # noqa: BLE001 - an unreadable cache is a miss, never a failure
            return None
        return data if isinstance(data, dict) and data.get("v") == CACHE_VERSION else None

    def _cache_put(self, key: str, result: ChatResult) -> None:
        if not self.settings.cache:
            return
        value = {"v": CACHE_VERSION, "kind": type(result).__name__, "result": result.model_dump(mode="json")}
        try:
            self._cache.set(key, value)
        except Exception:  # noqa: BLE001 - a cache that cannot be written is a miss next time
            pass

    # ---- public API ----------------------------------------------------------------------------------
    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        n: int = 1,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_tokens: int = 256,
        logprobs: bool = False,
        top_logprobs: int | None = None,
        response_format: Any = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        purpose: str | None = None,
        cache: bool = True,
        extra_body: dict[str, Any] | None = None,
    ) -> ChatResult:
        """One chat completion request (n choices). Raises `LLMError` when it fails for good."""
        params: dict[str, Any] = {
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "seed": seed,
            "stop": stop,
        }
        if logprobs:
            params["logprobs"] = True
            if top_logprobs:
                params["top_logprobs"] = top_logprobs
        return await self._request(
            "chat", {"messages": messages}, params, response_format, purpose, cache, extra_body
        )

    async def complete(
        self,
        prompt: str | list[int],
        *,
        echo: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        max_tokens: int = 16,
        n: int = 1,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        purpose: str | None = None,
        cache: bool = True,
        extra_body: dict[str, Any] | None = None,
    ) -> CompletionResult:
        """One /v1/completions request. `prompt` may be token ids. `echo=True, logprobs=0, max_tokens=0/1`
        scores the prompt; `prompt_logprobs=k` is vLLM's direct prompt scoring."""
        params: dict[str, Any] = {
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "seed": seed,
            "stop": stop,
            "echo": echo or None,
            "logprobs": logprobs,
        }
        eb = dict(extra_body or {})
        if prompt_logprobs is not None:
            eb["prompt_logprobs"] = prompt_logprobs
        return await self._request("complete", {"prompt": prompt}, params, None, purpose, cache, eb or None)

    async def abatch(self, requests: Sequence[LLMRequest | dict[str, Any]]) -> list[ChatResult | LLMError]:
        """Run requests concurrently (bounded by `concurrency`); a failed one yields its `LLMError`."""
        reqs = [LLMRequest.coerce(r) for r in requests]

        async def one(r: LLMRequest) -> ChatResult | LLMError:
            try:
                if r.kind == "chat":
                    return await self.chat(r.messages or [], **r.params)
                return await self.complete(r.prompt if r.prompt is not None else "", **r.params)
            except LLMError as exc:
                return exc
            except Exception as exc:  # noqa: BLE001 - one bad request never fails the batch
                return LLMError("client", f"{type(exc).__name__}: {exc}")

        return list(await asyncio.gather(*(one(r) for r in reqs)))

    def run_batch(self, requests: Sequence[LLMRequest | dict[str, Any]]) -> list[ChatResult | LLMError]:
        """Sync: run many requests concurrently; never raises for one failed request."""

        async def main() -> list[ChatResult | LLMError]:
            try:
                return await self.abatch(requests)
            finally:
                await self.aclose()

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(main())
        # called from inside an event loop (a notebook, an async task): run in a helper thread
        out: list[Any] = []
        err: list[BaseException] = []

        def runner() -> None:
            try:
                out.append(asyncio.run(main()))
            except BaseException as exc:  # noqa: BLE001
                err.append(exc)

        t = threading.Thread(target=runner, name="llm-run-batch")
        t.start()
        t.join()
        if err:
            raise err[0]
        return out[0]

    def records_table(self):
        """The per-call records as an Arrow table with the `llm_calls` schema."""
        from schemas.llm_calls import records_to_table

        return records_to_table([r.model_dump() for r in self.records])

    # ---- the request machinery ----------------------------------------------------------------------
    async def _request(
        self,
        kind: str,
        content: dict[str, Any],
        params: dict[str, Any],
        response_format: Any,
        purpose: str | None,
        use_cache: bool,
        extra_body: dict[str, Any] | None,
    ) -> Any:
        params = {k: v for k, v in params.items() if v is not None}
        model = await self.model_name()
        key = _request_key(model, kind, content, params, response_format, extra_body)
        t0 = time.perf_counter()
        if use_cache:
            res = await self._answered(key, kind, t0)
            if res is not None:
                self._record(self._make_record(kind, purpose, res.endpoint, model, key, res, None, 0, params))
                return res
        st = self._state()
        if use_cache:
            fut = asyncio.get_running_loop().create_future()
            st.inflight[key] = fut
        try:
            res, attempts = await self._send(
                st, kind, model, content, params, response_format, extra_body, key
            )
        except LLMError as exc:
            self._record(
                self._make_record(
                    kind,
                    purpose,
                    exc.endpoint,
                    model,
                    key,
                    None,
                    exc,
                    exc.attempts,
                    params,
                    latency=time.perf_counter() - t0,
                )
            )
            if use_cache:
                st.inflight.pop(key, None)
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # mark retrieved: nobody may be waiting
            raise
        except BaseException:
            if use_cache:
                st.inflight.pop(key, None)
                if not fut.done():
                    fut.cancel()
            raise
        res.latency_s = time.perf_counter() - t0
        res.request_hash = key
        all_invalid = response_format is not None and all(c.parse_error for c in res.choices)
        if use_cache and not all_invalid:
            self._cache_put(key, res)
        if use_cache:
            st.inflight.pop(key, None)
            if not fut.done():
                fut.set_result(res)
        self._record(self._make_record(kind, purpose, res.endpoint, model, key, res, None, attempts, params))
        return res

    async def _answered(self, key: str, kind: str, t0: float) -> ChatResult | CompletionResult | None:
        """The answer a request already has, marked cached: from the on-disk cache, or shared with the same
        request on its way in this loop (its answer awaited); None: it must be sent."""
        hit = self._cache_get(key)
        if hit is not None:
            result_cls = ChatResult if kind == "chat" else CompletionResult
            res = result_cls.model_validate(hit["result"])
            return res.model_copy(update={"cached": True, "latency_s": time.perf_counter() - t0})
        sent = self._state().inflight.get(key)
        if sent is not None:  # the same request is already on its way: share its answer
            res = await asyncio.shield(sent)
            return res.model_copy(update={"cached": True})
        return None

    def _make_record(self, kind, purpose, endpoint, model, key, res, err, attempts, params, latency=None):
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

    async def _send(
        self,
        st: _LoopState,
        kind: str,
        model: str,
        content: dict[str, Any],
        params: dict[str, Any],
        response_format: Any,
        extra_body: dict[str, Any] | None,
        key: str,
    ) -> tuple[Any, int]:
        """Send with retries (tenacity: exponential backoff from `backoff_s`, capped at `backoff_max_s`, a
        server's Retry-After honoured, `max_retries` retries of retryable failures). Within one try a
        connection error fails over to the next endpoint not yet tried, with no sleep and no retry spent."""
        from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt

        s = self.settings
        n_ep = len(self.endpoints)
        ep_i = self._next_start()
        attempts = 0
        heals = 0

        async def one_try() -> Any:
            nonlocal ep_i, attempts, heals
            tried: set[int] = set()
            while True:
                endpoint = self.endpoints[ep_i % n_ep]
                tried.add(ep_i % n_ep)
                ep_i += 1
                attempts += 1
                healer = self._healer(endpoint)
                seen = healer.generation if healer is not None else None
                try:
                    async with st.sem:
                        return await self._call_once(
                            st, endpoint, kind, model, content, params, response_format, extra_body
                        )
                except LLMError as exc:
                    exc.endpoint, exc.attempts, exc.request_hash = endpoint, attempts, key
                    if healer is not None and exc.kind in _HEAL_KINDS and heals < s.max_restarts + 1:
                        # the managed server may have died: restart it (or wait for the restart another
                        # request started), then send again without spending a retry
                        await asyncio.to_thread(healer.heal, seen)
                        if healer.generation != seen:
                            heals += 1
                            self._restarts_seen.add((id(healer), healer.generation))
                            tried.discard((ep_i - 1) % n_ep)
                            continue
                    if exc.kind == "connection" and len(tried) < n_ep:
                        continue
                    raise

        def wait(retry_state: Any) -> float:
            backoff = s.backoff_s * 2 ** (retry_state.attempt_number - 1)
            exc = retry_state.outcome.exception() if retry_state.outcome else None
            retry_after = getattr(exc, "retry_after", None) or 0.0
            return min(max(backoff, retry_after), s.backoff_max_s)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(s.max_retries + 1),
            wait=wait,
            retry=retry_if_exception(lambda exc: isinstance(exc, LLMError) and exc.retryable),
            sleep=asyncio.sleep,
            reraise=True,
        )
        res: Any = await retrying(one_try)
        return res, attempts

    @property
    def restarts(self) -> int:
        """Restarts of a managed server that this client's failed requests waited for (each counted once)."""
        return len(self._restarts_seen)

    def _healer(self, endpoint: str) -> Any:
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

    async def count_prompt(
        self, endpoint: str, model: str, content: dict[str, Any], tools: Any = None
    ) -> tuple[int, int | None] | None:
        """(prompt tokens, the served context) by the server's tokenizer and chat template (vLLM POST
        /tokenize), or None when the endpoint has no such route. Raises LLMError when it cannot be reached."""
        import httpx

        if endpoint in self._no_tokenize:
            return None
        prompt: Any = content.get("prompt")
        body: dict[str, Any] = {"model": model}
        ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if ids:  # token ids count themselves; the server is asked only for its context (once)
            known = await self.count_prompt(endpoint, model, {"prompt": ""})
            return None if known is None else (len(prompt), known[1])
        if "messages" in content:
            body.update(messages=content["messages"], add_generation_prompt=True)
            if tools:
                body["tools"] = tools
        else:
            body["prompt"] = prompt if isinstance(prompt, str) else "".join(map(str, prompt or []))
        key = (endpoint, _hash(body))
        if key in self._counts:
            return self._counts[key]
        st = self._state()
        if st.http is None:
            st.http = httpx.AsyncClient(timeout=self.settings.timeout_s)
        base = endpoint[: -len("/v1")] if endpoint.endswith("/v1") else endpoint
        try:
            resp = await st.http.post(
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

    async def _check_fit(self, endpoint: str, model: str, content: dict, req: dict, body: dict) -> None:
        """Raise `LLMError.too_long` when the prompt + max_tokens does not fit the endpoint's context."""
        if not self.settings.count_tokens:
            return
        counted = await self.count_prompt(endpoint, model, content, tools=body.get("tools"))
        if counted is None:
            return
        prompt_tokens, served = counted
        context = self.settings.context_tokens or served
        answer = int(req.get("max_tokens") or 0) or 1
        if context and prompt_tokens + answer > context:
            err = LLMError.too_long(prompt_tokens, answer, context)
            err.endpoint = endpoint
            raise err

    def _structured_request(
        self, req: dict[str, Any], response_format: Any, endpoint: str
    ) -> tuple[dict[str, Any] | None, Any, str | None]:
        """(schema, model class, how the answer is structured) of a request's `response_format`; sets the
        server's json_schema parameter in `req` where the endpoint does constrained decoding (`structured_output`;
        an endpoint found without it is prompted instead: `structured` None here, "prompted" once sent)."""
        if response_format is None:
            return None, None, None
        name, schema, model_cls = response_format_parts(response_format)
        mode = self.settings.structured_output
        if not (mode == "json_schema" or (mode == "auto" and endpoint not in self._no_json_schema)):
            return schema, model_cls, None
        if schema is None:
            req["response_format"] = {"type": "json_object"}
        else:
            req["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": name[:64], "schema": schema},
            }
        return schema, model_cls, "json_schema"

    async def _call_once(
        self,
        st: _LoopState,
        endpoint: str,
        kind: str,
        model: str,
        content: dict[str, Any],
        params: dict[str, Any],
        response_format: Any,
        extra_body: dict[str, Any] | None,
    ) -> Any:
        import openai

        client = self._client(st, endpoint)
        body = dict(extra_body or {})
        if self.settings.vllm_extras:
            body.setdefault("return_token_ids", True)
        req = dict(params)
        schema, model_cls, structured = self._structured_request(req, response_format, endpoint)
        t0 = time.perf_counter()
        try:
            if kind == "chat":
                messages = content["messages"]
                if response_format is not None and structured is None:
                    messages = [{"role": "system", "content": schema_instruction(schema)}, *messages]
                    structured = "prompted"
                try:
                    await self._check_fit(endpoint, model, {"messages": messages}, req, body)
                    self.calls_made += 1
                    raw = await client.chat.completions.create(
                        model=model, messages=messages, extra_body=body or None, **req
                    )
                except (openai.BadRequestError, openai.UnprocessableEntityError) as exc:
                    if (
                        structured != "json_schema"
                        or self.settings.structured_output != "auto"
                        or context_exceeded(exc) is not None
                    ):
                        raise  # a request over the context is no sign that json_schema is unsupported
                    # the server cannot do constrained decoding: remember, fall back to a prompted request
                    self._no_json_schema.add(endpoint)
                    req.pop("response_format", None)
                    messages = [{"role": "system", "content": schema_instruction(schema)}, *messages]
                    structured = "prompted"
                    del exc
                    await self._check_fit(endpoint, model, {"messages": messages}, req, body)
                    self.calls_made += 1
                    raw = await client.chat.completions.create(
                        model=model, messages=messages, extra_body=body or None, **req
                    )
                res = parse_chat(raw)
            else:
                await self._check_fit(endpoint, model, {"prompt": content["prompt"]}, req, body)
                self.calls_made += 1
                raw = await client.completions.create(
                    model=model, prompt=content["prompt"], extra_body=body or None, **req
                )
                res = parse_completion(raw, echo=bool(params.get("echo")))
        except (
            openai.APIConnectionError,  # a timeout too
            openai.APIStatusError,
            openai.APIResponseValidationError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            raise as_llm_error(exc, self.settings.timeout_s) from exc
        res.latency_s = time.perf_counter() - t0
        res.endpoint = endpoint
        res.model = model
        if response_format is not None:
            res.structured = structured
            for c in res.choices:
                c.parsed, c.parse_error = validate_output(c.text, schema, model_cls)
        return res


def _request_key(
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
    return _hash(
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


def _service_endpoints() -> list[str]:
    """The endpoint written by `creditflow llm serve` (if the service module and its state exist)."""
    try:
        from trainer.llm.service import recorded_endpoints
    except ImportError:
        return []
    try:
        return recorded_endpoints()
    except Exception:  # noqa: BLE001 - a broken state file means "not recorded"
        return []
