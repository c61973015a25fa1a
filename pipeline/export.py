"""Export: one row per (method, trajectory) in the flat layout external trainers consume.

Steps are concatenated per trajectory with whole-column list operations: the step lists are flattened
once and re-cut at trajectory boundaries."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc


def _recut(steps_col: pa.ChunkedArray | pa.Array, traj_offsets: np.ndarray, dtype: pa.DataType, fill: float = 0.0,
           lengths: np.ndarray | None = None) -> pa.Array:
    """Concatenate per-step lists into per-trajectory lists. Null step lists become `fill` x length."""
    arr = steps_col.combine_chunks() if isinstance(steps_col, pa.ChunkedArray) else steps_col
    if arr.null_count and lengths is not None:
        n = int(lengths.sum())
        flat = np.full(n, fill, dtype=np.float64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
        if len(values):
            parents = pc.list_parent_indices(arr).to_numpy()
            vl = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
            first = np.concatenate([[0], np.cumsum(vl)[:-1]])
            local = np.arange(len(values)) - first[parents]
            flat[starts[parents] + local] = values
        values_arr = pa.array(flat).cast(dtype)
    else:
        values_arr = pc.list_flatten(arr).cast(dtype)
    return pa.ListArray.from_arrays(pa.array(traj_offsets.astype(np.int32)), values_arr)


def _in_step_order(table: pa.Table) -> tuple[pa.Table, pl.DataFrame]:
    """The table sorted by (traj_id, step_idx), and those keys; a table already in that order (the lake's
    parts are written so) is returned as it is, without a take of every column."""
    keys = pl.from_arrow(table.select(["traj_id", "step_idx"]))
    if keys.height > 1:
        tid, idx = keys["traj_id"], keys["step_idx"]
        same = tid.slice(1) == tid.slice(0, keys.height - 1)
        ordered = tid.is_sorted() and not (same & (idx.slice(1) <= idx.slice(0, keys.height - 1))).any()
        if not ordered:
            table = table.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
            keys = pl.from_arrow(table.select(["traj_id", "step_idx"]))
    return table, keys


def build_train_batch(trajectories: pa.Table, steps: pa.Table, advantages: pa.Table) -> pa.Table:
    """Join steps with one method's advantages and lay each trajectory out flat."""
    methods = pc.unique(advantages.column("method")).to_pylist()
    if len(methods) > 1:
        raise ValueError(f"build_train_batch expects one method, got {methods}")
    method = methods[0] if methods else ""  # no rows (a batch without steps): an empty layout
    steps, s_keys = _in_step_order(steps)
    adv, a_keys = _in_step_order(advantages)
    if not s_keys.equals(a_keys):
        raise ValueError(f"advantages of method {method!r} do not cover the same steps as the steps table")
    lengths = pc.list_value_length(steps.column("token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    adv_len = pc.list_value_length(adv.column("token_adv")).to_numpy(zero_copy_only=False).astype(np.int64)
    if not np.array_equal(lengths, adv_len):
        row = int(np.flatnonzero(lengths != adv_len)[0])
        raise ValueError(f"token_adv of {adv.column('traj_id')[row]} step {adv.column('step_idx')[row]} is misaligned")
    traj_ids = steps.column("traj_id").to_numpy(zero_copy_only=False)
    change = np.flatnonzero(traj_ids[1:] != traj_ids[:-1]) + 1 if len(traj_ids) else np.array([], dtype=np.int64)
    step_starts = np.concatenate([[0], change]).astype(np.int64) if len(traj_ids) else np.array([], np.int64)
    tok_cum = np.concatenate([[0], np.cumsum(lengths)])
    traj_offsets = np.concatenate([tok_cum[step_starts], [tok_cum[-1]]]) if len(traj_ids) else np.array([0])
    traj_order = traj_ids[step_starts] if len(traj_ids) else np.array([], dtype=object)

    is_asst = pc.equal(steps.column("role"), "assistant").to_numpy(zero_copy_only=False)
    tok_mask = np.repeat(is_asst, lengths).astype(np.int8)
    turns = pc.fill_null(steps.column("turn"), 0).to_numpy(zero_copy_only=False).astype(np.int16)
    tok_turn = np.where(tok_mask == 1, np.repeat(turns, lengths), 0).astype(np.int16)
    off = pa.array(traj_offsets.astype(np.int32))

    traj = pl.from_arrow(trajectories.select(["traj_id", "group_id", "reward"]))
    meta = pl.DataFrame({"traj_id": pl.Series(traj_order, dtype=pl.String)}).join(traj, on="traj_id", how="left")
    has_returns = adv.column("token_returns").null_count < adv.num_rows
    has_values = steps.column("values").null_count < steps.num_rows
    round_col = adv.column("round")[0].as_py() if adv.num_rows else 0
    out = {
        "round": pa.array(np.full(len(traj_order), round_col, np.int32)),
        "method": pa.array([method] * len(traj_order), pa.string()),
        "traj_id": pa.array(traj_order, pa.string()),
        "group_id": meta["group_id"].to_arrow().cast(pa.string()),
        "reward": meta["reward"].to_arrow().cast(pa.float64()),
        "input_ids": _recut(steps.column("token_ids"), traj_offsets, pa.int32()),
        "loss_mask": pa.ListArray.from_arrays(off, pa.array(tok_mask)),
        "old_logprobs": _recut(steps.column("logprobs"), traj_offsets, pa.float32(), lengths=lengths),
        "advantages": _recut(adv.column("token_adv"), traj_offsets, pa.float32()),
        "values": _recut(steps.column("values"), traj_offsets, pa.float32(), lengths=lengths)
        if has_values and has_returns
        else pa.nulls(len(traj_order), pa.list_(pa.float32())),
        "returns": _recut(adv.column("token_returns"), traj_offsets, pa.float32(), lengths=lengths)
        if has_returns
        else pa.nulls(len(traj_order), pa.list_(pa.float32())),
        "turn_ids": pa.ListArray.from_arrays(off, pa.array(tok_turn)),
    }
    return pa.table(out)
