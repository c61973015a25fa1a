"""The credit batch: frozen, built once from Arrow with the per-token float columns its methods declare; its
accessors (a few tokens, the assistant tokens, the whole array) give what a plain per-step reading of the lists
gives; the per-token indices and the result layouts match their per-token definitions bit for bit."""

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_credit_properties import random_round

from pipeline.credit.batch import CreditBatch, TokenFloats, _group_index, _plain_strings
from pipeline.credit.process import advantages_table
from pipeline.credit.registry import MethodError, _finish, method_step_columns, run_methods
from pipeline.credit.result import CreditResult
from schemas import one_chunk


def _reference(steps: pa.Table, col: str) -> np.ndarray:
    """The per-token float64 array of a list column, step by step in Python: a step's list value i on its
    token i (NaN where the list is null or shorter than the step)."""
    steps = steps.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
    out: list[float] = []
    for tokens, values in zip(
        steps.column("token_ids").to_pylist(), steps.column(col).to_pylist(), strict=True
    ):
        n = len(tokens)
        vals = [np.nan] * n if values is None else [float(v) for v in values[:n]]
        out += vals + [np.nan] * (n - len(vals))
    return np.array(out, dtype=np.float64)


def _with_logprobs(steps: pa.Table, lists: list) -> pa.Table:
    i = steps.column_names.index("logprobs")
    return steps.set_column(i, "logprobs", pa.array(lists, pa.list_(pa.float32())))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_token_columns_match_a_per_step_reading(seed):
    traj, steps = random_round(seed, max_groups=3, max_group_size=4, max_steps=6)
    # logprobs: the values lists (null on some steps), one list per step cut short when the seed is odd (the
    # lists are then not one value per token: the builder lays them out per token once)
    lp = steps.column("values").to_pylist()
    if seed % 2:
        lp = [v[:-1] if v else v for v in lp]
    steps = _with_logprobs(steps, lp)
    batch = CreditBatch.from_arrow(traj, steps)
    tokens = steps.column("token_ids").to_pylist()
    cut = any(v is not None and len(v) != len(t) for v, t in zip(lp, tokens, strict=True))
    assert (batch.logprobs.dense is not None) == cut  # laid out per token once, by the builder
    if batch.n_tokens == 0:
        return
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, batch.n_tokens, size=min(50, batch.n_tokens))
    for column, name in ((batch.logprobs, "logprobs"), (batch.values, "values")):
        expect = _reference(steps, name)
        full = column.per_token()
        np.testing.assert_array_equal(full, expect)
        np.testing.assert_array_equal(column.at(pos), full[pos])
        np.testing.assert_array_equal(column.on_mask(), full[batch.tok_mask])
    tok_step = np.repeat(np.arange(batch.n_steps), batch.steps["n_tokens"].to_numpy())
    np.testing.assert_array_equal(batch.token_steps(), tok_step)
    np.testing.assert_array_equal(batch.token_trajs(), batch.step_traj[tok_step])
    np.testing.assert_array_equal(batch.mask_steps(), tok_step[batch.tok_mask])
    np.testing.assert_array_equal(batch.mask_trajs(), batch.step_traj[tok_step][batch.tok_mask])
    per_step = rng.normal(size=batch.n_steps)
    per_traj = rng.normal(size=batch.n_traj)
    np.testing.assert_array_equal(
        batch.broadcast_step(per_step), np.where(batch.tok_mask, per_step[tok_step], 0.0)
    )
    np.testing.assert_array_equal(
        batch.broadcast_traj(per_traj), np.where(batch.tok_mask, per_traj[batch.step_traj[tok_step]], 0.0)
    )


def test_builder_reads_only_the_declared_columns():
    """A per-token float column its methods do not declare is all unknown (NaN): the builder never reads it."""
    traj, steps = random_round(3, max_groups=2, max_group_size=3, max_steps=4)
    full = CreditBatch.from_arrow(traj, steps)
    assert np.isfinite(full.values.on_mask()).any()
    grpo = CreditBatch.from_arrow(traj, steps, method_step_columns(["grpo"]))
    assert np.isnan(grpo.values.per_token()).all() and np.isnan(grpo.logprobs.at(np.arange(3))).all()
    gae = CreditBatch.from_arrow(traj, steps, method_step_columns(["gae"]))
    np.testing.assert_array_equal(gae.values.per_token(), full.values.per_token())
    assert np.isnan(gae.logprobs.on_mask()).all()


