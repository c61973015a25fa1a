"""C3 (spec 5): confidence-guided credit correction, a refiner after any estimator.

For a token t inside a detected span S with A_t > 0:  A'_t = A_t * (1 - lambda * s_S * c_S), where s_S is
the span's severity and c_S the behaviour policy's confidence in the span (geometric-mean token probability,
exp(mean old_logprob)); overlapping spans take the largest s*c per token. Every other token keeps its exact
value; nothing is re-normalised; PPO returns pass through untouched."""

from __future__ import annotations

from typing import Literal

import numpy as np
import polars as pl
from pydantic import Field

import pipeline.detect  # noqa: F401  (registers the "detect" settings the spans come from)
from pipeline.config import StageSettings, register_settings
from pipeline.credit.context import CreditContext, CreditResult
from pipeline.credit.registry import refiner


@register_settings("c3")
class C3Settings(StageSettings):
    lam: float = Field(1.0, ge=0.0, le=1.0, description="correction strength lambda in [0,1]")
    confidence: Literal["geometric", "arithmetic"] = Field(
        "geometric", description="span confidence: exp(mean logprob) (geometric) or mean exp(logprob) (arithmetic)"
    )
    missing_confidence: float = Field(
        1.0, ge=0.0, le=1.0, description="confidence of a span with a missing behaviour logprob (counted in notes)"
    )


def span_token_ranges(ctx: CreditContext, spans: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat token range [lo, hi) of each span in the context, and its step row (-1: step not in batch)."""
    keyed = ctx.steps.select("traj_id", "step_idx", "tok_start", "n_tokens").with_row_index("step_row")
    joined = spans.select(
        pl.col("traj_id").cast(pl.String), pl.col("step_idx").cast(ctx.steps.schema["step_idx"]),
        "token_start", "token_end",
    ).join(keyed, on=["traj_id", "step_idx"], how="left", maintain_order="left")
    row = joined["step_row"].fill_null(-1).to_numpy().astype(np.int64)
    start = joined["tok_start"].fill_null(0).to_numpy().astype(np.int64)
    n = joined["n_tokens"].fill_null(0).to_numpy().astype(np.int64)
    lo = start + np.clip(joined["token_start"].to_numpy().astype(np.int64), 0, n)
    hi = start + np.clip(joined["token_end"].to_numpy().astype(np.int64), 0, n)
    hi = np.maximum(hi, lo)
    return lo, hi, row


def span_confidence(logprob: np.ndarray, lo: np.ndarray, hi: np.ndarray, mode: str, missing: float):
    """Per-span confidence from the flat behaviour logprobs (prefix sums); spans with a NaN logprob (or no
    tokens) get `missing`. Returns (confidence, missing mask)."""
    nan = np.isnan(logprob)
    zero = logprob == -np.inf  # probability 0: the geometric mean is 0
    vals = np.where(nan | zero, 0.0, np.exp(logprob) if mode == "arithmetic" else logprob)
    csum = np.concatenate([[0.0], np.cumsum(vals)])
    cnan = np.concatenate([[0], np.cumsum(nan, dtype=np.int64)])
    czero = np.concatenate([[0], np.cumsum(zero, dtype=np.int64)])
    length = hi - lo
    miss = ((cnan[hi] - cnan[lo]) > 0) | (length == 0)
    mean = np.divide(csum[hi] - csum[lo], length, out=np.zeros(len(lo)), where=length > 0)
    conf = mean if mode == "arithmetic" else np.exp(mean)
    if zero.any() and mode == "geometric":
        conf = np.where((czero[hi] - czero[lo]) > 0, 0.0, conf)
    return np.where(miss, missing, np.clip(conf, 0.0, 1.0)), miss


def token_strength(n_tokens: int, lo: np.ndarray, hi: np.ndarray, strength: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token max of lambda*s*c over the spans covering it, and the in-span mask."""
    length = hi - lo
    keep = length > 0
    lo, length, strength = lo[keep], length[keep], strength[keep]
    total = int(length.sum())
    out = np.zeros(n_tokens, dtype=np.float64)
    inside = np.zeros(n_tokens, dtype=bool)
    if total == 0:
        return out, inside
    # expand span ranges to token indices: lo repeated, plus the position within the span
    starts = np.repeat(lo, length)
    local = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
    idx = starts + local
    np.maximum.at(out, idx, np.repeat(strength, length))
    inside[idx] = True
    return out, inside


@refiner("c3", settings="c3", needs=("spans",))
def c3(ctx: CreditContext, base: CreditResult, settings: C3Settings) -> CreditResult:
    """Scale positive advantages inside detected spans by 1 - lambda*severity*confidence (max over overlaps)."""
    settings = settings or C3Settings()
    spans = ctx.annotation("spans")
    adv = np.asarray(base.token_adv, dtype=np.float64)
    nan_steps = np.full(ctx.n_steps, np.nan)
    if spans is None or spans.height == 0:
        comps = {"severity": nan_steps, "confidence": nan_steps.copy(), "factor": nan_steps.copy()}
        return CreditResult(adv, {**base.components, **comps}, base.token_returns, {**base.notes, "c3.spans": 0.0})
    lo, hi, row = span_token_ranges(ctx, spans)
    found = row >= 0
    lo, hi, row = lo[found], hi[found], row[found]
    severity = spans["severity"].to_numpy().astype(np.float64)[found]
    conf, miss = span_confidence(ctx.tok_logprob, lo, hi, settings.confidence, settings.missing_confidence)
    strength = np.clip(settings.lam * severity * conf, 0.0, 1.0)
    tok_g, inside = token_strength(ctx.n_tokens, lo, hi, strength)
    change = inside & (adv > 0) & (tok_g > 0)
    new_adv = adv.copy()
    new_adv[change] = adv[change] * (1.0 - tok_g[change])
    # per-step components: max over the step's spans
    comp_s = np.full(ctx.n_steps, -np.inf)
    comp_c = np.full(ctx.n_steps, -np.inf)
    comp_g = np.full(ctx.n_steps, -np.inf)
    np.maximum.at(comp_s, row, severity)
    np.maximum.at(comp_c, row, conf)
    np.maximum.at(comp_g, row, strength)
    has = np.isfinite(comp_s)
    comps = {
        "severity": np.where(has, comp_s, np.nan),
        "confidence": np.where(has, comp_c, np.nan),
        "factor": np.where(has, 1.0 - comp_g, np.nan),
    }
    notes = {
        **base.notes,
        "c3.spans": float(len(lo)),
        "c3.tokens_changed": float(change.sum()),
        "c3.missing_confidence_spans": float(miss.sum()),
    }
    if (~found).any():
        notes["c3.spans_without_step"] = float((~found).sum())
    return CreditResult(new_adv, {**base.components, **comps}, base.token_returns, notes)
