"""llm_calls: one row per request made by the shared LLM client (trainer/llm/client.py): where it went,
how long it took, what it cost in tokens, whether the cache answered it, and how it failed."""

import pyarrow as pa

import schemas
from schemas._base import TableSpec, check_in

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("call_id", pa.string(), nullable=False),
        pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("purpose", pa.string()),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("endpoint", pa.string()),
        pa.field("model", pa.string()),
        pa.field("request_hash", pa.string(), nullable=False),
        pa.field("latency_s", pa.float64(), nullable=False),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("completion_tokens", pa.int64()),
        pa.field("n", pa.int32(), nullable=False),
        pa.field("cached", pa.bool_(), nullable=False),
        pa.field("attempts", pa.int32(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("structured", pa.string()),
    ]
)

DOCS = {
    "round": "round partition key",
    "call_id": "unique id of the call",
    "ts": "when the call finished (UTC)",
    "purpose": "tag given by the caller (iapo, tcpo, rescore, ...)",
    "kind": "chat | complete",
    "endpoint": "base URL that answered (or last tried, on error); for a cache hit, the original one",
    "model": "served model name",
    "request_hash": "cache key: sha256 of model, request content, sampling params, seed, response format",
    "latency_s": "seconds from the call to the answer: wait for a concurrency slot, retries and backoff included (cache hit: lookup time)",
    "prompt_tokens": "prompt tokens reported by the server (null on error)",
    "completion_tokens": "completion tokens reported by the server, all n choices (null on error)",
    "n": "choices asked for",
    "cached": "answered from the on-disk cache (or by an identical request in flight)",
    "attempts": "HTTP requests sent (0 for a cache hit)",
    "error": "LLMError text when the call failed for good, else null",
    "structured": "json_schema (server-constrained) | prompted (plain text + validation) | null",
}

SPEC = schemas.register_table(
    TableSpec("llm_calls", SCHEMA, DOCS, checks=(check_in("llm_calls", "kind", {"chat", "complete"}),))
)


def records_to_table(records: list[dict], round_: int = 0) -> pa.Table:
    """Rows (dicts with the schema's fields; `ts` in epoch seconds) -> a validated llm_calls table."""
    cols = {f.name: [r.get(f.name) for r in records] for f in SCHEMA if f.name not in ("round", "ts")}
    arrays = {
        "round": pa.array([round_] * len(records), pa.int32()),
        "ts": pa.array([int(float(r["ts"]) * 1e6) for r in records], pa.int64()).cast(
            pa.timestamp("us", tz="UTC")
        ),
    }
    arrays.update({name: pa.array(vals, SCHEMA.field(name).type) for name, vals in cols.items()})
    return SPEC.validate(pa.table({f.name: arrays[f.name] for f in SCHEMA}))
