"""The credit engine's statistics, one of each (whole-column NumPy passes, no Python loops):

- `segment_bounds`: the first and last row of each run of equal segment ids (a trajectory's steps, a turn's
  tokens), the one boundary idiom every method uses;
- `group_moments` / `group_normalize`: per-group mean and std and the z-score (x - mean_g) / (std_g + eps)
  (GRPO, GDPO's components, MT-GRPO, GiGPO, TCPO's per-(prompt, turn) Norm, IAPO's Eq. 4);
- `Moments` / `whiten`: batch-level whitening (verl's masked_whiten, GDPO's batch normalisation) from
  mergeable sufficient statistics, so one statistic can span a whole round processed batch by batch;
- `segment_discounted_cumsum`: the GAE / return recursions.

Means are taken shifted by a member of the set (group, batch): mean = x_ref + sum(x - x_ref) / n. A constant
set then has its mean equal to its value exactly, so it normalises and whitens to exactly 0 (spec sections 7
and 9: not the 1e-11 that summing 0.1 seven times leaves), and the shift also keeps the sums small."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def segment_bounds(segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, last): bool masks of the first and the last row of each run of equal, contiguous segment ids."""
    segments = np.asarray(segments)
    n = len(segments)
    first = np.ones(n, dtype=bool)
    last = np.ones(n, dtype=bool)
    if n > 1:
        change = segments[1:] != segments[:-1]
        first[1:] = change
        last[:-1] = change
    return first, last


def segment_start_rows(segments: np.ndarray) -> np.ndarray:
    """Per row: the index of the first row of its run (of equal, contiguous segment ids)."""
    first, _ = segment_bounds(segments)
    return (
        np.maximum.accumulate(np.where(first, np.arange(len(first)), 0)) if len(first) else first.astype(int)
    )


