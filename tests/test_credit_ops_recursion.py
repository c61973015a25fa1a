"""`segment_discounted_cumsum` (the GAE / return recursions) against the recursion written out position by
position, on both of its paths: the per-segment recursion in compiled code and the log-step scan."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.credit import ops
from pipeline.credit.ops import segment_discounted_cumsum


def recursion(x: np.ndarray, segments: np.ndarray, discount: float) -> np.ndarray:
    """y_t = x_t + discount * y_{t+1} within t's segment, from the end (verl's loop, one segment at a time)."""
    y = np.zeros(len(x))
    for t in range(len(x) - 1, -1, -1):
        carry = y[t + 1] if t + 1 < len(x) and segments[t + 1] == segments[t] else 0.0
        y[t] = x[t] + discount * carry
    return y


def test_by_hand() -> None:
    # segments [1, 2, 3 | 4]: discount 0.5 -> 1 + 0.5 (2 + 0.5 * 3) = 2.75, 2 + 1.5 = 3.5, 3; then 4
    x = np.array([1.0, 2.0, 3.0, 4.0])
    seg = np.array([0, 0, 0, 1])
    assert segment_discounted_cumsum(x, seg, 0.5).tolist() == [2.75, 3.5, 3.0, 4.0]
    assert segment_discounted_cumsum(x, seg, 1.0).tolist() == [6.0, 5.0, 3.0, 4.0]


@pytest.mark.parametrize("compiled", [False, True])
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    discount=st.sampled_from([0.0, 0.5, 0.9405, 0.99, 1.0]),
    seed=st.integers(0, 2**31 - 1),
    chain_block=st.sampled_from([1, 5, 64, 1 << 16]),
)
def test_matches_the_recursion(
    compiled: bool, lengths: list[int], discount: float, seed: int, chain_block: int
) -> None:
    x = np.random.default_rng(seed).standard_normal(sum(lengths))
    seg = np.repeat(np.arange(len(lengths)), lengths)
    # compiled: every input takes the compiled recursion (one length: columns; other lengths: the cut chain,
    # solved `chain_block` values at a time; undiscounted: padded rows); else the scan
    threshold = 0 if compiled else 1 << 62
    old, old_block = ops._COMPILED_RECURSION_MIN, ops.CHAIN_BLOCK
    ops._COMPILED_RECURSION_MIN, ops.CHAIN_BLOCK = threshold, chain_block
    try:
        got = segment_discounted_cumsum(x, seg, discount)
    finally:
        ops._COMPILED_RECURSION_MIN, ops.CHAIN_BLOCK = old, old_block
    np.testing.assert_allclose(got, recursion(x, seg, discount), rtol=1e-12, atol=1e-12)
    assert np.array_equal(x, np.random.default_rng(seed).standard_normal(sum(lengths)))  # the input is kept


def test_large_batch_takes_the_compiled_path_and_agrees_with_the_scan() -> None:
    rng = np.random.default_rng(7)
    lengths = rng.integers(3000, 6000, 40)
    x = rng.standard_normal(int(lengths.sum()))
    seg = np.repeat(np.arange(len(lengths)), lengths)
    assert len(x) >= ops._COMPILED_RECURSION_MIN
    compiled = segment_discounted_cumsum(x, seg, 0.99 * 0.95)
    old = ops._COMPILED_RECURSION_MIN
    ops._COMPILED_RECURSION_MIN = 1 << 62
    try:
        scan = segment_discounted_cumsum(x, seg, 0.99 * 0.95)
    finally:
        ops._COMPILED_RECURSION_MIN = old
    np.testing.assert_allclose(compiled, scan, rtol=1e-10, atol=1e-12)
    # one segment written out by hand at its end: y_T = x_T, y_{T-1} = x_{T-1} + d x_T
    end = int(lengths[0])
    assert compiled[end - 1] == x[end - 1]
    assert compiled[end - 2] == pytest.approx(x[end - 2] + 0.99 * 0.95 * x[end - 1], rel=1e-15)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    block=st.sampled_from([1, 3, 8, 64, 1 << 16]),
    scale=st.sampled_from([1e-3, 1.0, 1e6]),
    seed=st.integers(0, 2**31 - 1),
)
def test_moments_of_blocks_matches_moments_of(n: int, block: int, scale: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * scale + rng.standard_normal() * scale
    target = rng.standard_normal(n)
    before = target.copy()
    old = ops.MOMENTS_BLOCK
    ops.MOMENTS_BLOCK = block
    try:
        got = ops.moments_of_blocks(x, add_to=target)
        constant = ops.moments_of_blocks(np.full(n, x[0]))
    finally:
        ops.MOMENTS_BLOCK = old
    want = ops.Moments.of(x)
    assert got.n == want.n
    assert got.mean == pytest.approx(want.mean, rel=1e-12, abs=1e-12 * scale)
    assert got.m2 == pytest.approx(want.m2, rel=1e-10, abs=1e-12 * scale * scale)
    # the first pass added the values into `add_to`
    np.testing.assert_array_equal(target, before + x)
    # a constant sample: its value exactly, no spread (whitening gives exactly 0)
    assert (constant.mean, constant.m2) == (x[0], 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_run_stays_in_its_run(bad: float) -> None:
    # runs of other lengths (the cut chain's case): a NaN / inf in run 1 leaves runs 0 and 2 as the recursion
    lengths = [5, 7, 4]
    x = np.random.default_rng(3).standard_normal(sum(lengths))
    x[7] = bad
    seg = np.repeat(np.arange(3), lengths)
    old = ops._COMPILED_RECURSION_MIN
    ops._COMPILED_RECURSION_MIN = 0
    try:
        got = segment_discounted_cumsum(x, seg, 0.9)
    finally:
        ops._COMPILED_RECURSION_MIN = old
    want = recursion(x, seg, 0.9)
    keep = seg != 1
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-12, atol=1e-12)
    assert not np.isfinite(got[5:8]).any() and np.isfinite(got[8:12]).all()
