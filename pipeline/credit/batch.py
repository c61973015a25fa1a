"""The credit batch: the frozen, columnar view of one batch of whole groups that every estimator and refiner
reads.

`CreditBatch.from_arrow` builds it once, whole-column, from the Arrow tables: tokens of all steps laid end to
end in (traj_id, step_idx) order, each step's trajectory, group, tokens and first token as NumPy arrays, and the
per-token float columns its methods declare (`logprobs`, `values`: `TokenFloats`, typed accessors, NaN where
unknown). The rows stay in their Arrow tables; what is derived from them on a method's first ask is kept (the
assistant-token mask, the loss mask: `tok_mask`; the Polars frames `trajectories` and `steps`): a per-step
estimator and the advantages table ask for none of them. Per-token indices (`token_steps`, `mask_steps`, ...)
are explicit methods that build their array on each call: a method that never asks never pays for them.
Estimators are whole-column passes over these arrays, never Python loops over tokens. What they return:
pipeline/credit/result.py."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.credit.ops import Moments
from pipeline.settings import StageSettings, named_settings
from schemas import one_chunk, strictly_increasing

if TYPE_CHECKING:
    from pipeline.config import Config

S = TypeVar("S", bound=StageSettings)


def _flat_list_floats(arr: pa.Array, starts: np.ndarray, n_tokens: int) -> np.ndarray:
    """A nullable list<float> column as a per-token float64 array (NaN where the list is null), for lists that
    are not one value per token of their step (a value past its step's tokens lands where its position says)."""
    out = np.full(n_tokens, np.nan, dtype=np.float64)
    if arr.null_count == len(arr):
        return out
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.float64)
    if len(values) == 0:
        return out
    parents = pc.list_parent_indices(arr).to_numpy()
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # position of each value inside its own list
    local = np.arange(len(values)) - first[parents]
    out[starts[parents] + local] = values
    return out


