"""Whole-column group statistics used by the estimators (NumPy bincount passes, no Python loops)."""

from __future__ import annotations

import numpy as np


def group_mean_std(values: np.ndarray, groups: np.ndarray, n_groups: int | None = None, ddof: int = 1):
    """Per-element group mean, group std (ddof) and group size. Std of a size<=ddof group is NaN."""
    values = np.asarray(values, dtype=np.float64)
    n_groups = int(groups.max()) + 1 if n_groups is None and len(groups) else (n_groups or 0)
    count = np.bincount(groups, minlength=n_groups).astype(np.float64)
    total = np.bincount(groups, weights=values, minlength=n_groups).astype(np.float64)  # (empty: int64)
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    dev = values - mean[groups]
    ss = np.bincount(groups, weights=dev * dev, minlength=n_groups).astype(np.float64)
    denom = count - ddof
    var = np.divide(ss, denom, out=np.full_like(ss, np.nan), where=denom > 0)
    return mean[groups], np.sqrt(var)[groups], count[groups]


def group_normalize(
    values: np.ndarray,
    groups: np.ndarray,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    singleton: str = "verl",
) -> np.ndarray:
    """(x - mean_g) / (std_g + eps) with unbiased std (GRPO / verl).

    A group of size 1 follows verl (mean 0, std 1, so A = x) when `singleton="verl"`, or gives 0 when
    `singleton="zero"`."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return values.copy()
    mean, std, count = group_mean_std(values, groups)
    single = count < 2
    if singleton == "verl":
        mean = np.where(single, 0.0, mean)
        std = np.where(single, 1.0, std)
    else:
        mean = np.where(single, values, mean)
        std = np.where(single, 1.0, std)
    if norm_by_std:
        return (values - mean) / (std + eps)
    return values - mean


def segment_sum(values: np.ndarray, segments: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(segments, weights=np.asarray(values, dtype=np.float64), minlength=n)


def segment_max(values: np.ndarray, segments: np.ndarray, n: int, initial: float = -np.inf) -> np.ndarray:
    out = np.full(n, initial, dtype=np.float64)
    np.maximum.at(out, segments, values)
    return out


def masked_whiten(values: np.ndarray, mask: np.ndarray, shift_mean: bool = True) -> np.ndarray:
    """verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8) over masked entries, Bessel-corrected var."""
    values = np.asarray(values, dtype=np.float64)
    m = mask.astype(bool)
    n = int(m.sum())
    if n == 0:
        return values.copy()
    mean = values[m].mean()
    var = ((values[m] - mean) ** 2).sum() / max(n - 1, 1) if n > 1 else 0.0
    out = (values - mean) / np.sqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out


def whiten(values: np.ndarray) -> np.ndarray:
    """masked_whiten over every entry (no mask to apply): (x - mean) * rsqrt(var + 1e-8), Bessel-corrected var."""
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    if n == 0:
        return values.copy()
    dev = values - values.mean()
    var = float(np.dot(dev, dev)) / (n - 1) if n > 1 else 0.0
    dev /= np.sqrt(var + 1e-8)
    return dev


def segment_discounted_cumsum(values: np.ndarray, segments: np.ndarray, discount: float) -> np.ndarray:
    """y_t = sum_{s >= t in t's segment} discount^(s - t) x_s, for contiguous segments (e.g. the assistant
    tokens of one trajectory, in order). A log-step (Hillis-Steele) scan: ceil(log2(longest segment))
    whole-array passes, no loop over positions, and every step adds only two terms (no cancellation)."""
    y = np.asarray(values, dtype=np.float64).copy()
    n = len(y)
    if n == 0:
        return y
    segments = np.asarray(segments)
    bounds = np.concatenate([[0], np.flatnonzero(segments[1:] != segments[:-1]) + 1, [n]])
    lengths = np.diff(bounds)
    longest = int(lengths.max())
    if float(discount) == 1.0 and len(lengths) * longest <= 4 * n:
        # undiscounted: y_t = x_t + y_{t+1}, a reverse running sum per segment. One row per segment (zero
        # padded), np.cumsum along the reversed rows: the same sequential additions as the recursion, in one pass
        rows = np.zeros((len(lengths), longest))
        real = np.arange(longest)[None, :] < lengths[:, None]
        rows[real] = y  # segments are contiguous: row-major order of the real cells is the flat order
        return np.cumsum(rows[:, ::-1], axis=1)[:, ::-1][real]
    remaining = np.repeat(bounds[1:], lengths) - np.arange(n)  # positions left in the segment, incl. self
    coef, d = float(discount), 1
    while d < longest:
        # y[:-d] += where(remaining > d, y[d:], 0) * coef, adding only where the term is in the segment (the
        # other positions keep their value; the ufunc buffers the overlapping y[d:] as if copied first)
        term = y[d:] if coef == 1.0 else y[d:] * coef
        np.add(y[:-d], term, out=y[:-d], where=remaining[:-d] > d)
        coef, d = coef * coef, d * 2
    return y
