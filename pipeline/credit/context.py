"""The columnar view of one batch of whole groups that every estimator and refiner reads.

Tokens of all steps are laid end to end in (traj_id, step_idx) order; per-token NumPy arrays say which
step and trajectory a token belongs to, whether it is an assistant token (the loss mask), and carry the
behaviour logprobs and critic values (NaN where unknown). Per-step and per-trajectory columns stay in
Polars frames. Estimators are whole-column passes over these arrays, never Python loops over tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.credit.ops import Moments
from pipeline.settings import default_settings

if TYPE_CHECKING:
    from pipeline.config import Config


def _flat_list_floats(col: pa.ChunkedArray, starts: np.ndarray, n_tokens: int) -> np.ndarray:
    """Flatten a nullable list<float> column into a per-token array (NaN where the list is null)."""
    out = np.full(n_tokens, np.nan, dtype=np.float64)
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count == len(arr):
        return out
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.float64)
    if len(values) == 0:
        return out
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
    token_lengths = np.diff(np.append(starts, n_tokens))
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    if np.array_equal(np.where(valid, token_lengths, 0), lengths):
        # fast path: every non-null list has one value per token of its step
        out[np.repeat(valid, token_lengths)] = values
        return out
    parents = pc.list_parent_indices(arr).to_numpy()
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
    # position of each value inside its own list
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    local = np.arange(len(values)) - first[parents]
    out[starts[parents] + local] = values
    return out


class _Deferred:
    """A per-token array computed on first use (a method that never reads it never pays for it)."""

    __slots__ = ("make", "lists")

    def __init__(
        self, make: Callable[[], np.ndarray], lists: tuple[pa.ChunkedArray, np.ndarray, int] | None = None
    ) -> None:
        self.make = make
        self.lists = lists  # (list column, step token starts, n_tokens): lets values_at read a few tokens


def _list_values_at(
    col: pa.ChunkedArray, starts: np.ndarray, n_tokens: int, positions: np.ndarray
) -> np.ndarray | None:
    """`_flat_list_floats(col, starts, n_tokens)[positions]` without building the per-token array, when every
    non-null list has one value per token of its step (else None: the caller flattens)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    positions = np.asarray(positions, dtype=np.int64)
    if arr.null_count == len(arr):
        return np.full(len(positions), np.nan)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
    token_lengths = np.diff(np.append(starts, n_tokens))
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    if not np.array_equal(np.where(valid, token_lengths, 0), lengths):
        return None
    offsets = arr.offsets.to_numpy()[:-1].astype(np.int64)  # value offset of each step's list
    values = arr.values.to_numpy(zero_copy_only=False)
    step = np.searchsorted(starts, positions, side="right") - 1
    ok = valid[step]
    out = np.full(len(positions), np.nan)
    out[ok] = values[offsets[step[ok]] + positions[ok] - starts[step[ok]]]
    return out