def test_batch_and_result_are_frozen():
    traj, steps = random_round(5, max_groups=2, max_group_size=2, max_steps=3)
    batch = CreditBatch.from_arrow(traj, steps)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.round = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.values.dense = None  # type: ignore[misc]
    result = CreditResult.per_step(batch, np.zeros(batch.n_steps))
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.step_adv = None  # type: ignore[misc]


def test_all_null_and_empty_columns():
    traj = pa.table({"traj_id": ["t0"], "group_id": ["g"], "reward": [1.0]})
    steps = pa.table(
        {
            "traj_id": ["t0"] * 3,
            "step_idx": [0, 1, 2],
            "role": ["user", "assistant", "assistant"],
            "token_ids": pa.array([[1, 2], [3, 4, 5], [6]], pa.list_(pa.int32())),
            "values": pa.array([None, [0.5, 0.25, 1.0], None], pa.list_(pa.float32())),
        }
    )
    batch = CreditBatch.from_arrow(traj, steps)
    np.testing.assert_array_equal(batch.values.on_mask(), [0.5, 0.25, 1.0, np.nan])
    np.testing.assert_array_equal(batch.values.at(np.array([0, 3, 5])), [np.nan, 0.25, np.nan])
    assert np.isnan(batch.logprobs.per_token()).all() and len(batch.logprobs.per_token()) == 6
    assert isinstance(batch.logprobs, TokenFloats) and batch.logprobs.dense is None


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_result_layouts_lay_out_as_their_token_arrays(seed):
    """A per-step or on-mask result gives the advantages table its per-token array gives, bit for bit, and its
    `adv_per_token()` (what a refiner reads) is the broadcast of it."""
    traj, steps = random_round(seed, max_groups=3, max_group_size=4, max_steps=6)
    batch = CreditBatch.from_arrow(traj, steps)
    rng = np.random.default_rng(seed)
    per_step = rng.normal(size=batch.n_steps)
    stepwise = _finish(
        batch, CreditResult.per_step(batch, per_step, {"a_hat": per_step}, step_returns=per_step)
    )
    tokens = _finish(
        batch,
        CreditResult.per_token(
            batch.broadcast_step(per_step), {"a_hat": per_step}, tok_returns=batch.broadcast_step(per_step)
        ),
    )
    assert advantages_table(batch, "m", stepwise).equals(advantages_table(batch, "m", tokens))
    np.testing.assert_array_equal(stepwise.adv_per_token(), tokens.adv_per_token())
    np.testing.assert_array_equal(stepwise.returns_per_token(), tokens.returns_per_token())
    on_mask = rng.normal(size=int(batch.tok_mask.sum()))
    masked = _finish(batch, CreditResult.on_mask(batch, on_mask, mask_returns=on_mask))
    full = np.zeros(batch.n_tokens)
    full[batch.tok_mask] = on_mask
    as_tokens = _finish(batch, CreditResult.per_token(full, tok_returns=full))
    assert advantages_table(batch, "m", masked).equals(advantages_table(batch, "m", as_tokens))
    # a refiner keeps its base's returns in their layout
    refined = stepwise.refined(full, {}, {})
    assert refined.step_adv is None and refined.step_returns is stepwise.step_returns
    np.testing.assert_array_equal(refined.returns_per_token(), tokens.returns_per_token())