@dataclass(frozen=True, slots=True)
class TokenFloats:
    """A per-token float column of the steps (`logprobs`, `values`), read once from its Arrow list column:
    the lists' values as stored, end to end, and where each step's list starts in them. Read it on the
    assistant tokens (`on_mask`), at a few token positions (`at`) or as a whole per-token array (`per_token`);
    each gives float64, NaN where the step's list is null (unknown)."""

    values: np.ndarray  # the lists' values as stored (the list array's child; float32 as written)
    offsets: np.ndarray  # int64, n_steps + 1: step s's values are values[offsets[s]:offsets[s + 1]]
    valid: np.ndarray  # bool per step: its list is not null
    starts: np.ndarray  # int64 per step: its first token
    token_counts: np.ndarray  # int64 per step: its tokens
    mask_rows: np.ndarray  # the assistant steps with tokens: their tokens are the mask's, in order
    # float64 per token, built by `read` only when some list is not one value per token of its step (then every
    # accessor reads it); None when each is (the accessors read the lists)
    dense: np.ndarray | None

    @classmethod
    def read(
        cls,
        col: pa.ChunkedArray | pa.Array,
        starts: np.ndarray,
        token_counts: np.ndarray,
        mask_rows: np.ndarray,
    ) -> TokenFloats:
        arr = one_chunk(col)
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
        aligned = np.array_equal(np.where(valid, token_counts, 0), lengths)
        n_tokens = int(token_counts.sum())
        return cls(
            arr.values.to_numpy(zero_copy_only=False),
            arr.offsets.to_numpy().astype(np.int64),
            valid,
            starts,
            token_counts,
            mask_rows,
            None if aligned else _flat_list_floats(arr, starts, n_tokens),
        )

    @classmethod
    def unknown(cls, starts: np.ndarray, token_counts: np.ndarray, mask_rows: np.ndarray) -> TokenFloats:
        """A column no method of the batch declares: every list null (NaN on every token), nothing read."""
        n = len(starts)
        return cls(
            np.zeros(0, np.float32),
            np.zeros(n + 1, np.int64),
            np.zeros(n, bool),
            starts,
            token_counts,
            mask_rows,
            None,
        )

    @property
    def n_tokens(self) -> int:
        return int(self.starts[-1] + self.token_counts[-1]) if len(self.starts) else 0

    def per_token(self) -> np.ndarray:
        """The whole per-token float64 array (NaN where unknown): O(tokens), built on each call."""
        if self.dense is not None:
            return self.dense
        out = np.full(self.n_tokens, np.nan, dtype=np.float64)
        if not self.valid.any():
            return out
        lo, hi = int(self.offsets[0]), int(self.offsets[-1])
        # the valid lists' values, end to end (each holds one value per token of its step)
        flat = self.values[lo:hi][np.repeat(self.valid, np.diff(self.offsets))]
        if len(flat):
            out[np.repeat(self.valid, self.token_counts)] = flat.astype(np.float64)
        return out

    def at(self, positions: np.ndarray) -> np.ndarray:
        """`per_token()[positions]` read from the lists, O(positions) (span-local work, a turn's first token)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.dense is not None:
            return self.dense[positions]
        if not self.valid.any():
            return np.full(len(positions), np.nan)
        step = np.searchsorted(self.starts, positions, side="right") - 1
        ok = self.valid[step]
        out = np.full(len(positions), np.nan)
        out[ok] = self.values[self.offsets[step[ok]] + positions[ok] - self.starts[step[ok]]]
        return out

    def on_mask(self) -> np.ndarray:
        """`per_token()[tok_mask]`: the values on the assistant tokens, in order, read from the assistant steps'
        lists alone when each is present with one value per token (no per-token array of the whole batch)."""
        rows, list_len = self.mask_rows, np.diff(self.offsets)
        chosen = np.zeros(len(self.valid), dtype=bool)
        chosen[rows] = True  # the assistant steps with tokens: their tokens are the mask's, in order
        if self.valid[rows].all() and np.array_equal(list_len[rows], self.token_counts[rows]):
            flat = self.values[int(self.offsets[0]) : int(self.offsets[-1])]
            if len(rows) == len(self.valid) or not list_len[~chosen].any():
                # every list is an assistant step's (an all-assistant batch), or the other steps' lists take no
                # values (critic values on the response tokens alone, as verl's are): the values as they are
                return flat.astype(np.float64)
            return flat[np.repeat(chosen, list_len)].astype(np.float64)
        return self.per_token()[np.repeat(chosen, self.token_counts)]


def _step_lengths(steps: pa.Table) -> np.ndarray:
    """Tokens per step: the token ids' lengths where `steps` holds them (in-memory tables: the source of truth),
    else the lake's `n_tokens` (schemas.steps: computed on every write, derived on read for older parts)."""
    if "token_ids" in steps.column_names:
        col = pc.list_value_length(steps.column("token_ids"))
    else:
        col = steps.column("n_tokens")
        if col.null_count:
            row = pc.index(pc.is_null(col), True).as_py()
            raise ValueError(f"steps: field 'n_tokens' at row {row}: null (read it through the lake)")
    return col.to_numpy(zero_copy_only=False).astype(np.int64)


def _derived_from_sources(steps: pa.Table, columns: Collection[str]) -> pa.Table:
    """The steps' derived columns (schemas.steps: the values' per-step moments) computed again from their
    sources where the table holds both and the batch reads the derived column but not its sources: an in-memory
    table's (a caller's, or one whose values were replaced after it was built) may disagree with its values,
    which are the source of truth (the statistics pass of `process.batch_statistics` on a caller's tables). A
    lake read never holds the sources then (the lake computes the derived columns on every write). A batch that
    reads the sources too keeps the table's (credit's and a kept statistics pass's read from the lake: the same
    moments on both paths). `n_tokens`: `_step_lengths`."""
    from schemas import TABLES

    spec = TABLES["steps"]
    stale = [
        name
        for name, d in spec.derived.items()
        if name != "n_tokens"
        and name in steps.column_names
        and name in columns
        and all(src in steps.column_names for src in d.sources)
        and not all(src in columns for src in d.sources)
    ]
    for name, col in spec.derive(steps, stale).items():
        steps = steps.set_column(steps.schema.get_field_index(name), steps.schema.field(name), col)
    return steps


