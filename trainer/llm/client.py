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
- a response cache (trainer.llm.cache; diskcache) keyed by sha256(model, kind, request content, sampling
  params, seed, response format): a re-run makes no call twice; identical requests in flight at once share
  one call (ours);
- a `CallRecord` per request (trainer.llm.records: endpoint, model, latency, tokens, cache hit, error, attempts,
  purpose tag);
- requests that fit (`count_tokens`, trainer.llm.fit): a prompt is counted by the server's own tokenizer and
  chat template (vLLM's POST /tokenize) before it is sent; over the context (`context_tokens`, else the
  server's) it is not sent and fails with `LLMError` kind `too_long` (prompt_tokens, context), which the stage
  reads (the IAPO annotator then splits the trajectory into windows). A server's own refusal of a prompt over
  its context (HTTP 400 "maximum context length is N tokens") becomes the same `too_long` error;
- a service that heals (`heal`, trainer.llm.heal): when a request to the managed vLLM server (`creditflow llm
  serve`, or a `healer` passed in) fails with a connection error, a 5xx or a timeout, its supervisor checks
  /health and restarts a dead or unhealthy server (bounded by `max_restarts`, logged); requests that failed
  meanwhile share that restart and are sent again at once, spending none of their retries. Nothing from a
  dead endpoint is cached (only answers are).

vLLM extras: with `vllm_extras` on (default) requests carry `return_token_ids` so vLLM returns the token
ids of the completion (`Choice.token_ids`); completions may ask for `prompt_logprobs`. Servers that ignore
unknown fields (vLLM does) are unaffected; turn it off for strict servers.

`run_batch` never raises for a failed request: that request's slot holds an `LLMError`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
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
from trainer.llm.cache import ResponseCache, cached_answer, request_key
from trainer.llm.connections import LoopState
from trainer.llm.fit import TokenCounter
from trainer.llm.heal import HEAL_KINDS, Healers, listed_model, retrying
from trainer.llm.records import CallLog, call_record
from trainer.llm.responses import (
    as_llm_error,
    context_exceeded,
    parse_chat,
    parse_completion,
)
from trainer.llm.structured import schema_instruction, structured_request, validate_output


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
        self._log = CallLog()  # a CallRecord per request (trainer.llm.records)
        self.calls_made = 0  # HTTP requests actually sent (attempts), for tests and benchmarks
        self._responses = ResponseCache(self.cache_dir, settings)  # answers on disk (trainer.llm.cache)
        self._heal = Healers(settings, healer)  # managed servers' supervisors (trainer.llm.heal)
        self._fit = TokenCounter(settings)  # prompt counts by /tokenize (trainer.llm.fit)

    # ---- small helpers -------------------------------------------------------------------------------
    def _state(self) -> LoopState:
        loop = asyncio.get_running_loop()
        with self._states_lock:
            st = self._states.get(loop)
            if st is None:
                st = LoopState(self.settings.concurrency)
                self._states[loop] = st
            return st

    def _next_start(self) -> int:
        with self._rr_lock:
            return next(self._rr)

    @property
    def records(self) -> list[CallRecord]:
        return self._log.all()

    def clear_records(self) -> None:
        self._log.clear()

    async def aclose(self) -> None:
        """Close this event loop's HTTP clients."""
        await self._state().aclose()

    async def model_name(self) -> str:
        """The configured model, or the first model the endpoints serve (asked once)."""
        if self._model:
            return self._model
        st = self._state()
        async with st.model_lock:
            if self._model:
                return self._model
            self._model = await listed_model(self.endpoints, self.settings, st, self._heal)
            return self._model

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
        key = request_key(model, kind, content, params, response_format, extra_body)
        t0 = time.perf_counter()
        if use_cache:
            res = await cached_answer(self._responses, self._state().inflight, key, kind, t0)
            if res is not None:
                self._log.add(call_record(kind, purpose, res.endpoint, model, key, res, None, 0, params))
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
            self._log.add(
                call_record(
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
            self._responses.put(key, res)
        if use_cache:
            st.inflight.pop(key, None)
            if not fut.done():
                fut.set_result(res)
        self._log.add(call_record(kind, purpose, res.endpoint, model, key, res, None, attempts, params))
        return res

    async def _send(
        self,
        st: LoopState,
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
                healer = self._heal.healer(endpoint)
                seen = healer.generation if healer is not None else None
                try:
                    async with st.sem:
                        return await self._call_once(
                            st, endpoint, kind, model, content, params, response_format, extra_body
                        )
                except LLMError as exc:
                    exc.endpoint, exc.attempts, exc.request_hash = endpoint, attempts, key
                    if healer is not None and exc.kind in HEAL_KINDS and heals < s.max_restarts + 1:
                        # the managed server may have died: restart it (or wait for the restart another
                        # request started), then send again without spending a retry
                        if await self._heal.heal(healer, seen):
                            heals += 1
                            tried.discard((ep_i - 1) % n_ep)
                            continue
                    if exc.kind == "connection" and len(tried) < n_ep:
                        continue
                    raise

        res: Any = await retrying(s)(one_try)
        return res, attempts

    @property
    def restarts(self) -> int:
        """Restarts of a managed server that this client's failed requests waited for (each counted once)."""
        return self._heal.restarts

    async def count_prompt(
        self, endpoint: str, model: str, content: dict[str, Any], tools: Any = None
    ) -> tuple[int, int | None] | None:
        """(prompt tokens, the served context) by the server's tokenizer and chat template (vLLM POST
        /tokenize), or None when the endpoint has no such route. Raises LLMError when it cannot be reached."""
        return await self._fit.count_prompt(self._http, endpoint, model, content, tools)

    def _http(self) -> Any:
        """This event loop's httpx client for the server's own routes (/tokenize), made when first needed."""
        return self._state().http_client(self.settings)

    async def _check_fit(self, endpoint: str, model: str, content: dict, req: dict, body: dict) -> None:
        """Raise `LLMError.too_long` when the prompt + max_tokens does not fit the endpoint's context."""
        await self._fit.check_fit(self._http, endpoint, model, content, req, body)

    async def _call_once(
        self,
        st: LoopState,
        endpoint: str,
        kind: str,
        model: str,
        content: dict[str, Any],
        params: dict[str, Any],
        response_format: Any,
        extra_body: dict[str, Any] | None,
    ) -> Any:
        import openai

        client = st.client(endpoint, self.settings)
        body = dict(extra_body or {})
        if self.settings.vllm_extras:
            body.setdefault("return_token_ids", True)
        req = dict(params)
        mode = self.settings.structured_output
        constrained = mode == "json_schema" or (mode == "auto" and endpoint not in self._no_json_schema)
        schema, model_cls, structured = structured_request(req, response_format, constrained)
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