def test_per_step_result_checks():
    """A non-finite step advantage is an error naming the trajectory, except on a step without tokens (no token
    carries it) or off the assistant steps (zeroed); a wrong shape is an error; a result without advantages
    too."""
    traj = pa.table({"traj_id": ["t0"], "group_id": ["g"], "reward": [1.0]})
    steps = pa.table(
        {
            "traj_id": ["t0"] * 4,
            "step_idx": [0, 1, 2, 3],
            "role": ["user", "assistant", "assistant", "assistant"],
            "token_ids": pa.array([[1, 2], [3, 4, 5], [], [6]], pa.list_(pa.int32())),
        }
    )
    batch = CreditBatch.from_arrow(traj, steps)
    ok = _finish(batch, CreditResult.per_step(batch, np.array([np.nan, 2.0, np.inf, -1.0])))
    assert ok.adv_per_token().tolist() == [0.0, 0.0, 2.0, 2.0, 2.0, -1.0]
    with pytest.raises(MethodError, match=r"trajectory 't0' \(token 2\)"):
        _finish(batch, CreditResult.per_step(batch, np.array([0.0, np.nan, 0.0, 1.0])))
    with pytest.raises(MethodError, match="3 steps|step advantages"):
        _finish(batch, CreditResult(step_adv=np.zeros(3)))
    with pytest.raises(MethodError, match="no advantages"):
        _finish(batch, CreditResult())


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from(["step", "mask", "token"]),
    st.sampled_from(["step", "mask", "token"]),
)
def test_token_columns_of_any_two_layouts_are_their_float32_token_arrays(seed, adv_layout, ret_layout):
    """token_adv and token_returns, built over one offsets array (in one scatter pass when they share a layout,
    #36), are each the float64 per-token array cast to float32 and cut at the steps, whatever the two layouts."""
    traj, steps = random_round(seed, max_groups=3, max_group_size=4, max_steps=6)
    batch = CreditBatch.from_arrow(traj, steps)
    rng = np.random.default_rng(seed)
    n_mask = int(batch.tok_mask.sum())
    asst = batch.steps["is_assistant"].to_numpy()

    def layout(kind: str) -> tuple[dict, np.ndarray]:
        if kind == "step":
            v = np.where(asst, rng.normal(size=batch.n_steps), 0.0)
            return {"step": v}, np.repeat(v, batch.step_tokens)
        full = np.zeros(batch.n_tokens)
        full[batch.tok_mask] = rng.normal(size=n_mask)
        return ({"mask": full[batch.tok_mask]} if kind == "mask" else {"token": full}), full

    adv, adv_full = layout(adv_layout)
    ret, ret_full = layout(ret_layout)
    result = CreditResult(
        {},
        {},
        step_adv=adv.get("step"),
        mask_adv=adv.get("mask"),
        tok_adv=adv.get("token"),
        step_returns=ret.get("step"),
        mask_returns=ret.get("mask"),
        tok_returns=ret.get("token"),
    )
    table = advantages_table(batch, "m", result)
    offsets = batch.step_offsets
    for name, full in (("token_adv", adv_full), ("token_returns", ret_full)):
        want = [full[a:b].astype(np.float32).tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        assert table.column(name).type == pa.list_(pa.float32())
        assert table.column(name).to_pylist() == want


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_values_on_the_assistant_steps_alone_read_as_a_per_step_reading(seed, garbage):
    """Critic values on the assistant steps alone (verl's: the response tokens), the other steps' lists null:
    on_mask takes the lists' values as they are. A null list may still span values in Arrow (`garbage`: each
    null list holds some); those are never read as the assistant tokens' values."""
    traj, steps = random_round(seed, max_groups=3, max_group_size=4, max_steps=6)
    roles = steps.column("role").to_pylist()
    tokens = steps.column("token_ids").to_pylist()
    rng = np.random.default_rng(seed)
    lists = [
        rng.normal(size=len(t)).astype(np.float32).tolist() if r == "assistant" else None
        for r, t in zip(roles, tokens, strict=True)
    ]
    if garbage:  # null lists that span values (Arrow allows it): offsets from each list's stored length
        stored = [len(v) if v is not None else int(rng.integers(1, 4)) for v in lists]
        ends = np.concatenate([[0], np.cumsum(stored)]).astype(np.int32)
        flat = rng.normal(size=int(ends[-1])).astype(np.float32)
        for i, v in enumerate(lists):
            if v is not None:
                flat[ends[i] : ends[i + 1]] = v
        mask = pa.array([v is None for v in lists], pa.bool_())
        column = pa.ListArray.from_arrays(pa.array(ends), pa.array(flat), mask=mask)
        assert column.to_pylist() == [None if v is None else pytest.approx(v) for v in lists]
    else:
        column = pa.array(lists, pa.list_(pa.float32()))
    steps = steps.set_column(steps.column_names.index("values"), "values", column)
    batch = CreditBatch.from_arrow(traj, steps)
    expect = _reference(steps, "values")
    np.testing.assert_array_equal(batch.values.per_token(), expect)
    np.testing.assert_array_equal(batch.values.on_mask(), expect[batch.tok_mask])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=3), max_size=25), st.booleans())
