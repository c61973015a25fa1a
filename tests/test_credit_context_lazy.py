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
    steps = steps.set_column(
        steps.column_names.index("logprobs"), "logprobs", pa.array(lp, pa.list_(pa.float32()))
    )
    ctx = CreditContext.from_arrow(traj, steps)
    if ctx.n_tokens == 0:
        return
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, ctx.n_tokens, size=min(50, ctx.n_tokens))
    sorted_steps = steps.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
    starts = ctx.steps["tok_start"].to_numpy()
    for name, col in (("tok_logprob", "logprobs"), ("tok_value", "values")):
        eager = _flat_list_floats(sorted_steps.column(col), starts, ctx.n_tokens)
        fresh = CreditContext.from_arrow(traj, steps)  # mask_values before anything builds the token array
        np.testing.assert_array_equal(fresh.mask_values(name), eager[fresh.tok_mask])
        np.testing.assert_array_equal(ctx.values_at(name, pos), eager[pos])  # before the array is built
        np.testing.assert_array_equal(getattr(ctx, name), eager)
        np.testing.assert_array_equal(ctx.values_at(name, pos), eager[pos])  # after
    lengths = ctx.steps["n_tokens"].to_numpy()
    tok_step = np.repeat(np.arange(ctx.n_steps), lengths)
    np.testing.assert_array_equal(ctx.tok_step, tok_step)
    np.testing.assert_array_equal(ctx.tok_traj, ctx.step_traj[tok_step])
    per_step = rng.normal(size=ctx.n_steps)
    per_traj = rng.normal(size=ctx.n_traj)
    np.testing.assert_array_equal(
        ctx.broadcast_step(per_step), np.where(ctx.tok_mask, per_step[tok_step], 0.0)
    )
    np.testing.assert_array_equal(
        ctx.broadcast_traj(per_traj), np.where(ctx.tok_mask, per_traj[ctx.step_traj[tok_step]], 0.0)
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_per_step_results_lay_out_as_their_token_arrays(seed):
    """A per-step result (CreditResult.per_step) gives the advantages table that its materialised per-token
    array gives, bit for bit, and token_adv read by a refiner is ctx.broadcast_step of it."""
    from pipeline.credit.context import CreditResult
    from pipeline.credit.process import advantages_table
    from pipeline.credit.registry import _finish

    traj, steps = random_round(seed, max_groups=3, max_group_size=4, max_steps=6)
    ctx = CreditContext.from_arrow(traj, steps)
    rng = np.random.default_rng(seed)
    per_step = rng.normal(size=ctx.n_steps)
    lazy = _finish(ctx, CreditResult.per_step(ctx, per_step, {"a_hat": per_step}))
    assert not isinstance(lazy.raw_token_adv(), np.ndarray)  # not built by _finish
    eager = _finish(ctx, CreditResult(ctx.broadcast_step(per_step), {"a_hat": per_step}))
    assert advantages_table(ctx, "m", lazy).equals(advantages_table(ctx, "m", eager))
    np.testing.assert_array_equal(lazy.token_adv, eager.token_adv)
    np.testing.assert_array_equal(lazy.with_components(x=per_step).token_adv, eager.token_adv)


def test_per_step_result_checks():
    """A non-finite step advantage is an error naming the trajectory, except on a step without tokens (no token
    carries it) or off the assistant steps (zeroed); a wrong shape is an error."""
    import pytest

    from pipeline.credit.context import CreditResult
    from pipeline.credit.registry import MethodError, _finish

    traj = pa.table({"traj_id": ["t0"], "group_id": ["g"], "reward": [1.0]})
    steps = pa.table(
        {
            "traj_id": ["t0"] * 4,
            "step_idx": [0, 1, 2, 3],
            "role": ["user", "assistant", "assistant", "assistant"],
            "token_ids": pa.array([[1, 2], [3, 4, 5], [], [6]], pa.list_(pa.int32())),
        }
    )
    ctx = CreditContext.from_arrow(traj, steps)
    ok = _finish(ctx, CreditResult.per_step(ctx, np.array([np.nan, 2.0, np.inf, -1.0])))
    assert ok.token_adv.tolist() == [0.0, 0.0, 2.0, 2.0, 2.0, -1.0]
    with pytest.raises(MethodError, match=r"trajectory 't0' \(token 2\)"):
        _finish(ctx, CreditResult.per_step(ctx, np.array([0.0, np.nan, 0.0, 1.0])))
    with pytest.raises(MethodError, match="3 steps|step advantages"):
        _finish(ctx, CreditResult(None, step_adv=np.zeros(3)))
