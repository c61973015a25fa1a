"""The context's lazily built per-token arrays: reading a few tokens (values_at) or the whole array gives what
the eager flattening gives, and broadcasting by per-step runs matches the per-token gather."""

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from test_credit_properties import random_round

from pipeline.credit.context import CreditContext, _flat_list_floats


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_lazy_token_arrays_match_eager(seed):
    traj, steps = random_round(seed, max_groups=3, max_group_size=4, max_steps=6)
    # logprobs: the values lists (null on some steps), one list cut short when the seed is odd (the slow path)
    lp = steps.column("values").to_pylist()
    if seed % 2:
        lp = [v[:-1] if v else v for v in lp]
    steps = steps.set_column(steps.column_names.index("logprobs"), "logprobs", pa.array(lp, pa.list_(pa.float32())))
    ctx = CreditContext.from_arrow(traj, steps)
    if ctx.n_tokens == 0:
        return
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, ctx.n_tokens, size=min(50, ctx.n_tokens))
    sorted_steps = steps.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
    starts = ctx.steps["tok_start"].to_numpy()
    for name, col in (("tok_logprob", "logprobs"), ("tok_value", "values")):
        eager = _flat_list_floats(sorted_steps.column(col), starts, ctx.n_tokens)
        np.testing.assert_array_equal(ctx.values_at(name, pos), eager[pos])  # before the array is built
        np.testing.assert_array_equal(getattr(ctx, name), eager)
        np.testing.assert_array_equal(ctx.values_at(name, pos), eager[pos])  # after
    lengths = ctx.steps["n_tokens"].to_numpy()
    tok_step = np.repeat(np.arange(ctx.n_steps), lengths)
    np.testing.assert_array_equal(ctx.tok_step, tok_step)
    np.testing.assert_array_equal(ctx.tok_traj, ctx.step_traj[tok_step])
    per_step = rng.normal(size=ctx.n_steps)
    per_traj = rng.normal(size=ctx.n_traj)
    np.testing.assert_array_equal(ctx.broadcast_step(per_step), np.where(ctx.tok_mask, per_step[tok_step], 0.0))
    np.testing.assert_array_equal(ctx.broadcast_traj(per_traj),
                                  np.where(ctx.tok_mask, per_traj[ctx.step_traj[tok_step]], 0.0))
