"""The LLM requests and results the pipeline's stages build and parse (pure data: no network).

A stage that needs a model builds `LLMRequest`s and reads `ChatResult`s / `LLMError`s; the client that sends
them over HTTP lives on the trainer floor (`trainer.llm.client.LLMClient`) and is handed to the stage by the
flow that runs it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.config import StageSettings, register_settings

# ---------------------------------------------------------------------------------------------------------
# settings


@register_settings("llm")
class LLMSettings(StageSettings):
    """Settings of the shared LLM client (the config's `llm:` mapping; `--set llm.key=value`)."""

    endpoints: list[str] = Field(
        default_factory=list,
        description="OpenAI-compatible base URLs (…/v1), used round-robin; empty: the endpoint recorded by "
        "`creditflow llm serve`, else http://127.0.0.1:8000/v1",
    )
    model: str | None = Field(None, description="served model name; None: the first model the endpoint lists")
    api_key: str = Field("EMPTY", description="API key sent to the endpoints (vLLM ignores it by default)")
    concurrency: int = Field(16, ge=1, description="requests in flight at once (per event loop)")
    timeout_s: float = Field(
        1800.0,
        gt=0,
        description="per-request timeout in seconds: a CPU server with long prompts and many requests in flight "
        "takes minutes per answer, and a timeout that gives up on a request the server still computes sends it "
        "again (the server then holds both)",
    )
    max_retries: int = Field(3, ge=0, description="retries after a timeout / 5xx / 429 / malformed body")
    backoff_s: float = Field(0.5, ge=0, description="first retry delay; doubles with every retry")
    backoff_max_s: float = Field(30.0, ge=0, description="cap on one retry delay")
    cache: bool = Field(True, description="use the on-disk response cache (diskcache)")
    cache_size_limit: int = Field(
        2**30,
        ge=2**20,
        description="bytes the response cache may hold before it evicts the least recently used",
    )
    cache_dir: str | None = Field(
        None,
        description="response cache folder; None: $CREDITFLOW_CACHE/llm (~/.cache/creditflow/llm); a relative "
        "path is relative to the lake",
    )
    structured_output: Literal["auto", "json_schema", "off"] = Field(
        "auto",
        description="auto: JSON-schema constrained decoding, falling back to plain text + validation when the "
        "server rejects it; json_schema: always constrained; off: plain text + validation",
    )
    vllm_extras: bool = Field(True, description="ask vLLM for token ids (return_token_ids) in responses")
    count_tokens: bool = Field(
        True,
        description="count each request's prompt tokens before sending it (the server's own tokenizer and "
        "chat template: vLLM's /tokenize); one whose prompt + max_tokens exceeds the context is not sent "
        "but answered with a too_long error (an endpoint without /tokenize is not checked)",
    )
    context_tokens: int | None = Field(
        None, ge=16, description="the endpoints' context in tokens; None: what the server reports"
    )
    heal: bool = Field(
        True,
        description="restart the managed vLLM server (`creditflow llm serve`) when requests find it dead or "
        "unhealthy, then send the failed requests again",
    )
    max_restarts: int = Field(2, ge=0, description="restarts of the managed server per run (heal)")

    @classmethod
    def from_config(cls, cfg: Any = None, **overrides: Any) -> LLMSettings:
        """Settings from a `Config`: `cfg.llm`, then `cfg.stages["llm"]`, then keyword overrides."""
        data: dict[str, Any] = {}
        lake = None
        if cfg is not None:
            data.update(dict(getattr(cfg, "llm", None) or {}))
            data.update(dict((getattr(cfg, "stages", None) or {}).get("llm", {}) or {}))
            lake = getattr(cfg, "lake", None)
        data.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(data.get("endpoints"), str):
            data["endpoints"] = [e.strip() for e in data["endpoints"].split(",") if e.strip()]
        cd = data.get("cache_dir")
        if cd and lake and not Path(str(cd)).expanduser().is_absolute() and "://" not in str(lake):
            data["cache_dir"] = str(Path(str(lake)).expanduser() / str(cd))
        return cls(**data)


def default_cache_dir() -> Path:
    base = Path(os.environ.get("CREDITFLOW_CACHE", Path.home() / ".cache" / "creditflow"))
    return base / "llm"


def normalize_endpoint(url: str) -> str:
    """`host:port`, `http://host:port` or `http://host:port/v1` -> `http://host:port/v1`."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.endswith("/v1"):
        url += "/v1"
    return url


# ---------------------------------------------------------------------------------------------------------
# results


class Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str
    token_ids: list[int] | None = None
    token_logprobs: list[float | None] | None = None
    tokens: list[str] | None = None
    top_logprobs: list[dict[str, float]] | None = None
    finish_reason: str | None = None
    parsed: Any = None  # the validated JSON object when a response_format was given
    parse_error: str | None = None


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ChatResult(BaseModel):
    choices: list[Choice]
    cached: bool = False
    latency_s: float = 0.0
    endpoint: str | None = None
    model: str | None = None
    usage: Usage = Field(default_factory=Usage)
    request_hash: str = ""
    structured: str | None = None  # json_schema | prompted | None: how a response_format was honoured


class CompletionResult(ChatResult):
    """A /v1/completions result. With `echo=True` each choice's tokens/logprobs start with the prompt's;
    `prompt_*` hold the prompt part alone (from choice 0; the first prompt logprob is None)."""

    prompt_token_ids: list[int] | None = None
    prompt_tokens: list[str] | None = None
    prompt_logprobs: list[float | None] | None = None


class LLMError(Exception):
    """A request that failed for good. `kind`: timeout | connection | server | rate_limit | malformed |
    client (a 4xx other than 429) | config | too_long (not sent: `prompt_tokens` + the answer budget exceed
    the endpoint's `context`)."""

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        status: int | None = None,
        endpoint: str | None = None,
        attempts: int = 0,
        request_hash: str = "",
    ):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.status = kind, message, status
        self.endpoint, self.attempts, self.request_hash = endpoint, attempts, request_hash
        self.retry_after: float | None = None  # a 429's Retry-After, seconds (the retry waits at least this)
        self.prompt_tokens: int | None = None  # too_long: the prompt's tokens
        self.context: int | None = None  # too_long: the endpoint's context

    @property
    def retryable(self) -> bool:
        return self.kind in {"timeout", "connection", "server", "rate_limit", "malformed"}

    def __reduce__(self):  # picklable (Prefect / Ray move results between processes)
        return (
            _rebuild_error,
            (self.kind, self.message, self.status, self.endpoint, self.attempts, self.request_hash),
            {"prompt_tokens": self.prompt_tokens, "context": self.context, "retry_after": self.retry_after},
        )

    @classmethod
    def too_long(cls, prompt_tokens: int, answer_tokens: int, context: int) -> LLMError:
        err = cls(
            "too_long",
            f"prompt {prompt_tokens} tokens + answer budget {answer_tokens} > context {context}; not sent",
        )
        err.prompt_tokens, err.context = prompt_tokens, context
        return err


def _rebuild_error(kind, message, status, endpoint, attempts, request_hash):
    return LLMError(
        kind, message, status=status, endpoint=endpoint, attempts=attempts, request_hash=request_hash
    )


class CallRecord(BaseModel):
    """One request as the client saw it (a row of the lake table `llm_calls`)."""

    call_id: str
    ts: float
    purpose: str | None
    kind: str  # chat | complete
    endpoint: str | None
    model: str | None
    request_hash: str
    latency_s: float
    prompt_tokens: int | None
    completion_tokens: int | None
    n: int
    cached: bool
    attempts: int
    error: str | None
    structured: str | None


# ---------------------------------------------------------------------------------------------------------
# requests


class LLMRequest(BaseModel):
    """One request for `run_batch` / `abatch`: a chat (`messages`) or a completion (`prompt`)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    kind: Literal["chat", "complete"] = "chat"
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def chat(cls, messages: list[dict[str, Any]], **params: Any) -> LLMRequest:
        return cls(kind="chat", messages=messages, params=params)

    @classmethod
    def complete(cls, prompt: str | list[int], **params: Any) -> LLMRequest:
        return cls(kind="complete", prompt=prompt, params=params)

    @classmethod
    def coerce(cls, obj: LLMRequest | dict[str, Any]) -> LLMRequest:
        if isinstance(obj, LLMRequest):
            return obj
        d = dict(obj)
        if "prompt" in d:
            return cls.complete(d.pop("prompt"), **d)
        if "messages" in d:
            return cls.chat(d.pop("messages"), **d)
        raise ValueError("a request needs 'messages' (chat) or 'prompt' (completion)")