def test_group_index_is_each_group_ids_place_in_sorted_order(ids, view):
    """A trajectory's group index: its group id's place among the batch's distinct ids sorted by code point
    (what Python's sort gives; UTF-8 bytes sort the same), whatever the id's Arrow type."""
    col = pa.array(ids, pa.string())
    if view:
        col = col.cast(pa.string_view())
    table = pa.table({"traj_id": pa.array([f"t{i}" for i in range(len(ids))]), "group_id": col})
    place = {g: i for i, g in enumerate(sorted(set(ids)))}
    # (as the builder reads a caller's table: its views as plain strings first)
    got = _group_index(_plain_strings(table))
    np.testing.assert_array_equal(got, np.array([place[g] for g in ids], dtype=np.int64))


def test_a_null_group_id_names_its_trajectory():
    traj, steps = random_round(4, max_groups=2, max_group_size=2, max_steps=3)
    i = traj.column_names.index("group_id")
    ids = traj.column("group_id").to_pylist()
    ids[1] = None
    bad = traj.set_column(i, pa.field("group_id", pa.string()), pa.array(ids, pa.string()))
    with pytest.raises(
        ValueError, match=rf"trajectory '{traj.column('traj_id')[1].as_py()}': field 'group_id'"
    ):
        CreditBatch.from_arrow(bad, steps)


FRAMELESS = ["grpo", "dr_grpo", "rloo", "gdpo", "gae", "turn_ppo", "mt_grpo", "gigpo"]


def test_gigpo_at_its_defaults_makes_no_polars_object(monkeypatch):
    """gigpo's anchors and exact step groups are Arrow and NumPy (no frame or series a batch); only the
    similarity clusters build a frame."""
    import polars as pl

    traj, steps = random_round(5, max_groups=3, max_group_size=3, max_steps=5)
    batch = CreditBatch.from_arrow(traj, steps, method_step_columns(["gigpo"]))
    want = run_methods(batch, ["gigpo"])["gigpo"]

    def no_polars(*args, **kwargs):
        raise AssertionError("gigpo built a Polars object at its defaults")

    monkeypatch.setattr(pl, "DataFrame", no_polars)
    monkeypatch.setattr(pl, "Series", no_polars)
    got = run_methods(CreditBatch.from_arrow(traj, steps, method_step_columns(["gigpo"])), ["gigpo"])["gigpo"]
    np.testing.assert_array_equal(got.step_adv, want.step_adv)


