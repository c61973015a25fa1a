"""Export: one row per (method, trajectory) in the flat layout external trainers consume. This stage is the one
producer of the `train_batch` table; `creditflow export` and the trainer loop read it (warehouse/exports.py).

Steps are concatenated per trajectory with whole-column list operations: the step lists are flattened
once and re-cut at trajectory boundaries."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.stages import NO_IO, StageIO, StageOutput, batch_stage, method_key

EXPORT = "export"


def _recut(
    steps_col: pa.ChunkedArray | pa.Array,
    traj_offsets: np.ndarray,
    dtype: pa.DataType,
    fill: float = 0.0,
    lengths: np.ndarray | None = None,
) -> pa.Array:
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
    keys = pl.DataFrame(table.select(["traj_id", "step_idx"]))
    if keys.height > 1:
        tid, idx = keys["traj_id"], keys["step_idx"]
        same = tid.slice(1) == tid.slice(0, keys.height - 1)
        ordered = tid.is_sorted() and not (same & (idx.slice(1) <= idx.slice(0, keys.height - 1))).any()
        if not ordered:
            table = table.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
            keys = pl.DataFrame(table.select(["traj_id", "step_idx"]))
    return table, keys


# the steps columns the layout reads (content, offsets and tool calls stay on disk)
STEP_COLUMNS = ["traj_id", "step_idx", "role", "turn", "token_ids", "logprobs", "values"]


class TrainLayout:
    """The flat per-trajectory layout of one batch's steps, built once and shared by every method: the
    step order, token offsets, input ids, loss mask, behaviour logprobs, turn ids and trajectory metadata
    do not depend on the method, only the advantages (and returns) do. `table(advantages)` lays out one
    method's advantages on it; `build_train_batch` is the one-method shorthand."""

    def __init__(self, trajectories: pa.Table, steps: pa.Table) -> None:
        steps, self._keys = _in_step_order(steps)
        self._steps = steps
        self.lengths = (
            pc.list_value_length(steps.column("token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
        )
        traj_ids = steps.column("traj_id").to_numpy(zero_copy_only=False)
        n = len(traj_ids)
        change = np.flatnonzero(traj_ids[1:] != traj_ids[:-1]) + 1 if n else np.array([], dtype=np.int64)
        step_starts = np.concatenate([[0], change]).astype(np.int64) if n else np.array([], np.int64)
        tok_cum = np.concatenate([[0], np.cumsum(self.lengths)])
        self.traj_offsets = np.concatenate([tok_cum[step_starts], [tok_cum[-1]]]) if n else np.array([0])
        self.traj_order = traj_ids[step_starts] if n else np.array([], dtype=object)
        off = pa.array(self.traj_offsets.astype(np.int32))

        is_asst = pc.equal(steps.column("role"), "assistant").to_numpy(zero_copy_only=False)
        tok_mask = np.repeat(is_asst, self.lengths).astype(np.int8)
        # a row's behaviour logprobs are known when every assistant step carries them (else 0-filled: a
        # trainer must not take them for the sampling policy's, `trainer.trl_credit`)
        known_step = ~is_asst | steps.column("logprobs").is_valid().to_numpy(zero_copy_only=False)
        logprobs_known = np.logical_and.reduceat(known_step, step_starts) if n else np.array([], dtype=bool)
        turns = pc.fill_null(steps.column("turn"), 0).to_numpy(zero_copy_only=False).astype(np.int16)
        tok_turn = np.where(tok_mask == 1, np.repeat(turns, self.lengths), 0).astype(np.int16)
        traj = pl.DataFrame(trajectories.select(["traj_id", "group_id", "reward"]))
        meta = pl.DataFrame({"traj_id": pl.Series(self.traj_order, dtype=pl.String)}).join(
            traj, on="traj_id", how="left"
        )
        k = len(self.traj_order)
        self._common = {
            "traj_id": pa.array(self.traj_order, pa.string()),
            "group_id": meta["group_id"].to_arrow().cast(pa.string()),
            "reward": meta["reward"].to_arrow().cast(pa.float64()),
            "input_ids": _recut(steps.column("token_ids"), self.traj_offsets, pa.int32()),
            "loss_mask": pa.ListArray.from_arrays(off, pa.array(tok_mask)),
            "old_logprobs": _recut(
                steps.column("logprobs"), self.traj_offsets, pa.float32(), lengths=self.lengths
            ),
            "turn_ids": pa.ListArray.from_arrays(off, pa.array(tok_turn)),
            "logprobs_known": pa.array(logprobs_known, pa.bool_()),
        }
        self._has_values = steps.column("values").null_count < steps.num_rows
        self._values: pa.Array | None = None  # cut on first use: only methods with returns carry values
        self._no_floats = pa.nulls(k, pa.list_(pa.float32()))

    def _values_column(self) -> pa.Array:
        if self._values is None:
            self._values = (
                _recut(self._steps.column("values"), self.traj_offsets, pa.float32(), lengths=self.lengths)
                if self._has_values
                else self._no_floats
            )
        return self._values

    def table(self, advantages: pa.Table) -> pa.Table:
        """One method's advantages (its `advantages` rows for these steps) in the flat layout."""
        methods = pc.unique(advantages.column("method")).to_pylist()
        if len(methods) > 1:
            raise ValueError(f"build_train_batch expects one method, got {methods}")
        method = methods[0] if methods else ""  # no rows (a batch without steps): an empty layout
        adv, a_keys = _in_step_order(advantages)
        if not self._keys.equals(a_keys):
            raise ValueError(
                f"advantages of method {method!r} do not cover the same steps as the steps table"
            )
        adv_len = (
            pc.list_value_length(adv.column("token_adv")).to_numpy(zero_copy_only=False).astype(np.int64)
        )
        if not np.array_equal(self.lengths, adv_len):
            row = int(np.flatnonzero(self.lengths != adv_len)[0])
            raise ValueError(
                f"token_adv of {adv.column('traj_id')[row]} step {adv.column('step_idx')[row]} is misaligned"
            )
        has_returns = adv.column("token_returns").null_count < adv.num_rows
        round_col = adv.column("round")[0].as_py() if adv.num_rows else 0
        k = len(self.traj_order)
        c = self._common
        out = {
            "round": pa.array(np.full(k, round_col, np.int32)),
            "method": pa.array([method] * k, pa.string()),
            "traj_id": c["traj_id"],
            "group_id": c["group_id"],
            "reward": c["reward"],
            "input_ids": c["input_ids"],
            "loss_mask": c["loss_mask"],
            "old_logprobs": c["old_logprobs"],
            "advantages": _recut(adv.column("token_adv"), self.traj_offsets, pa.float32()),
            "values": self._values_column() if has_returns else self._no_floats,
            "returns": _recut(
                adv.column("token_returns"), self.traj_offsets, pa.float32(), lengths=self.lengths
            )
            if has_returns
            else self._no_floats,
            "turn_ids": c["turn_ids"],
            "logprobs_known": c["logprobs_known"],
        }
        return pa.table(out)


def build_train_batch(trajectories: pa.Table, steps: pa.Table, advantages: pa.Table) -> pa.Table:
    """Join steps with one method's advantages and lay each trajectory out flat (what the stage writes for one
    method, computed whole: tests and benchmarks compare against it)."""
    return TrainLayout(trajectories, steps).table(advantages)


@batch_stage(
    EXPORT,
    order=60,
    produces_per_method=("train_batch",),
    needs_per_method=("advantages",),
    step_columns=STEP_COLUMNS,
    methods=lambda config: list(config.methods),
    runs_if=lambda config: bool(config.flow.export),
    code=("pipeline/export.py", "schemas/train_batch.py"),
)
def export(
    trajectories: pa.Table, steps: pa.Table, config, inputs: dict[str, pa.Table], io: StageIO = NO_IO
) -> StageOutput:
    """The flat per-trajectory training layout of every method on one batch (one layout, shared)."""
    layout = TrainLayout(trajectories, steps)  # what every method shares, built once
    return StageOutput(
        {
            method_key("train_batch", m): layout.table(inputs[method_key("advantages", m)])
            for m in config.methods
        }
    )