def _group_ref(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    """One member's value per group (any member: every member of a constant group is the same value)."""
    ref = np.zeros(n_groups, dtype=np.float64)
    ref[groups] = values
    return ref


def group_moments(
    values: np.ndarray,
    groups: np.ndarray,
    n_groups: int | None = None,
    weights: np.ndarray | None = None,
    ddof: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per element: its group's (weighted) mean, std and size (sum of weights).

    var_g = sum_g w (x - mean_g)^2 / (size_g - ddof); NaN where size_g <= ddof. A constant group has
    mean == its value exactly (shifted mean), so x - mean is exactly 0 there."""
    values = np.asarray(values, dtype=np.float64)
    groups = np.asarray(groups, dtype=np.int64)
    if n_groups is None:
        n_groups = int(groups.max()) + 1 if len(groups) else 0
    w = None if weights is None else np.asarray(weights, dtype=np.float64)
    count = np.bincount(groups, weights=w, minlength=n_groups).astype(np.float64)
    ref = _group_ref(values, groups, n_groups)
    shifted = values - ref[groups]
    total = np.bincount(groups, weights=shifted if w is None else w * shifted, minlength=n_groups)
    mean = ref + np.divide(total, count, out=np.zeros(n_groups), where=count > 0)
    dev = values - mean[groups]
    ss = np.bincount(groups, weights=dev * dev if w is None else w * dev * dev, minlength=n_groups)
    denom = count - ddof
    var = np.divide(ss, denom, out=np.full(n_groups, np.nan), where=denom > 0)
    return mean[groups], np.sqrt(var)[groups], count[groups]


def group_normalize(
    values: np.ndarray,
    groups: np.ndarray,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    singleton: str = "verl",
    weights: np.ndarray | None = None,
    ddof: int = 1,
) -> np.ndarray:
    """(x - mean_g) / (std_g + eps), std unbiased by default (GRPO / verl); `norm_by_std=False`: x - mean_g.

    A group of fewer than 2 members: `singleton="verl"` uses mean 0, std 1 (A = x / (1 + eps), verl's GRPO),
    `"zero"` gives 0, `"keep"` leaves x unchanged (TCPO's Norm is skipped). A constant group gives exactly 0.
    `weights` (and `ddof=0`) make it IAPO's length-weighted z-score with population variance."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return values.copy()
    groups = np.asarray(groups, dtype=np.int64)
    mean, std, _ = group_moments(values, groups, weights=weights, ddof=ddof)
    members = np.bincount(groups)[groups]
    dev = values - mean
    out = dev / (np.nan_to_num(std) + eps) if norm_by_std else dev
    single = members < 2
    if singleton == "verl":
        return np.where(single, values / (1.0 + eps) if norm_by_std else values, out)
    if singleton == "zero":
        return np.where(single, 0.0, out)
    if singleton == "keep":
        return np.where(single, values, out)
    raise ValueError(f"group_normalize: singleton {singleton!r} (verl | zero | keep)")


BLOCK = 1 << 15  # elements per block of elementwise passes fused block by block (256 KiB of float64)


@dataclass(frozen=True)
class Moments:
    """Sufficient statistics of a (weighted) sample that merge exactly across batches: the total weight `n`
    (a count when unweighted), the mean, and m2 = sum w (x - mean)^2. (The sum is n * mean, the sum of squares
    m2 + n * mean^2; m2 is kept instead because it does not cancel.) Two batches merge by Chan et al.'s pairwise
    update, so the moments of a round are the same however the round was split, to rounding."""

    n: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    @classmethod
    def of(cls, values: np.ndarray, weights: np.ndarray | None = None) -> Moments:
        values = np.asarray(values, dtype=np.float64)
        if len(values) == 0:
            return cls()
        ref = float(values[0])  # shifted: a constant sample has mean == its value exactly
        dev = values - ref
        if weights is None:  # three whole-array passes: the shift, the sum, the squares (a BLAS dot)
            n = float(len(values))
            shift = float(dev.sum()) / n
        else:
            w = np.asarray(weights, dtype=np.float64)
            n = float(w.sum())
            if n == 0.0:
                return cls()
            shift = float(np.dot(w, dev)) / n
        mean = ref + shift
        dev -= shift  # values - mean, in place (the shift is exact for a constant sample: 0)
        return cls(n, mean, float(np.dot(dev, dev) if weights is None else np.dot(w, dev * dev)))

    def merge(self, other: Moments) -> Moments:
        if other.n == 0.0:
            return self
        if self.n == 0.0:
            return other
        n = self.n + other.n
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.n / n) if delta else self.mean
        return Moments(n, mean, self.m2 + other.m2 + delta * delta * self.n * other.n / n)

    def var(self, ddof: int = 1) -> float:
        return self.m2 / (self.n - ddof) if self.n > ddof else 0.0

    @classmethod
    def merged(cls, parts: list[Moments]) -> Moments:
        out = cls()
        for part in parts:
            out = out.merge(part)
        return out


MOMENTS_BLOCK = 1 << 16  # values per block of `moments_of_blocks` (512 KiB of float64)


def moments_of_blocks(values: np.ndarray, add_to: np.ndarray | None = None) -> Moments:
    """`Moments.of(values)` (unweighted, 1-d float64) in two read passes block by block, no array of the values'
    size allocated: sum(x - ref) with ref = values[0], then sum((x - mean)^2); each block's sum pairwise (NumPy),
    then the blocks' partial sums. (To rounding the same as `Moments.of`; a constant sample exactly: mean == its
    value, m2 == 0.) `add_to`: the first pass also adds the values into it, in place (one read for both)."""
    n = len(values)
    if n == 0:
        return Moments()
    ref = float(values[0])
    buf = np.empty(min(n, MOMENTS_BLOCK))
    starts = range(0, n, MOMENTS_BLOCK)
    part = np.empty(len(starts))
    for k, i in enumerate(starts):
        block = values[i : i + MOMENTS_BLOCK]
        if add_to is not None:
            np.add(add_to[i : i + MOMENTS_BLOCK], block, out=add_to[i : i + MOMENTS_BLOCK])
        part[k] = np.subtract(block, ref, out=buf[: len(block)]).sum()
    mean = ref + float(part.sum()) / n
    for k, i in enumerate(starts):
        dev = np.subtract(values[i : i + MOMENTS_BLOCK], mean, out=buf[: min(MOMENTS_BLOCK, n - i)])
        part[k] = np.einsum("i,i->", dev, dev)  # (a BLAS dot per block costs more: its threads)
    return Moments(float(n), mean, float(part.sum()))


def whiten(
    values: np.ndarray,
    moments: Moments | None = None,
    weights: np.ndarray | None = None,
    var_eps: float = 1e-8,
    std_eps: float = 0.0,
    min_count: float = 1.0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """(x - mean) / (sqrt(var + var_eps) + std_eps), var Bessel-corrected, over `moments` (default: the values'
    own, weighted by `weights`). verl's masked_whiten is var_eps=1e-8 over the mask's tokens; GDPO's batch
    normalisation (TRL) var_eps=0, std_eps=eps. Fewer than `min_count` entries (of weight): x unchanged.
    `out=values` whitens a float64 array in place (no second array of its size)."""
    values = np.asarray(values, dtype=np.float64)
    m = Moments.of(values, weights) if moments is None else moments
    if m.n == 0.0 or m.n < min_count:
        if out is None:
            return values.copy()
        out[...] = values
        return out
    mean, scale = m.mean, np.sqrt(m.var() + var_eps) + std_eps
    if values.ndim != 1:
        out = np.subtract(values, mean, out=out)
        out /= scale
        return out
    if out is None:
        out = np.empty(len(values))
    for i in range(0, len(values), BLOCK):  # the two passes fused block by block (a block stays in cache)
        o = np.subtract(values[i : i + BLOCK], mean, out=out[i : i + BLOCK])
        o /= scale
    return out


_COMPILED_RECURSION_MIN = 1 << 16  # below this the scan's few passes cost less than importing scipy.signal


def segment_discounted_cumsum(values: np.ndarray, segments: np.ndarray, discount: float) -> np.ndarray:
    """y_t = sum_{s >= t in t's segment} discount^(s - t) x_s, for contiguous segments (e.g. the assistant
    tokens of one trajectory, in order): `runs_discounted_cumsum` over the runs of equal segment ids."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return x.copy()
    first, _ = segment_bounds(segments)
    return runs_discounted_cumsum(x, np.diff(np.append(np.flatnonzero(first), len(x))), discount)


def runs_discounted_cumsum(
    values: np.ndarray, lengths: np.ndarray, discount: float, out: np.ndarray | None = None
) -> np.ndarray:
    """y_t = sum_{s >= t in t's run} discount^(s - t) x_s, the values cut into consecutive runs of `lengths`
    (positive, summing to len(values)): `segment_discounted_cumsum` without a per-position segment array.
    The recursion y_t = x_t + discount * y_{t+1} from each run's end in compiled code, O(n) (from
    _COMPILED_RECURSION_MIN values, or undiscounted): runs of one length as the columns of one banded solve,
    runs of other lengths as one chain cut between runs (finite values), undiscounted runs of like lengths as
    zero-padded rows; otherwise a log-step (Hillis-Steele) scan: ceil(log2(longest run)) whole-array passes,
    every step adding only two terms (no cancellation). `out`: a float64 array of len(values) to write y into
    (it may be `values` itself)."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        return x.copy() if out is None else out
    lengths = np.asarray(lengths, dtype=np.int64)
    bounds = np.append(0, np.cumsum(lengths))
    longest = int(lengths.max())
    undiscounted = float(discount) == 1.0
    one_length = bool((lengths == longest).all())
    compiled = undiscounted or n >= _COMPILED_RECURSION_MIN
    chain = compiled and not undiscounted and not one_length and bool(np.isfinite(x.sum()))
    padded = compiled and not chain and len(lengths) * longest <= 4 * n
    if chain or padded:
        y = x.copy() if out is None else out
        if y is not x and out is not None:
            np.copyto(y, x)
        if chain:
            # one chain with its links cut between runs, in place, no padding (a cut link multiplies y by 0:
            # a non-finite y would leak NaN across it, hence finite values only)
            _backward_recursion_runs(y, bounds, float(discount))
            return y
        # one run per row, in order; a shorter row zero padded after its data (a zero tail adds 0 to the row's
        # last value: y_T = x_T)
        if one_length:  # the rows are a view of the data
            rows, real = y.reshape(len(lengths), longest), None
        else:
            rows = np.zeros((len(lengths), longest))
            real = np.arange(longest)[None, :] < lengths[:, None]
            rows[real] = x
        if undiscounted:
            np.cumsum(rows[:, ::-1], axis=1, out=rows[:, ::-1])  # y_t = y_{t+1} + x_t, from each row's end
        else:
            _backward_recursion(rows, float(discount))
        if real is not None:
            y[:] = rows[real]
        return y
    y = x.copy() if out is None else out  # the scan adds in place
    if y is not x and out is not None:
        np.copyto(y, x)
    remaining = np.repeat(bounds[1:], lengths) - np.arange(n)  # positions left in the segment, incl. self
    coef, d = float(discount), 1
    while d < longest:
        # y[:-d] += where(remaining > d, y[d:], 0) * coef, adding only where the term is in the segment (the
        # other positions keep their value; the ufunc buffers the overlapping y[d:] as if copied first)
        term = y[d:] if coef == 1.0 else y[d:] * coef
        np.add(y[:-d], term, out=y[:-d], where=remaining[:-d] > d)
        coef, d = coef * coef, d * 2
    return y


def _backward_recursion(rows: np.ndarray, discount: float) -> None:
    """rows[:, t] += discount * rows[:, t + 1] from each row's end, in place (rows: C-contiguous float64): the
    rows are the columns of a Fortran-ordered matrix B, and y solves the unit upper bidiagonal system
    y_t - discount * y_{t+1} = x_t, one right-hand side per row, by LAPACK's banded triangular solve (dtbtrs:
    back substitution, y_t = x_t - (-discount) y_{t+1}, the same multiply-add as verl's loop; the BLAS may fuse it
    into one rounding)."""
    from scipy.linalg.lapack import dtbtrs  # here: scipy.linalg costs ~0.15 s to import

    length = rows.shape[1]
    ab = np.empty((2, length), order="F")  # banded storage: row 0 the superdiagonal (ab[0, 0] unused)
    ab[0] = -discount
    ab[1] = 1.0  # the diagonal (unit: not read)
    b = rows.T  # Fortran-ordered (length, runs): each column one run, contiguous
    solved, info = dtbtrs(ab, b, uplo="U", trans="N", diag="U", overwrite_b=1)
    if info != 0:  # (a unit triangular system is never singular)
        raise FloatingPointError(f"dtbtrs info {info}")
    if not np.shares_memory(solved, rows):  # (f2py solved a copy)
        rows[...] = solved.T


CHAIN_BLOCK = 1 << 16  # values per banded solve of `_backward_recursion_runs` (its band: 1 MiB, in cache)


def _backward_recursion_runs(y: np.ndarray, bounds: np.ndarray, discount: float) -> None:
    """y[t] += discount * y[t + 1] from each run's end, in place (runs: y[bounds[k]:bounds[k + 1]]): y as one
    unit upper bidiagonal system whose superdiagonal is 0 where a run starts, solved by dtbtrs (as
    `_backward_recursion`) over consecutive whole runs of about CHAIN_BLOCK values at a time."""
    from scipy.linalg.lapack import dtbtrs

    n = len(y)
    # chunk ends: the first run boundary at or past each multiple of CHAIN_BLOCK after the chunk's start
    ends, lo = [], 0
    while lo < n:
        k = int(np.searchsorted(bounds, lo + CHAIN_BLOCK, side="left"))
        hi = int(bounds[min(k, len(bounds) - 1)])
        ends.append((lo, hi))
        lo = hi
    width = max(hi - lo for lo, hi in ends)
    ab = np.empty((2, width), order="F")
    ab[0] = -discount
    ab[1] = 1.0  # (unit diagonal: not read)
    for lo, hi in ends:
        starts = bounds[np.searchsorted(bounds, lo, side="right") : np.searchsorted(bounds, hi, side="left")]
        cut = starts - lo  # links y[s - 1] <- y[s] between runs, within this chunk
        ab[0, cut] = 0.0
        solved, info = dtbtrs(ab[:, : hi - lo], y[lo:hi, None], uplo="U", trans="N", diag="U", overwrite_b=1)
        ab[0, cut] = -discount
        if info != 0:
            raise FloatingPointError(f"dtbtrs info {info}")
        if not np.shares_memory(solved, y):
            y[lo:hi] = solved[:, 0]
