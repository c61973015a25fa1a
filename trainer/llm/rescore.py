"""Rescoring: fill missing behaviour logprobs of assistant steps by scoring the recorded tokens with a served
model (prompt logprobs of a /v1/completions request with `echo=True, logprobs=0, max_tokens=1`).

A trajectory is rendered as the model saw it, ChatML (`<|im_start|>{role}\\n{content}<|im_end|>\\n` per
step, SmolLM2's chat template), and scored in ONE request: a causal model's prompt logprob at position t
is log p(x_t | x_<t), so the slice of an assistant step's tokens is exactly its behaviour logprobs.
Trajectories longer than `max_context` are scored one assistant step per request with the context
truncated on the left.

Two alignment modes:
- "ids": the steps' `token_ids` come from the served model's tokenizer (the default SmolLM2 tokenizer
  and the default served SmolLM2 share it): the prompt is sent as token ids (template tokens encoded with
  the same tokenizer), so every logprob is for exactly the recorded token.
- "text": the steps were tokenised by another tokenizer (e.g. the byte fallback): the rendered text is
  sent and the server re-tokenises it; each recorded token gets the SUM of the logprobs of the server
  tokens that start inside its character span (`token_offsets`), using the server's `text_offset`.
  A server token that spans several recorded tokens is credited to the one it starts in, so per token
  these are an approximation; per step the sum equals the server's logprob of the step's text (as long
  as the step boundaries are server token boundaries, which the template's special tokens ensure).
"auto" picks "text" for the byte tokenizer and "ids" otherwise.

`logprob_source` of a rescored step becomes `rescore:<model>`. Pure: takes a steps table and a client,
returns a new table; no file I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from pipeline.config import StageSettings, register_settings


@register_settings("rescore")
class RescoreSettings(StageSettings):
    mode: str = Field("auto", description="auto | ids | text (see trainer/llm/rescore.py)")
    max_context: int = Field(
        2000, ge=16, description="tokens per scoring request (server max-model-len minus 1+)"
    )
    purpose: str = Field("rescore", description="purpose tag of the llm_calls records")


def _header(role: str) -> str:
    return f"<|im_start|>{role}\n"


_FOOTER = "<|im_end|>\n"


@dataclass
class _Job:
    rows: list[int]  # assistant step rows scored by this request
    prompt: Any  # list[int] (ids) or str (text)
    # ids mode: (row, start, length) positions in the prompt; text mode: (row, char_start, offsets)
    spans: list[tuple[int, int, Any]]


def _encode(tokenizer, text: str) -> list[int]:
    ids, _ = tokenizer.encode_batch([text])
    return list(ids[0])


def rescore_steps(
    steps: pa.Table,
    client,
    *,
    tokenizer: str | None = None,
    force: bool = False,
    settings: RescoreSettings | None = None,
) -> tuple[pa.Table, dict[str, int]]:
    """-> (steps with logprobs filled for assistant steps that lacked them, counts)."""
    from warehouse.tokenizers import get_tokenizer

    settings = settings or RescoreSettings()
    tok = get_tokenizer(tokenizer)
    mode = settings.mode
    if mode == "auto":
        mode = "text" if tok.name == "bytes" else "ids"
    stats = {
        "steps": steps.num_rows,
        "rescored": 0,
        "failed": 0,
        "retokenized": int(mode == "text"),
        "too_long": 0,
    }
    if steps.num_rows == 0:
        return steps, stats
    need = np.asarray(pc.equal(steps.column("role"), "assistant").to_numpy(zero_copy_only=False), dtype=bool)
    if not force:
        need &= np.asarray(pc.is_null(steps.column("logprobs")).to_numpy(zero_copy_only=False), dtype=bool)
    if not need.any():
        return steps, stats

    content = steps.column("content").to_pylist()
    token_ids = steps.column("token_ids").to_pylist()
    offsets = steps.column("token_offsets").to_pylist()
    jobs = _jobs(steps, need, tok, mode, settings, stats, content, token_ids)

    from pipeline.llm.types import LLMError, LLMRequest

    reqs = [
        LLMRequest.complete(
            j.prompt, echo=True, logprobs=0, max_tokens=1, temperature=0.0, purpose=settings.purpose
        )
        for j in jobs
    ]
    results = client.run_batch(reqs)
    new_lp: dict[int, list[float]] = {}
    model = None
    for job, res in zip(jobs, results, strict=True):
        if isinstance(res, LLMError):
            stats["failed"] += len(job.rows)
            continue
        model = res.model or model
        got = _job_logprobs(job, res, mode, content, offsets)
        if got is None:
            stats["failed"] += len(job.rows)
            continue
        new_lp.update(got)
    if not new_lp:
        return steps, stats
    source = f"rescore:{model or client.settings.model or 'unknown'}"
    return _with_logprobs(steps, new_lp, token_ids, source, stats), stats


def _jobs(
    steps: pa.Table,
    need: np.ndarray,
    tok,
    mode: str,
    settings: RescoreSettings,
    stats: dict,
    content,
    token_ids,
) -> list[_Job]:
    """The requests of the trajectories with a step to rescore: one per trajectory (its steps in order), or,
    where token ids exceed `max_context`, one per assistant step with its context cut on the left (a step
    that alone does not fit is counted too long)."""
    role = steps.column("role").to_pylist()
    traj = steps.column("traj_id").to_pylist()
    order = np.lexsort((steps.column("step_idx").to_numpy(), np.asarray(traj, dtype=object).astype(str)))
    header_cache: dict[str, list[int]] = {}

    def hdr_ids(r: str) -> list[int]:
        if r not in header_cache:
            header_cache[r] = _encode(tok, _header(r))
        return header_cache[r]

    footer_ids = _encode(tok, _FOOTER) if mode == "ids" else []

    # group rows by trajectory, in step order
    groups: dict[str, list[int]] = {}
    for i in order:
        groups.setdefault(traj[i], []).append(int(i))

    jobs: list[_Job] = []
    for rows in groups.values():
        if not any(need[r] for r in rows):
            continue
        pieces: list[tuple[Any, Any, Any]] = []  # per row: (prefix tokens/text, body, suffix)
        for r in rows:
            if mode == "ids":
                pieces.append((hdr_ids(role[r]), list(token_ids[r]), footer_ids))
            else:
                pieces.append((_header(role[r]), content[r], _FOOTER))
        total = sum(len(a) + len(b) + len(c) for a, b, c in pieces) if mode == "ids" else None
        if mode == "text" or (total is not None and total <= settings.max_context):
            whole = _build_job(rows, pieces, need, mode, upto=None)
            assert whole is not None  # None only when cut to a max_context, not given here
            jobs.append(whole)
        else:  # one request per assistant step, context truncated on the left
            for k, r in enumerate(rows):
                if need[r]:
                    job = _build_job(
                        rows[: k + 1], pieces[: k + 1], need, mode, upto=r, max_context=settings.max_context
                    )
                    if job is None:
                        stats["too_long"] += 1
                        stats["failed"] += 1
                    else:
                        jobs.append(job)
    return jobs


def _job_logprobs(job: _Job, res, mode: str, content, offsets) -> dict[int, list[float]] | None:
    """The logprobs of a job's rescored steps from its echoed completion (ids: the prompt's token logprobs;
    text: the server's tokens summed over each step's token spans); None: the answer cannot give them."""
    ch = res.choices[0]
    out: dict[int, list[float]] = {}
    if mode == "ids":
        n_prompt = len(job.prompt)
        plp = res.prompt_logprobs if res.prompt_logprobs is not None else (ch.token_logprobs or [])[:n_prompt]
        if len(plp) < n_prompt:
            return None
        for r, start, length in job.spans:
            vals = plp[start : start + length]
            out[r] = [float("nan") if v is None else float(v) for v in vals]
        return out
    toks_lp = ch.token_logprobs or []
    text_off = _text_offsets(ch)
    if text_off is None:
        return None
    n_prompt = len(job.prompt)
    lp_arr = np.array([np.nan if v is None else v for v in toks_lp], dtype=np.float64)
    off_arr = np.asarray(text_off, dtype=np.int64)
    keep = off_arr < n_prompt
    lp_arr, off_arr = lp_arr[keep], off_arr[keep]
    for r, char_start, _ in job.spans:
        out[r] = _sum_by_span(lp_arr, off_arr, char_start, list(offsets[r]), len(content[r]))
    return out


def _with_logprobs(
    steps: pa.Table, new_lp: dict[int, list[float]], token_ids, source: str, stats: dict
) -> pa.Table:
    """`steps` with the rescored rows' logprobs and logprob_source set (a row whose count of logprobs is not
    its count of tokens is counted failed and left as it was)."""
    lp_list = steps.column("logprobs").to_pylist()
    src_list = steps.column("logprob_source").to_pylist()
    for r, vals in new_lp.items():
        if len(vals) != len(token_ids[r]):
            stats["failed"] += 1
            continue
        lp_list[r] = vals
        src_list[r] = source
        stats["rescored"] += 1
    out = steps.set_column(
        steps.schema.get_field_index("logprobs"),
        steps.schema.field("logprobs"),
        pa.array(lp_list, steps.schema.field("logprobs").type),
    )
    return out.set_column(
        out.schema.get_field_index("logprob_source"),
        out.schema.field("logprob_source"),
        pa.array(src_list, out.schema.field("logprob_source").type),
    )


def _build_job(rows, pieces, need, mode, upto, max_context: int | None = None) -> _Job | None:
    """Concatenate the pieces; spans for the rows to score (all needing rows, or just `upto`)."""
    if mode == "ids":
        prompt: list[int] = []
        spans: list[tuple[int, int, Any]] = []
        for r, (pre, body, post) in zip(rows, pieces, strict=True):
            prompt += pre
            if need[r] and (upto is None or r == upto):
                spans.append((r, len(prompt), len(body)))
            prompt += body
            if upto is None or r != upto:
                prompt += post
        if max_context is not None and len(prompt) > max_context:
            cut = len(prompt) - max_context
            if spans[0][1] < cut + 1:  # the step itself does not fit (its first token needs a context)
                return None
            prompt = prompt[cut:]
            spans = [(r, s - cut, n) for r, s, n in spans]
        return _Job([s[0] for s in spans], prompt, spans)
    text = ""
    spans = []
    for r, (pre, body, post) in zip(rows, pieces, strict=True):
        text += pre
        if need[r]:
            spans.append((r, len(text), None))
        text += body + post
    return _Job([s[0] for s in spans], text, spans)


def _text_offsets(choice) -> list[int] | None:
    """Char offsets of the echoed tokens: from the tokens' text (robust to servers without text_offset)."""
    if choice.tokens is None:
        return None
    out, pos = [], 0
    for t in choice.tokens:
        out.append(pos)
        pos += len(t)
    return out


def _sum_by_span(
    lp: np.ndarray, off: np.ndarray, char_start: int, offs: list[int], n_chars: int
) -> list[float]:
    """Per recorded token: the sum of server-token logprobs whose start char falls in its char span."""
    if not offs:
        return []
    bounds = np.asarray(offs + [n_chars], dtype=np.int64) + char_start
    idx = np.searchsorted(bounds, off, side="right") - 1  # recorded token each server token starts in
    valid = (idx >= 0) & (idx < len(offs)) & ~np.isnan(lp)
    sums = np.bincount(idx[valid], weights=lp[valid], minlength=len(offs))[: len(offs)]
    return [float(v) for v in sums]
