"""A stand-in for an OpenAI-compatible server (the parts of vLLM's API that creditflow uses). It is NOT a
model: its answers are a deterministic function of the request, so tests can predict them exactly.

A FastAPI app served by uvicorn on a free local port in a background thread (the `openai` 3.x client is
built on httpx2, which respx cannot intercept; a real socket can). Endpoints: GET /health, GET /v1/models,
POST /v1/chat/completions, POST /v1/completions.

Pluggable behaviour:
- `behaviour(body, kind, index) -> str`: the text of choice `index` (default: `default_reply`); it may
  raise `Fail(kind)` to fail that request (e.g. one poisoned prompt in a batch);
- `fail_next(count, kind)`: the next `count` requests fail with `kind`: "500", "503", "429", "400",
  "timeout" (sleeps `hang_s`, longer than the client's timeout), "malformed" (200 with a broken JSON body),
  "drop" (closes the connection without an answer);
- `retry_after_s`: a 429 answer carries `Retry-After` with this many seconds (0: none);
- `latency_s`: fixed latency added to every answer (for concurrency/throughput checks);
- `reject_json_schema`: answer 400 to a `response_format` of type json_schema (a server without
  constrained decoding);
- logprobs (chat `logprobs/top_logprobs`, completions `logprobs`), `n` choices, `echo` with prompt
  logprobs, vLLM's `prompt_logprobs` and `return_token_ids` extras;
- `max_model_len`: None (default) serves no /tokenize (404, like a server that is not vLLM); a number serves
  vLLM's POST /tokenize (`count`, `max_model_len`, `tokens`, counted with the stand-in's tokens) and answers
  400 "maximum context length" to a request whose prompt does not leave one token, as vLLM does;
  `tokenize_route = False` keeps that limit but serves no /tokenize (an OpenAI-compatible server that is not
  vLLM: it only refuses);
- `down`: True makes /health and /v1/models answer 503 and every generation request fail with 500 (an
  engine that died).

Tokens are whitespace-delimited chunks (`\\S+\\s*`); a token's id is a stable hash, its logprob a function of
the id (`token_logprob`). A prompt given as token ids is echoed as tokens "t<id>".
Counters: `calls` (HTTP requests to the two generation endpoints), `max_inflight`, `requests` (bodies);
GET /standin/stats returns calls and max_inflight (for a stand-in in another process, as in bench/).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fastapi import Request  # module level: the handlers' annotations must resolve

_TOKEN = re.compile(r"\S+\s*|\s+")


class Fail(Exception):  # noqa: N818 - raised by a behaviour to inject a failure
    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


def token_id(tok: str) -> int:
    return int(hashlib.sha1(tok.encode()).hexdigest()[:6], 16) % 49152


def token_logprob(tid: int) -> float:
    return -0.05 - (tid % 13) / 4.0


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def _last_content(body: dict[str, Any]) -> str:
    if "messages" in body:
        msgs = body["messages"] or [{}]
        c = msgs[-1].get("content", "")
        return c if isinstance(c, str) else json.dumps(c)
    p = body.get("prompt", "")
    return p if isinstance(p, str) else " ".join(map(str, p))


def default_reply(body: dict[str, Any], kind: str, index: int) -> str:
    """Deterministic: 'reply <index> to <8 hex of the request content> : <last words of the prompt>'."""
    content = _last_content(body)
    h = hashlib.sha256((content + str(body.get("seed"))).encode()).hexdigest()[:8]
    tail = " ".join(content.split()[-3:])
    return f"reply {index} to {h} : {tail}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_endpoint() -> str:
    """A base URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}/v1"