def _without_views(t: pa.DataType) -> pa.DataType:
    """`t` with every string or binary view in it (nested ones too) as a large string or binary."""
    if pa.types.is_string_view(t):
        return pa.large_string()
    if pa.types.is_binary_view(t):
        return pa.large_binary()
    if pa.types.is_map(t):
        return pa.map_(_without_views(t.key_type), t.item_field.with_type(_without_views(t.item_type)))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = t.value_field.with_type(_without_views(t.value_type))
        return pa.large_list(item) if pa.types.is_large_list(t) else pa.list_(item)
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_without_views(t.field(i).type)) for i in range(t.num_fields)])
    return t


def _plain_strings(table: pa.Table) -> pa.Table:
    """The table with its string and binary views, nested ones too, as large strings and binaries, where an
    in-memory table holds them (polars' export at its newest compatibility level: Arrow sorts, ranks and takes
    no views); else the table as it is."""
    schema = pa.schema(
        [f.with_type(_without_views(f.type)) for f in table.schema], metadata=table.schema.metadata
    )
    return table if schema.equals(table.schema) else table.cast(schema)


def _role_mask(steps: pa.Table, role: str) -> np.ndarray:
    """bool per step: its role is `role` (a null role is none)."""
    return pc.fill_null(pc.equal(steps.column("role"), role), False).to_numpy()


def _sorted_trajectories(trajectories: pa.Table) -> pa.Table:
    if not strictly_increasing(trajectories, ("traj_id",)):  # the lake's writers write them in order
        trajectories = trajectories.sort_by("traj_id")
    return trajectories


def _group_index(trajectories: pa.Table) -> np.ndarray:
    """int64 per trajectory row: its group's place among the batch's group ids in sorted order (0, 1, ...; equal
    ids one place), computed in Arrow (a dense rank: no frame). A null group id is an error naming its
    trajectory."""
    group_id = trajectories.column("group_id")
    if group_id.null_count:
        row = pc.index(pc.is_null(group_id), True).as_py()
        traj = trajectories.column("traj_id")[row].as_py()
        raise ValueError(f"trajectories: trajectory {traj!r}: field 'group_id' is null")
    return pc.rank(group_id, tiebreaker="dense").to_numpy().astype(np.int64) - 1


def _trajectory_frame(trajectories: pa.Table, group_index: np.ndarray) -> pl.DataFrame:
    """The trajectories as a Polars frame (rows sorted by traj_id) with their row (`traj_index`) and group
    (`group_index`); `reward_components` (map<string, double>) as list<struct<key, value>> (columnar; GDPO and
    MT-GRPO explode it)."""
    traj_cols = [c for c in trajectories.column_names if c != "reward_components"]
    columns = [
        pl.int_range(pl.len(), dtype=pl.Int64).alias("traj_index"),
        pl.Series("group_index", group_index),
    ]
    entries = _component_entries(trajectories)
    if entries is not None:
        columns.append(pl.lit(pl.Series("reward_components", entries)))
    return pl.DataFrame(trajectories.select(traj_cols)).with_columns(columns)


def _component_entries(trajectories: pa.Table) -> pa.ListArray | None:
    """`reward_components` (map<string, double>) as list<struct<key, value>>, null where the map is (None: the
    table has no such column)."""
    if "reward_components" not in trajectories.column_names:
        return None
    rc = one_chunk(trajectories.column("reward_components"))
    return pa.ListArray.from_arrays(rc.offsets, rc.values, mask=rc.is_null())