def test_the_common_estimators_and_their_table_build_no_frame():
    """grpo, dr_grpo, rloo, gdpo, gae, turn_ppo, mt_grpo and gigpo (at its defaults) and the advantages table
    read the batch's Arrow tables and arrays: no Polars frame of the trajectories or steps is built (what a round
    of them would pay per batch); the frames, asked for, hold what the arrays say."""
    traj, steps = random_round(11, max_groups=3, max_group_size=3, max_steps=5)
    batch = CreditBatch.from_arrow(traj, steps, method_step_columns(FRAMELESS))
    for method, result in run_methods(batch, FRAMELESS).items():
        assert advantages_table(batch, method, result).num_rows == batch.n_steps
    assert not {"steps", "trajectories"} & set(batch.derived)
    per_step = CreditBatch.from_arrow(traj, steps, method_step_columns(["grpo"]))
    for method, result in run_methods(per_step, ["grpo", "rloo"]).items():
        advantages_table(per_step, method, result)
    assert per_step.derived == {}  # no token mask either (a per-step layout needs none)
    frame = batch.steps
    np.testing.assert_array_equal(frame["is_assistant"].to_numpy(), batch.step_is_assistant)
    np.testing.assert_array_equal(frame["n_tokens"].to_numpy(), batch.step_tokens)
    np.testing.assert_array_equal(frame["tok_start"].to_numpy(), batch.step_starts)
    np.testing.assert_array_equal(frame["group_index"].to_numpy(), batch.traj_group[batch.step_traj])
    trajectories = batch.trajectories
    assert trajectories["traj_id"].to_list() == sorted(traj.column("traj_id").to_pylist())
    np.testing.assert_array_equal(trajectories["group_index"].to_numpy(), batch.traj_group)
    assert {"steps", "trajectories"} <= set(batch.derived) and batch.steps is frame  # built once
    np.testing.assert_array_equal(
        batch.tok_mask, np.repeat(frame["is_assistant"].to_numpy(), batch.step_tokens)
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 12), st.integers(0, 12))
def test_a_column_sliced_in_its_buffers_reads_as_its_copy(seed, head, tail):
    """The batch reads a one-chunk column as it is (no copy), an offset into its buffers included (what a
    slice of a read gives): the same token values, mask and statistics as from fresh buffers."""
    traj, steps = random_round(seed, max_groups=3, max_group_size=3, max_steps=6)
    # in the builder's order (else it sorts: fresh buffers), then sliced
    steps = steps.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
    sliced = steps.slice(head, max(steps.num_rows - head - tail, 0))
    in_place = head if sliced.num_rows else 0  # the column read as it is, not copied
    assert one_chunk(sliced.column("values")).offset == in_place or head >= steps.num_rows
    # fresh buffers (a take: combine_chunks keeps one chunk as it is)
    copied = sliced.take(pa.array(np.arange(sliced.num_rows)))
    a, b = CreditBatch.from_arrow(traj, sliced), CreditBatch.from_arrow(traj, copied)
    np.testing.assert_array_equal(a.tok_mask, b.tok_mask)
    for name in ("values", "logprobs"):
        fa, fb = getattr(a, name), getattr(b, name)
        np.testing.assert_array_equal(fa.per_token(), fb.per_token())
        np.testing.assert_array_equal(fa.on_mask(), fb.on_mask())
        pos = np.arange(a.n_tokens)
        np.testing.assert_array_equal(fa.at(pos), fb.at(pos))
    for method, result in run_methods(a, ["grpo", "gae", "gdpo"]).items():
        expect = run_methods(b, [method])[method]
        assert advantages_table(a, method, result).equals(advantages_table(b, method, expect))


def test_one_chunk_keeps_a_single_chunk_as_it_is():
    col = pa.chunked_array([pa.array([1.0, 2.0, 3.0, 4.0]).slice(1, 2)])
    out = one_chunk(col)
    assert out.to_pylist() == [2.0, 3.0] and out.buffers()[1].address == col.chunk(0).buffers()[1].address
    two = pa.chunked_array([pa.array([1.0]), pa.array([2.0])])
    assert one_chunk(two).to_pylist() == [1.0, 2.0] and one_chunk(pa.array([5])).to_pylist() == [5]


def test_tables_with_string_views_give_the_same_advantages():
    """A caller's tables exported by Polars at its newest compatibility level hold string views, nested ones in
    the reward components too (Arrow sorts, ranks and takes none): the batch reads them as large strings, and
    every method's advantages table is the one of the same rows as plain Arrow strings."""
    import polars as pl

    traj, steps = random_round(3, max_groups=3, max_group_size=3, max_steps=5)
    newest = pl.CompatLevel.newest()
    viewed = [pl.DataFrame(t).to_arrow(compat_level=newest) for t in (traj, steps)]
    assert pa.types.is_string_view(viewed[1].schema.field("role").type)
    plain = CreditBatch.from_arrow(traj, steps)
    batch = CreditBatch.from_arrow(*viewed)
    for method, result in run_methods(batch, [*FRAMELESS, "gigpo", "mt_grpo"]).items():
        expect = run_methods(plain, [method])[method]
        assert advantages_table(batch, method, result).equals(advantages_table(plain, method, expect))
