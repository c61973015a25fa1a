"""C3 (spec 5): confidence-guided credit correction, a refiner after any estimator.

    (1) c_S  = exp((1/|S|) sum_{t in S} old_logprob_t)      (geometric; `confidence="arithmetic"`: mean of p)
    (2) g_t  = max over the spans S that hold t of lambda * s_S * c_S    (overlaps take the largest)
    (3) A'_t = A_t * (1 - g_t)  for A_t > 0,   A'_t = A_t  otherwise
s_S is the span's severity, c_S the behaviour policy's confidence in the span. Every other token keeps its
exact value; nothing is re-normalised; PPO returns pass through untouched."""

from __future__ import annotations

from typing import Literal

import numpy as np
import polars as pl
from pydantic import Field

import pipeline.detect  # noqa: F401  (registers the "detect" settings the spans come from)
from pipeline.credit.batch import CreditBatch
from pipeline.credit.registry import refiner
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings


@register_settings("c3")
class C3Settings(StageSettings):
    lam: float = Field(1.0, ge=0.0, le=1.0, description="correction strength lambda in [0,1]")
    confidence: Literal["geometric", "arithmetic"] = Field(
        "geometric",
        description="span confidence: exp(mean logprob) (geometric) or mean exp(logprob) (arithmetic)",
    )
    missing_confidence: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="confidence of a span with a missing behaviour logprob (counted in notes)",
    )


def span_token_ranges(batch: CreditBatch, spans: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat token range [lo, hi) of each span in the batch, and its step row (-1: step not in batch)."""
    keyed = batch.steps.select("traj_id", "step_idx", "tok_start", "n_tokens").with_row_index("step_row")
    joined = spans.select(
        pl.col("traj_id").cast(pl.String),
        pl.col("step_idx").cast(batch.steps.schema["step_idx"]),
        "token_start",
        "token_end",
    ).join(keyed, on=["traj_id", "step_idx"], how="left", maintain_order="left")
    row = joined["step_row"].fill_null(-1).to_numpy().astype(np.int64)
    start = joined["tok_start"].fill_null(0).to_numpy().astype(np.int64)
    n = joined["n_tokens"].fill_null(0).to_numpy().astype(np.int64)
    lo = start + np.clip(joined["token_start"].to_numpy().astype(np.int64), 0, n)
    hi = start + np.clip(joined["token_end"].to_numpy().astype(np.int64), 0, n)
    hi = np.maximum(hi, lo)
    return lo, hi, row


def expand_ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat token indices of all ranges [lo, hi) laid end to end, and the range each index belongs to."""
    length = np.maximum(hi - lo, 0)
    total = int(length.sum())
    owner = np.repeat(np.arange(len(lo), dtype=np.int64), length)
    local = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
    return lo[owner] + local, owner


def span_confidence(
    logprob: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    mode: str,
    missing: float,
    idx: np.ndarray | None = None,
    owner: np.ndarray | None = None,
):
    """Per-span confidence from the behaviour logprobs of the span's tokens only (O(span tokens)); spans with
    a NaN logprob (or no tokens) get `missing`. Returns (confidence, missing mask)."""
    if idx is None or owner is None:
        idx, owner = expand_ranges(lo, hi)
    n = len(lo)
    lp = logprob[idx]
    nan = np.isnan(lp)
    zero = lp == -np.inf  # probability 0: the geometric mean is 0
    vals = np.where(nan | zero, 0.0, np.exp(lp) if mode == "arithmetic" else lp)
    total = np.bincount(owner, weights=vals, minlength=n)
    n_nan = np.bincount(owner, weights=nan, minlength=n)
    length = hi - lo
    miss = (n_nan > 0) | (length <= 0)
    mean = np.divide(total, length, out=np.zeros(n), where=length > 0)
    conf = mean if mode == "arithmetic" else np.exp(mean)  # Eq. 1
    if mode == "geometric" and zero.any():
        conf = np.where(np.bincount(owner, weights=zero, minlength=n) > 0, 0.0, conf)
    return np.where(miss, missing, np.clip(conf, 0.0, 1.0)), miss


@refiner(
    "c3",
    settings="c3",
    needs=("spans",),
    step_columns=("logprobs",),
    components=("severity", "confidence", "factor"),
)
def c3(batch: CreditBatch, base: CreditResult, settings: C3Settings) -> CreditResult:
    """Scale positive advantages inside detected spans by 1 - lambda*severity*confidence (max over overlaps)."""
    settings = settings or C3Settings()
    spans = batch.annotation("spans")
    adv = np.asarray(base.adv_per_token(), dtype=np.float64)
    nan_steps = np.full(batch.n_steps, np.nan)
    if spans is None or spans.height == 0:
        comps = {"severity": nan_steps, "confidence": nan_steps.copy(), "factor": nan_steps.copy()}
        return base.refined(adv, {**base.components, **comps}, {**base.notes, "c3.spans": 0.0})
    lo, hi, row = span_token_ranges(batch, spans)
    found = row >= 0
    lo, hi, row = lo[found], hi[found], row[found]
    severity = spans["severity"].to_numpy().astype(np.float64)[found]
    idx, owner = expand_ranges(lo, hi)
    # the logprobs of the span tokens only (the batch's per-token logprob array is not built for them)
    conf, miss = span_confidence(
        batch.logprobs.at(idx),
        lo,
        hi,
        settings.confidence,
        settings.missing_confidence,
        np.arange(len(idx)),
        owner,
    )
    strength = np.clip(settings.lam * severity * conf, 0.0, 1.0)
    # per-token max of lambda*s*c over overlapping spans, touching span tokens only
    tok_g = np.zeros(batch.n_tokens)
    np.maximum.at(tok_g, idx, strength[owner])  # Eq. 2
    a_in = adv[idx]
    g_in = tok_g[idx]
    hit = (a_in > 0) & (g_in > 0)
    new_adv = adv.copy()
    new_adv[idx[hit]] = a_in[hit] * (1.0 - g_in[hit])  # Eq. 3
    marked = np.zeros(batch.n_tokens, dtype=bool)
    marked[idx[hit]] = True
    n_changed = int(np.count_nonzero(marked))
    # per-step components: max over the step's spans
    comp_s = np.full(batch.n_steps, -np.inf)
    comp_c = np.full(batch.n_steps, -np.inf)
    comp_g = np.full(batch.n_steps, -np.inf)
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
        "c3.tokens_changed": float(n_changed),
        "c3.missing_confidence_spans": float(miss.sum()),
    }
    if (~found).any():
        notes["c3.spans_without_step"] = float((~found).sum())
    return base.refined(new_adv, {**base.components, **comps}, notes)