@dataclass(frozen=True, slots=True)
class CreditBatch:
    """One batch of whole groups, built once (`from_arrow`) and never changed. Its rows are Arrow tables and
    NumPy arrays; the Polars frames of them (`trajectories`, `steps`) are built on a method's first ask (the
    simple estimators and the advantages table never ask: no frame is built for them)."""

    traj_table: pa.Table  # one row per trajectory, sorted by traj_id (reward_components as read)
    step_table: pa.Table  # one row per step, sorted by (traj_id, step_idx): its scalar columns
    traj_group: np.ndarray  # int64 per trajectory: its group's index (dense, in group id order)
    step_traj: np.ndarray  # int64 per step: its trajectory's row
    step_tokens: np.ndarray  # int64 per step: its tokens
    step_starts: np.ndarray  # int64 per step: its first token
    step_is_assistant: np.ndarray  # bool per step: an assistant step
    logprobs: TokenFloats  # behaviour logprobs (steps.logprobs); all unknown unless a method declares them
    values: TokenFloats  # critic values (steps.values); all unknown unless a method declares them
    config: Config | None = None  # the run's settings (None: every stage's defaults)
    annotations: Mapping[str, pl.DataFrame] = field(default_factory=dict)
    round: int = 0
    # batch-level statistics (whitening) by key: the round's moments, merged over every batch by the statistics
    # pass (each estimator's declared `RoundStatistics.fn`) and given to the credit pass (None: this batch is
    # the whole round)
    round_stats: Mapping[str, Moments] | None = None
    # an estimator's intermediate of this batch for a later call on the same batch: the statistics pass's, for
    # credit of a kept batch (pipeline.credit.process.keeping_credit_batches; gae's Eq. 1-4); never the batch's data
    memo: dict[object, object] = field(default_factory=dict, compare=False, repr=False)
    # what is derived from the fields above on first ask (`tok_mask`, the frames `trajectories` and `steps`)
    derived: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_arrow(
        cls,
        trajectories: pa.Table,
        steps: pa.Table,
        columns: Collection[str] | None = None,
        config: Config | None = None,
        annotations: Mapping[str, pa.Table | pl.DataFrame] | None = None,
        round_: int = 0,
        round_stats: Mapping[str, Moments] | None = None,
        tokens: bool = True,
    ) -> CreditBatch:
        """The batch of these rows. `columns`: the steps columns its methods declare
        (registry.method_step_columns); a per-token float column (logprobs, values) is read only when declared,
        else it is all unknown. None: every such column the table holds (in-memory tables, tests).
        A step's tokens: its token ids where `steps` holds them (an in-memory table), else its `n_tokens` (what
        a lake read gives: the lake computes it on every write). `tokens=False`: the steps hold neither and the
        batch no tokens (every step 0 tokens long): for a statistics pass whose statistics read none
        (registry.RoundStatistics.tokens). A `steps` table without columns (the pass read none: no statistic
        reads the steps, `registry.statistics_step_columns`): a batch of the trajectories without steps."""
        trajectories, steps = _plain_strings(trajectories), _plain_strings(steps)
        trajectories = _sorted_trajectories(trajectories)
        traj_group = _group_index(trajectories)
        if not steps.column_names:  # a read of no columns: a statistics pass whose statistics read no steps
            steps = pa.table({"traj_id": pa.array([], pa.string()), "step_idx": pa.array([], pa.int32())})
            steps = steps.append_column("role", pa.array([], pa.string()))
        if columns is not None:  # (before the absent optional columns are filled with nulls)
            steps = _derived_from_sources(steps, columns)
        for name, typ in (
            ("logprobs", pa.list_(pa.float32())),
            ("values", pa.list_(pa.float32())),
            ("verifier_score", pa.float64()),
            ("turn", pa.int32()),
        ):
            if name not in steps.column_names:  # optional columns of in-memory tables
                steps = steps.append_column(name, pa.nulls(steps.num_rows, typ))
        # ingest and synth write steps in order: then no sort (the big take)
        if not strictly_increasing(steps, ("traj_id", "step_idx")):
            steps = steps.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
        lengths = _step_lengths(steps) if tokens else np.zeros(steps.num_rows, np.int64)
        starts = (np.cumsum(lengths) - lengths).astype(np.int64)
        scalar_cols = [
            c
            for c in steps.column_names
            if c not in ("token_ids", "token_offsets", "n_tokens", "logprobs", "values", "round")
        ]
        # each step's trajectory row: a lookup in the (unique, sorted) trajectory ids, not a join; the ids as the
        # steps type theirs
        ids = trajectories.column("traj_id").cast(steps.schema.field("traj_id").type)
        traj_index = pc.index_in(steps.column("traj_id"), value_set=ids)
        if traj_index.null_count:
            bad = steps.column("traj_id")[pc.index(pc.is_null(traj_index), True).as_py()].as_py()
            raise ValueError(f"steps: traj_id {bad!r} has no row in trajectories")
        step_traj = traj_index.to_numpy().astype(np.int64)
        is_assistant = _role_mask(steps, "assistant")
        mask_rows = np.flatnonzero(is_assistant & (lengths > 0))

        def token_floats(name: str) -> TokenFloats:
            if columns is None or name in columns:
                return TokenFloats.read(steps.column(name), starts, lengths, mask_rows)
            return TokenFloats.unknown(starts, lengths, mask_rows)

        anns = {
            name: t if isinstance(t, pl.DataFrame) else pl.DataFrame(t)
            for name, t in (annotations or {}).items()
        }
        return cls(
            traj_table=trajectories,
            step_table=steps.select(scalar_cols),
            traj_group=traj_group,
            step_traj=step_traj,
            step_tokens=lengths,
            step_starts=starts,
            step_is_assistant=is_assistant,
            logprobs=token_floats("logprobs"),
            values=token_floats("values"),
            config=config,
            annotations=anns,
            round=round_,
            round_stats=round_stats,
        )

    # ---- derived on first ask (kept) -------------------------------------------------------------
    @property
    def tok_mask(self) -> np.ndarray:
        """bool per token: an assistant token (gets credit, in the loss)."""
        mask = self.derived.get("tok_mask")
        if mask is None:
            # runs of per-step values: sequential copies, no gathers
            mask = self.derived["tok_mask"] = np.repeat(self.step_is_assistant, self.step_tokens)
        return cast(np.ndarray, mask)

    @property
    def mask_rows(self) -> np.ndarray:
        """The assistant steps with tokens (step rows, in order): their tokens are `tok_mask`'s, in order."""
        return self.values.mask_rows  # (built once by `from_arrow`, shared by both token columns)

    @property
    def trajectories(self) -> pl.DataFrame:
        """One row per trajectory, sorted by traj_id; traj_index, group_index."""
        frame = self.derived.get("trajectories")
        if frame is None:
            frame = self.derived["trajectories"] = _trajectory_frame(self.traj_table, self.traj_group)
        return cast(pl.DataFrame, frame)

    @property
    def steps(self) -> pl.DataFrame:
        """One row per step, sorted by (traj_index, step_idx); tok_start, n_tokens, traj_index, group_index,
        is_assistant."""
        frame = self.derived.get("steps")
        if frame is None:
            frame = self.derived["steps"] = pl.DataFrame(self.step_table).with_columns(
                pl.Series("n_tokens", self.step_tokens),
                pl.Series("tok_start", self.step_starts),
                pl.Series("traj_index", self.step_traj),
                pl.Series("group_index", self.traj_group[self.step_traj]),
                pl.Series("is_assistant", self.step_is_assistant),
            )
        return cast(pl.DataFrame, frame)

    # ---- sizes and indices ----------------------------------------------------------------------
    @property
    def n_traj(self) -> int:
        return self.traj_table.num_rows

    @property
    def n_steps(self) -> int:
        return len(self.step_traj)

    @property
    def n_tokens(self) -> int:
        return int(self.step_starts[-1] + self.step_tokens[-1]) if len(self.step_starts) else 0

    @property
    def n_groups(self) -> int:
        return int(self.traj_group.max()) + 1 if self.n_traj else 0

    @property
    def step_offsets(self) -> np.ndarray:
        """Token offsets of steps: tokens of step s are [off[s], off[s+1])."""
        return np.concatenate([self.step_starts, [self.n_tokens]]).astype(np.int64)

    def token_steps(self) -> np.ndarray:
        """int64 step row of every token: O(tokens), built on each call."""
        return np.repeat(np.arange(self.n_steps, dtype=np.int64), self.step_tokens)

    def token_trajs(self) -> np.ndarray:
        """int64 trajectory row of every token: O(tokens), built on each call."""
        return np.repeat(self.step_traj.astype(np.int64), self.step_tokens)

    def mask_steps(self) -> np.ndarray:
        """int64 step row of every assistant token, in order (`token_steps()[tok_mask]`)."""
        counts = np.where(self.step_is_assistant, self.step_tokens, 0)
        return np.repeat(np.arange(self.n_steps, dtype=np.int64), counts)

    def mask_trajs(self) -> np.ndarray:
        """int64 trajectory row of every assistant token, in order (`token_trajs()[tok_mask]`)."""
        counts = np.where(self.step_is_assistant, self.step_tokens, 0)
        return np.repeat(self.step_traj.astype(np.int64), counts)

    def component_entries(self) -> pa.ListArray | None:
        """The trajectories' reward components as list<struct<key, value>> per trajectory row (a map's entries),
        read from the Arrow table (no frame); None: the batch has no such column."""
        return _component_entries(self.traj_table)

    def role_mask(self, role: str) -> np.ndarray:
        """bool per step: its role is `role` (a null role is none; `step_is_assistant` is this for "assistant")."""
        return _role_mask(self.step_table, role)

    def step_flags(self, name: str) -> np.ndarray:
        """A boolean steps column as bool per step (False where null), read from the Arrow table (no frame)."""
        return pc.fill_null(self.step_table.column(name), False).to_numpy(zero_copy_only=False).astype(bool)

    def step_floats(self, name: str) -> np.ndarray:
        """A scalar steps column as float64 per step (NaN where null), read from the Arrow table (no frame)."""
        return np.asarray(self.step_table.column(name).to_numpy(), dtype=np.float64)

    def rewards(self) -> np.ndarray:
        return np.asarray(self.traj_table.column("reward").to_numpy(), dtype=np.float64)

    # ---- settings and statistics ----------------------------------------------------------------
    def settings(self, model: type[S]) -> S:
        """The settings of the stage whose model is `model`: the run's, or its defaults without a config."""
        return self.config.settings(model) if self.config is not None else model()

    def settings_named(self, name: str) -> StageSettings:
        """The settings registered as `name` (a registry link's declared settings)."""
        return named_settings(self.config, name)

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

    def names(self, key: str, names: list[str], scope: str = "round") -> list[str]:
        """The names a method finds in its batch (GDPO's reward components), or those of the whole round
        (`scope="round"` with round statistics: recorded by its statistics function as keys `key:name`)."""
        if scope == "batch" or self.round_stats is None:
            return list(names)
        prefix = f"{key}:"
        return sorted(k[len(prefix) :] for k in self.round_stats if k.startswith(prefix))

    def annotation(self, name: str) -> pl.DataFrame | None:
        return self.annotations.get(name)

    # ---- broadcasting ---------------------------------------------------------------------------
    def broadcast_traj(self, per_traj: np.ndarray) -> np.ndarray:
        """A per-trajectory value on every assistant token of the trajectory (0 elsewhere)."""
        return self.broadcast_step(np.asarray(per_traj, dtype=np.float64)[self.step_traj])

    def broadcast_step(self, per_step: np.ndarray) -> np.ndarray:
        """A per-step value on every assistant token of the step (0 elsewhere)."""
        # tokens of a step are contiguous: repeat each step's value (0 off the assistant steps) over its tokens
        per_step = np.where(self.step_is_assistant, np.asarray(per_step, dtype=np.float64), 0.0)
        return np.repeat(per_step, self.step_tokens)

    def traj_to_steps(self, per_traj: np.ndarray) -> np.ndarray:
        return np.asarray(per_traj, dtype=np.float64)[self.step_traj]

    def assistant_steps(self) -> pl.DataFrame:
        """Assistant steps with their row index (`step_row`), in (trajectory, turn) order."""
        return self.steps.with_row_index("step_row").filter(pl.col("is_assistant"))