def _list_values_on_rows(col: pa.ChunkedArray, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
    """The values of the lists at `rows` (increasing), end to end, when none is null and each has `lengths`
    values (else None: the caller flattens the whole column). A mask over the flat values, no take of the lists."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    rows = np.asarray(rows, dtype=np.int64)
    if arr.null_count and not arr.is_valid().to_numpy(zero_copy_only=False)[rows].all():
        return None
    offsets = arr.offsets.to_numpy().astype(np.int64)
    list_len = np.diff(offsets)
    if not np.array_equal(list_len[rows], lengths):
        return None
    flat = arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    if len(rows) == len(arr):  # every list (an all-assistant batch): the flat values as they are
        return flat.astype(np.float64)
    chosen = np.zeros(len(arr), dtype=bool)
    chosen[rows] = True
    return flat[np.repeat(chosen, list_len)].astype(np.float64)


def _deferred(make, lists=None) -> Any:
    """A `_Deferred` where a per-token array field is expected (its `_LazyArray` computes it on first read)."""
    return _Deferred(make, lists)


class _LazyArray:
    """Dataclass field descriptor: stores the value in the instance dict; a `_Deferred` is computed on first read
    and replaced by its result."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return None  # the field's default
        value = obj.__dict__.get(self.name)
        if isinstance(value, _Deferred):
            value = obj.__dict__[self.name] = value.make()
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = value


def _sorted_by_traj_step(steps: pa.Table) -> bool:
    if steps.num_rows < 2:
        return True
    keys = pl.DataFrame(steps.select(["traj_id", "step_idx"]))
    tid, idx = keys["traj_id"], keys["step_idx"]
    prev_tid, prev_idx = tid.shift(1), idx.shift(1)
    ok = (tid > prev_tid) | ((tid == prev_tid) & (idx > prev_idx))
    return bool(ok.slice(1).all())


@dataclass
class CreditContext:
    trajectories: pl.DataFrame  # one row per trajectory, sorted by traj_id; traj_index, group_index
    steps: pl.DataFrame  # one row per step, sorted by (traj_index, step_idx); tok_start, n_tokens
    # int64 step row / trajectory row of each token (from_arrow builds them on first use)
    tok_step: np.ndarray = _LazyArray()  # type: ignore[assignment]
    tok_traj: np.ndarray = _LazyArray()  # type: ignore[assignment]
    tok_mask: np.ndarray = _LazyArray()  # type: ignore[assignment]  # bool: assistant token (gets credit, in the loss)
    # float64 behaviour logprob / critic value, NaN where unknown; built from the steps' list columns on first use
    tok_logprob: np.ndarray = _LazyArray()  # type: ignore[assignment]
    tok_value: np.ndarray = _LazyArray()  # type: ignore[assignment]
    config: Config | None = None  # the run's settings (None: every stage's defaults)
    annotations: dict[str, pl.DataFrame] = field(default_factory=dict)
    round: int = 0
    # batch-level statistics (whitening) by key: the round's moments, merged over every batch by the statistics
    # pass (each estimator's declared `RoundStatistics.fn`) and given to the credit pass (None: this batch is
    # the whole round)
    round_stats: dict[str, Moments] | None = None

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_arrow(
        cls,
        trajectories: pa.Table,
        steps: pa.Table,
        config: Config | None = None,
        annotations: dict[str, pa.Table | pl.DataFrame] | None = None,
        round_: int = 0,
        round_stats: dict[str, Moments] | None = None,
    ) -> CreditContext:
        traj_cols = [c for c in trajectories.column_names if c != "reward_components"]
        traj = pl.DataFrame(trajectories.select(traj_cols)).sort("traj_id")
        if "reward_components" in trajectories.column_names:
            # map<string, double> as list<struct<key, value>> (columnar; GDPO explodes it)
            rc = trajectories.sort_by("traj_id").column("reward_components").combine_chunks()
            rc = pa.ListArray.from_arrays(rc.offsets, rc.values, mask=rc.is_null())
            traj = traj.with_columns(pl.Series("reward_components", rc))
        traj = traj.with_columns(
            pl.int_range(pl.len(), dtype=pl.Int64).alias("traj_index"),
            pl.col("group_id").rank("dense").cast(pl.Int64).sub(1).alias("group_index"),
        )
        for name, typ in (
            ("logprobs", pa.list_(pa.float32())),
            ("values", pa.list_(pa.float32())),
            ("verifier_score", pa.float64()),
            ("turn", pa.int32()),
        ):
            if name not in steps.column_names:  # optional columns of in-memory tables
                steps = steps.append_column(name, pa.nulls(steps.num_rows, typ))
        if not _sorted_by_traj_step(steps):  # ingest and synth write steps in order: skip the big take
            steps = steps.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
        lengths = (
            pc.list_value_length(steps.column("token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
        )
        starts = (np.cumsum(lengths) - lengths).astype(np.int64)
        n_tokens = int(lengths.sum())
        scalar_cols = [
            c
            for c in steps.column_names
            if c not in ("token_ids", "token_offsets", "logprobs", "values", "round")
        ]
        step_frame = pl.DataFrame(steps.select(scalar_cols)).with_columns(
            pl.Series("n_tokens", lengths), pl.Series("tok_start", starts)
        )
        step_frame = step_frame.join(
            traj.select("traj_id", "traj_index", "group_index"), on="traj_id", how="left"
        )
        if step_frame["traj_index"].null_count():
            bad = step_frame.filter(pl.col("traj_index").is_null())["traj_id"][0]
            raise ValueError(f"steps: traj_id {bad!r} has no row in trajectories")
        step_frame = step_frame.with_columns((pl.col("role") == "assistant").alias("is_assistant"))
        step_traj = step_frame["traj_index"].to_numpy().astype(np.int64)
        # per-token arrays as runs of per-step values (np.repeat: sequential copies, no gathers)
        tok_step = _deferred(lambda: np.repeat(np.arange(len(lengths), dtype=np.int64), lengths))
        tok_traj = _deferred(lambda: np.repeat(step_traj, lengths))
        tok_mask = np.repeat(step_frame["is_assistant"].to_numpy(), lengths)
        lp_col, v_col = steps.column("logprobs"), steps.column("values")
        tok_logprob = _deferred(
            lambda: _flat_list_floats(lp_col, starts, n_tokens), (lp_col, starts, n_tokens)
        )
        tok_value = _deferred(lambda: _flat_list_floats(v_col, starts, n_tokens), (v_col, starts, n_tokens))
        anns: dict[str, pl.DataFrame] = {}
        for name, t in (annotations or {}).items():
            anns[name] = t if isinstance(t, pl.DataFrame) else pl.DataFrame(t)
        return cls(
            trajectories=traj,
            steps=step_frame,
            tok_step=tok_step,
            tok_traj=tok_traj,
            tok_mask=tok_mask,
            tok_logprob=tok_logprob,
            tok_value=tok_value,
            config=config,
            annotations=anns,
            round=round_,
            round_stats=round_stats,
        )

    # ---- sizes and indices ----------------------------------------------------------------------
    @property
    def n_traj(self) -> int:
        return self.trajectories.height

    @property
    def n_steps(self) -> int:
        return self.steps.height

    @property
    def n_tokens(self) -> int:
        return len(self.tok_mask)

    @property
    def n_groups(self) -> int:
        return int(self.trajectories.select(pl.col("group_index").max()).item()) + 1 if self.n_traj else 0

    @property
    def traj_group(self) -> np.ndarray:
        return self.trajectories["group_index"].to_numpy()

    @property
    def step_traj(self) -> np.ndarray:
        return self.steps["traj_index"].to_numpy()

    @property
    def step_offsets(self) -> np.ndarray:
        """Token offsets of steps: tokens of step s are [off[s], off[s+1])."""
        return np.concatenate([self.steps["tok_start"].to_numpy(), [self.n_tokens]]).astype(np.int64)

    def rewards(self) -> np.ndarray:
        return self.trajectories["reward"].to_numpy().astype(np.float64)

    def stage(self, name: str):
        """The settings model of stage `name`: the run's, or its defaults when the batch has no config."""
        return self.config.stage(name) if self.config is not None else default_settings(name)

    def moments(
        self, key: str, values: np.ndarray, weights: np.ndarray | None = None, scope: str = "round"
    ) -> Moments:
        """The moments a batch-level statistic `key` (a method's whitening) is taken over: the round's when
        `scope="round"` (this batch's own when no round statistics were given: the batch is the round), this
        batch's when `scope="batch"`. The round's are the merged moments of the estimator's declared statistics
        function (registry.RoundStatistics) over every batch."""
        if scope == "batch" or self.round_stats is None:
            return Moments.of(values, weights)
        if key not in self.round_stats:
            raise ValueError(
                f"round statistics lack {key!r} (have {sorted(self.round_stats)}): run the statistics pass "
                "(pipeline.credit.process.batch_statistics) over every batch of the round first"
            )
        return self.round_stats[key]

    # ---- broadcasting ---------------------------------------------------------------------------
    def broadcast_traj(self, per_traj: np.ndarray) -> np.ndarray:
        """A per-trajectory value on every assistant token of the trajectory (0 elsewhere)."""
        return self.broadcast_step(np.asarray(per_traj, dtype=np.float64)[self.step_traj])

    def broadcast_step(self, per_step: np.ndarray) -> np.ndarray:
        """A per-step value on every assistant token of the step (0 elsewhere)."""
        # tokens of a step are contiguous: repeat each step's value (0 off the assistant steps) over its tokens
        per_step = np.where(
            self.steps["is_assistant"].to_numpy(), np.asarray(per_step, dtype=np.float64), 0.0
        )
        return np.repeat(per_step, self.steps["n_tokens"].to_numpy())

    def traj_to_steps(self, per_traj: np.ndarray) -> np.ndarray:
        return np.asarray(per_traj, dtype=np.float64)[self.step_traj]

    def assistant_steps(self) -> pl.DataFrame:
        """Assistant steps with their row index (`step_row`), in (trajectory, turn) order."""
        return self.steps.with_row_index("step_row").filter(pl.col("is_assistant"))

    def values_at(self, name: str, positions: np.ndarray) -> np.ndarray:
        """`getattr(self, name)[positions]` for a per-token array (`tok_logprob`, `tok_value`); while it has not
        been built, reads just those tokens from the steps' list column (O(positions), for span-local work)."""
        raw = self.__dict__.get(name)
        if isinstance(raw, _Deferred) and raw.lists is not None:
            out = _list_values_at(*raw.lists, positions)
            if out is not None:
                return out
        return getattr(self, name)[positions]

    def mask_values(self, name: str) -> np.ndarray:
        """`getattr(self, name)[self.tok_mask]`: a per-token array (`tok_logprob`, `tok_value`) on the assistant
        tokens, in order; while it has not been built, read from the assistant steps' lists alone when each holds
        one value per token (no per-token array of the whole batch)."""
        raw = self.__dict__.get(name)
        if isinstance(raw, _Deferred) and raw.lists is not None:
            n_tok = self.steps["n_tokens"].to_numpy()
            rows = np.flatnonzero(self.steps["is_assistant"].to_numpy() & (n_tok > 0))
            out = _list_values_on_rows(raw.lists[0], rows, n_tok[rows])
            if out is not None:
                return out
        return getattr(self, name)[self.tok_mask]

    def names(self, key: str, names: list[str], scope: str = "round") -> list[str]:
        """The names a method finds in its batch (GDPO's reward components), or those of the whole round
        (`scope="round"` with round statistics: recorded by its statistics function as keys `key:name`)."""
        if scope == "batch" or self.round_stats is None:
            return list(names)
        prefix = f"{key}:"
        return sorted(k[len(prefix) :] for k in self.round_stats if k.startswith(prefix))

    def annotation(self, name: str) -> pl.DataFrame | None:
        return self.annotations.get(name)


@dataclass
class CreditResult:
    """Token advantages (flat, aligned with the context's tokens), the returns (critic targets) where the method
    has them, and the per-step components. One type, laid out three ways by what the estimator computes:

    - `CreditResult.per_step(ctx, step_adv, ...)`: an advantage constant over each step's tokens (GRPO, RLOO,
      GDPO, MT-GRPO, GiGPO, turn PPO, ...), `step_returns` likewise;
    - `CreditResult.on_mask(ctx, mask_adv, ...)`: values on the assistant tokens only, in token order (GAE);
    - `CreditResult(token_adv, ...)`: a per-token array (the refiners).

    The per-token arrays of the first two are built only if something reads `token_adv` / `token_returns` (a
    refiner); the advantages table lays the step or mask values straight into its float32 list columns."""

    token_adv: np.ndarray = _LazyArray()  # type: ignore[assignment]
    components: dict[str, np.ndarray] = field(default_factory=dict)  # per step row; NaN = null
    token_returns: np.ndarray | None = _LazyArray()  # type: ignore[assignment]
    notes: dict[str, float] = field(default_factory=dict)  # counts for the summary (fallbacks, ...)
    # per step row (0 on non-assistant steps) when token_adv is that value on each of the step's tokens; set only
    # by per_step and carried by with_components, so step_adv present means token_adv == its broadcast
    step_adv: np.ndarray | None = None
    step_returns: np.ndarray | None = None  # likewise for token_returns
    # on the assistant tokens (ctx.tok_mask's order) when token_adv is 0 elsewhere: set only by on_mask
    mask_adv: np.ndarray | None = None
    mask_returns: np.ndarray | None = None

    @classmethod
    def per_step(
        cls,
        ctx: CreditContext,
        step_adv: np.ndarray,
        components: dict[str, np.ndarray] | None = None,
        notes: dict[str, float] | None = None,
        token_returns: np.ndarray | None = None,
        step_returns: np.ndarray | None = None,
    ) -> CreditResult:
        """A per-step advantage (and return) on every assistant token of the step (0 elsewhere);
        `ctx.broadcast_step` of it is `token_adv` (`token_returns`), built on first read."""
        is_asst = ctx.steps["is_assistant"].to_numpy()
        per_step = np.where(is_asst, np.asarray(step_adv, dtype=np.float64), 0.0)
        lengths = ctx.steps["n_tokens"].to_numpy()
        returns: np.ndarray | _Deferred | None = token_returns
        step_ret = None
        if step_returns is not None:
            step_ret = np.where(is_asst, np.asarray(step_returns, dtype=np.float64), 0.0)
            returns = _Deferred(lambda: np.repeat(step_ret, lengths))
        return cls(
            _deferred(lambda: np.repeat(per_step, lengths)),
            dict(components or {}),
            returns,  # type: ignore[arg-type]
            dict(notes or {}),
            per_step,
            step_ret,
        )

    @classmethod
    def on_mask(
        cls,
        ctx: CreditContext,
        mask_adv: np.ndarray,
        components: dict[str, np.ndarray] | None = None,
        notes: dict[str, float] | None = None,
        mask_returns: np.ndarray | None = None,
    ) -> CreditResult:
        """Values on the assistant tokens (ctx.tok_mask's order), 0 on the others; the per-token arrays are
        built on first read."""
        mask_adv = np.asarray(mask_adv, dtype=np.float64)
        returns = None if mask_returns is None else _Deferred(lambda: _on_tokens(ctx, mask_returns))
        return cls(
            _deferred(lambda: _on_tokens(ctx, mask_adv)),
            dict(components or {}),
            returns,  # type: ignore[arg-type]
            dict(notes or {}),
            mask_adv=mask_adv,
            mask_returns=None if mask_returns is None else np.asarray(mask_returns, dtype=np.float64),
        )

    def raw_token_adv(self):
        """token_adv as stored: the array, or its deferred builder (not built by this call)."""
        return self.__dict__.get("token_adv")

    def with_components(self, **comps: np.ndarray) -> CreditResult:
        return CreditResult(
            self.raw_token_adv(),
            {**self.components, **comps},
            self.__dict__.get("token_returns"),
            dict(self.notes),
            self.step_adv,
            self.step_returns,
            self.mask_adv,
            self.mask_returns,
        )


def _on_tokens(ctx: CreditContext, on_mask: np.ndarray) -> np.ndarray:
    """A per-token array: `on_mask` on the assistant tokens, 0 elsewhere."""
    out = np.zeros(ctx.n_tokens)
    out[ctx.tok_mask] = on_mask
    return out