class StandIn:
    def __init__(
        self,
        behaviour: Callable[[dict, str, int], str] | None = None,
        *,
        latency_s: float = 0.0,
        model: str = "standin-model",
        hang_s: float = 3.0,
    ):
        self.model = model
        self.hang_s = hang_s
        self.reset()
        if behaviour is not None:
            self.behaviour = behaviour
        self.latency_s = latency_s
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    # ---- state -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.behaviour: Callable[[dict, str, int], str] = default_reply
        self.latency_s = 0.0
        self.reject_json_schema = False
        self.max_model_len: int | None = None
        self.tokenize_route = True
        self.tokenize_calls = 0
        self.down = False
        self._failures: deque[str] = deque()
        self.retry_after_s = 0.0  # a 429 carries Retry-After: this many seconds (0: no header)
        self.requests: list[dict[str, Any]] = []
        self.calls = 0
        self.inflight = 0
        self.max_inflight = 0
        self.call_times: list[float] = []
        self._lock = threading.Lock()

    def fail_next(self, count: int, kind: str = "500") -> None:
        with self._lock:
            self._failures.extend([kind] * count)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # ---- server ----------------------------------------------------------------------------------------
    def start(self) -> StandIn:
        import uvicorn

        app = self._app()
        # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto is TCP;
        # without it Nagle + delayed ACK add ~40 ms to every keep-alive response
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(512)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="error",
            lifespan="off",
            timeout_graceful_shutdown=1,
            backlog=512,
            timeout_keep_alive=30,
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"llm-standin-{self.port}"
        )
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("the LLM stand-in did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> StandIn:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- the app ---------------------------------------------------------------------------------------
    def _app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response

        app = FastAPI()
        standin = self

        @app.get("/health")
        async def health():
            return Response(status_code=503 if standin.down else 200)

        @app.post("/tokenize")
        async def tokenize_route(request: Request):
            body = await request.json()
            with standin._lock:
                standin.tokenize_calls += 1
            if standin.max_model_len is None or not standin.tokenize_route:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            _, ids = standin._prompt_tokens(body, "chat" if "messages" in body else "complete")
            return {"count": len(ids), "max_model_len": standin.max_model_len, "tokens": ids}

        @app.get("/standin/stats")
        async def stats():
            return {
                "calls": standin.calls,
                "max_inflight": standin.max_inflight,
                "inflight": standin.inflight,
            }

        @app.post("/standin/reset_stats")
        async def reset_stats():
            with standin._lock:
                standin.calls, standin.max_inflight = 0, 0
            return {}

        @app.get("/v1/models")
        async def models():
            if standin.down:
                return JSONResponse(
                    {"object": "error", "message": "engine dead", "code": 503}, status_code=503
                )
            return {
                "object": "list",
                "data": [{"id": standin.model, "object": "model", "created": 0, "owned_by": "standin"}],
            }

        async def handle(request: Request, kind: str):
            body = await request.json()
            with standin._lock:
                standin.calls += 1
                standin.requests.append(body)
                standin.call_times.append(time.perf_counter())
                standin.inflight += 1
                standin.max_inflight = max(standin.max_inflight, standin.inflight)
                failure = standin._failures.popleft() if standin._failures else None
            try:
                if standin.latency_s:
                    await asyncio.sleep(standin.latency_s)
                if failure is None and standin.down:
                    failure = "500"
                if failure is None and standin.max_model_len is not None:
                    n_prompt = len(standin._prompt_tokens(body, kind)[1])
                    if n_prompt + 1 > standin.max_model_len:
                        msg = (
                            f"This model's maximum context length is {standin.max_model_len} tokens. "
                            f"However, your request has {n_prompt} input tokens."
                        )
                        return JSONResponse(
                            {"object": "error", "message": msg, "type": "BadRequestError", "code": 400},
                            status_code=400,
                        )
                if failure is None and standin.reject_json_schema:
                    rf = body.get("response_format") or {}
                    if rf.get("type") == "json_schema":
                        failure = "400"
                try:
                    payload = None if failure else standin._answer(body, kind)
                except Fail as f:
                    failure = f.kind
                if failure is not None:
                    return await standin._failure(failure, request)
                return JSONResponse(payload)
            finally:
                with standin._lock:
                    standin.inflight -= 1

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, "complete")

        return app

    async def _failure(self, kind: str, request: Any):
        from fastapi.responses import JSONResponse, Response

        if kind == "timeout":
            await asyncio.sleep(self.hang_s)
            return JSONResponse({"error": {"message": "too late"}}, status_code=504)
        if kind == "malformed":
            return Response(
                content=b'{"id": "x", "choices": [ {"text": "unterminated',
                status_code=200,
                media_type="application/json",
            )
        if kind == "drop":
            # end the connection without an answer: uvicorn closes it when the ASGI app raises
            raise ConnectionResetError("dropped by the stand-in")
        status = int(kind)
        return JSONResponse(
            {"object": "error", "message": f"injected {status}", "type": "injected", "code": status},
            status_code=status,
            headers={"Retry-After": str(self.retry_after_s)}
            if status == 429 and self.retry_after_s
            else None,
        )

    def _answer(self, body: dict[str, Any], kind: str) -> dict[str, Any]:
        n = int(body.get("n") or 1)
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_completion_tokens")
        max_tokens = 10**9 if max_tokens is None else int(max_tokens)
        want_ids = bool(body.get("return_token_ids"))
        choices = []
        prompt_toks, prompt_ids = self._prompt_tokens(body, kind)
        completion_tokens = 0
        for i in range(n):
            text_full = self.behaviour(body, kind, i)
            toks = tokenize(text_full)
            finish = "stop"
            if len(toks) > max_tokens:
                toks, finish = toks[:max_tokens], "length"
            text = "".join(toks)
            ids = [token_id(t) for t in toks]
            lps = [token_logprob(t) for t in ids]
            completion_tokens += len(toks)
            if kind == "chat":
                ch: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                    "logprobs": None,
                }
                if body.get("logprobs"):
                    k = int(body.get("top_logprobs") or 0)
                    ch["logprobs"] = {
                        "content": [
                            {
                                "token": t,
                                "logprob": lp,
                                "bytes": list(t.encode()),
                                "top_logprobs": [{"token": t, "logprob": lp, "bytes": None}]
                                + [
                                    {"token": f"alt{j}", "logprob": lp - j - 1, "bytes": None}
                                    for j in range(k - 1)
                                ]
                                if k
                                else [],
                            }
                            for t, lp in zip(toks, lps, strict=True)
                        ]
                    }
                if want_ids:
                    ch["token_ids"] = ids
            else:
                echo = bool(body.get("echo"))
                out_toks = (prompt_toks if echo else []) + toks
                p_lps: list[float | None] = [None] + [token_logprob(t) for t in prompt_ids[1:]]
                out_lps = (p_lps if echo else []) + lps
                ch = {
                    "index": i,
                    "text": ("".join(prompt_toks) if echo else "") + text,
                    "finish_reason": finish,
                    "logprobs": None,
                }
                if body.get("logprobs") is not None:
                    offs, pos = [], 0
                    for t in out_toks:
                        offs.append(pos)
                        pos += len(t)
                    ch["logprobs"] = {
                        "tokens": out_toks,
                        "token_logprobs": out_lps,
                        "text_offset": offs,
                        "top_logprobs": [
                            None if lp is None else {t: lp} for t, lp in zip(out_toks, out_lps, strict=True)
                        ],
                    }
                if body.get("prompt_logprobs") is not None:
                    ch["prompt_logprobs"] = [None] + [
                        {str(t): {"logprob": token_logprob(t), "rank": 1, "decoded_token": tok}}
                        for t, tok in zip(prompt_ids[1:], prompt_toks[1:], strict=True)
                    ]
                if want_ids:
                    ch["token_ids"] = ids
                    ch["prompt_token_ids"] = prompt_ids
            choices.append(ch)
        obj = "chat.completion" if kind == "chat" else "text_completion"
        return {
            "id": f"standin-{self.calls}",
            "object": obj,
            "created": 0,
            "model": body.get("model"),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }

    @staticmethod
    def _prompt_tokens(body: dict[str, Any], kind: str) -> tuple[list[str], list[int]]:
        if kind == "chat":
            text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in body.get("messages") or [])
            toks = tokenize(text)
            return toks, [token_id(t) for t in toks]
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return [f"t{t}" for t in prompt], [int(t) for t in prompt]
        toks = tokenize(prompt if isinstance(prompt, str) else "".join(prompt))
        return toks, [token_id(t) for t in toks]
