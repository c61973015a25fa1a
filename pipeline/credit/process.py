"""Run method chains on one batch of whole groups and lay the results out as the `advantages` table; the
statistics pass that makes batch-level statistics (whitening) span the round.

A round is processed in two passes over its batches when a method takes a statistic over the whole batch
(gae, turn_ppo, gdpo, gae_pr with `scope="round"`, the default): `batch_statistics` on every batch (the
estimators' sufficient statistics only: no refiners, no advantages table), `merge_statistics` of the parts,
then `process_batch(..., round_stats=...)` on every batch. verl whitens over its training batch; the round is
ours, so the result does not depend on how the round was cut into parts."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import Config
from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import Moments
from pipeline.credit.registry import (
    method_settings,
    method_step_columns,
    round_statistics_methods,
    run_methods,
    statistics_step_columns,
)
from pipeline.credit.result import CreditResult
from pipeline.stages import NO_IO, StageIO, StageOutput, batch_stage, method_key
from schemas import one_chunk
from schemas.advantages import COMPONENT_FIELDS, COMPONENTS
from schemas.advantages import SCHEMA as ADVANTAGES_SCHEMA

CREDIT = "credit"
STATS = "credit_stats"  # the statistics pass: the sufficient statistics of every batch-level statistic


Layout = tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]  # (per_step, on_mask, per_token)


def _token_values(batch: CreditBatch, kind: int, values: list[np.ndarray]) -> np.ndarray:
    """The flat float32 per-token values of k columns of one layout in one (k, tokens) array: per-step values
    repeated over each step's tokens (kind 0), values on the assistant tokens, 0 elsewhere (kind 1), or a
    per-token array, 0 off the assistant tokens (kind 2); each cast to float32 once, the same values as
    building the float64 token array and casting it."""
    if kind == 0:
        return np.repeat(np.stack(values).astype(np.float32), batch.step_tokens, axis=1)
    flat = np.zeros((len(values), batch.n_tokens), dtype=np.float32)
    for row, v in zip(flat, values, strict=True):  # a row at a time: flat[:, mask] = stacked is ~4x slower
        if kind == 1 and len(v) == len(row):  # every token an assistant token: the values in order, cast
            np.copyto(row, v, casting="same_kind")
        elif kind == 1:
            row[batch.tok_mask] = v
        else:
            np.copyto(row, v, casting="same_kind", where=batch.tok_mask)
    return flat


def _token_columns(batch: CreditBatch, layouts: list[Layout]) -> list[pa.Array]:
    """A float32 list column per layout (exactly one of its arrays set), all over one int32 offsets array;
    the columns of one layout (GAE's advantages and returns, turn PPO's) scattered in one pass."""
    offsets = pa.array(batch.step_offsets.astype(np.int32))
    out: dict[int, pa.Array] = {}
    for kind in range(3):
        set_here = [(i, v) for i, layout in enumerate(layouts) if (v := layout[kind]) is not None]
        if set_here:
            flat = _token_values(batch, kind, [v for _, v in set_here])
            for row, (i, _) in enumerate(set_here):
                out[i] = pa.ListArray.from_arrays(offsets, pa.array(flat[row], type=pa.float32()))
    return [out[i] for i in range(len(layouts))]


def _components_struct(batch: CreditBatch, comps: dict[str, np.ndarray]) -> pa.StructArray:
    missing = pa.nulls(batch.n_steps, pa.float64())  # one array for every component the method lacks
    arrays = []
    for name in COMPONENT_FIELDS:
        values = comps.get(name)
        if values is None:
            arrays.append(missing)
        else:
            values = np.asarray(values, dtype=np.float64)
            arrays.append(pa.array(values, mask=np.isnan(values), type=pa.float64()))
    return pa.StructArray.from_arrays(arrays, fields=list(COMPONENTS))


def advantages_table(batch: CreditBatch, method: str, result: CreditResult) -> pa.Table:
    """The advantages rows of one method on this batch (schemas.advantages): the steps' keys from the batch's
    Arrow tables (no frame), the token columns laid out from the result."""
    steps = batch.step_table
    group_ids = batch.traj_table.column("group_id").take(pa.array(batch.step_traj))
    layouts: list[Layout] = [(result.step_adv, result.mask_adv, result.tok_adv)]
    if result.step_returns is not None or result.mask_returns is not None or result.tok_returns is not None:
        layouts.append((result.step_returns, result.mask_returns, result.tok_returns))
    adv, *rest = _token_columns(batch, layouts)
    returns = rest[0] if rest else None
    return pa.table(
        {
            "round": pa.array(np.full(batch.n_steps, batch.round, dtype=np.int32)),
            "method": pa.repeat(pa.scalar(method, pa.string()), batch.n_steps),
            "traj_id": steps.column("traj_id").cast(pa.string()),
            "group_id": group_ids.cast(pa.string()),
            "step_idx": steps.column("step_idx").cast(pa.int32()),
            "role": steps.column("role").cast(pa.string()),
            "turn": steps.column("turn").cast(pa.int32()),
            "token_adv": adv,
            "token_returns": returns
            if returns is not None
            else pa.nulls(batch.n_steps, pa.list_(pa.float32())),
            "components": _components_struct(batch, result.components),
        },
        schema=ADVANTAGES_SCHEMA,  # the table's own schema: the lake's write takes it as it is (`conform`)
    )


def annotation_names(methods: list[str]) -> set[str]:
    from pipeline.credit.registry import method_needs

    out: set[str] = set()
    for m in methods:
        out |= method_needs(m)
    return out


SAFE_MAGNITUDE = (
    1e30  # past this (or not finite) a reward could overflow float32 advantages or a group's sums
)


def overflow_groups(trajectories: pa.Table) -> list[str]:
    """Groups with a reward or reward component that is not finite or past SAFE_MAGNITUDE: their statistics
    would overflow (1e308 and -1e308 in one group made every group-relative method of the round fail)."""
    if trajectories.num_rows == 0 or "reward" not in trajectories.column_names:
        return []
    reward = one_chunk(trajectories.column("reward"))
    r = np.asarray(reward.fill_null(0.0).to_numpy(zero_copy_only=False), dtype=np.float64)
    bad = ~np.isfinite(r) | (np.abs(r) > SAFE_MAGNITUDE)
    if "reward_components" in trajectories.column_names:
        values = _component_values(one_chunk(trajectories.column("reward_components")))
        if values is not None:
            v, parent = values
            hit = ~np.isfinite(v) | (np.abs(v) > SAFE_MAGNITUDE)
            bad[parent[hit]] = True
    if not bad.any():
        return []
    groups = trajectories.column("group_id").to_pylist()
    return sorted({str(groups[i]) for i in np.flatnonzero(bad)})


def _component_values(comps: pa.Array) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, row of each) of a map<name, value> or list<struct<name, value>> column; None for other types.
    (Rows from the offsets: pyarrow's list_parent_indices aborts the process on a map array.)"""
    if pa.types.is_map(comps.type):
        child = comps.items
    elif pa.types.is_list(comps.type) and pa.types.is_struct(comps.type.value_type):
        fields = comps.type.value_type
        numeric = [
            i for i, f in enumerate(fields) if pa.types.is_floating(f.type) or pa.types.is_integer(f.type)
        ]
        if not numeric:
            return None
        child = comps.values.field(numeric[-1])
    else:
        return None
    offsets = comps.offsets.to_numpy()
    if len(offsets) < 2 or offsets[-1] == offsets[0]:
        return None
    flat = child.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    v = np.asarray(flat.fill_null(0.0).to_numpy(zero_copy_only=False), dtype=np.float64)
    return v, np.repeat(np.arange(len(comps)), np.diff(offsets))


def _without_groups(trajectories: pa.Table, steps: pa.Table, groups: list[str]) -> tuple[pa.Table, pa.Table]:
    keep = pc.invert(
        pc.is_in(
            trajectories.column("group_id"), pa.array(groups, trajectories.schema.field("group_id").type)
        )
    )
    trajectories = trajectories.filter(keep)
    if steps.column_names:  # (a statistics pass that read no steps columns: nothing to take out)
        steps = steps.filter(pc.is_in(steps.column("traj_id"), trajectories.column("traj_id")))
    return trajectories, steps


def process_batch(
    trajectories: pa.Table,
    steps: pa.Table,
    methods: list[str],
    config: Config | None = None,
    annotations: dict[str, pa.Table] | None = None,
    round_: int = 0,
    round_stats: dict[str, Moments] | None = None,
) -> tuple[dict[str, pa.Table], dict[str, dict[str, float]]]:
    """All methods on one batch: {method: advantages table}, {method: summary notes}. `round_stats`: the merged
    statistics of the round (None: this batch is the whole round). A group whose rewards could overflow is
    left out (no advantages; the note `quarantined_groups` counts them): one bad group never fails the round."""
    kept = _kept_batch(trajectories, steps, methods, config, annotations, round_)
    if kept is not None:  # the statistics pass of this process built it from these very tables
        quarantined = kept.quarantined
        batch = dataclasses.replace(kept.batch, round_stats=round_stats)
    else:
        quarantined = overflow_groups(trajectories)
        if quarantined:
            trajectories, steps = _without_groups(trajectories, steps, quarantined)
        # the credit batch: built once, whole-column, with the steps columns the methods' registrations declare
        batch = CreditBatch.from_arrow(
            trajectories,
            steps,
            method_step_columns(methods),
            config=config,
            annotations=annotations,
            round_=round_,
            round_stats=round_stats,
        )
    results = run_methods(batch, methods)
    tables = {m: advantages_table(batch, m, r) for m, r in results.items()}
    extra = {"quarantined_groups": float(len(quarantined))} if quarantined else {}
    return tables, {m: {**r.notes, **extra} for m, r in results.items()}


# ---- the statistics pass's credit batch, kept for credit in the same process ------------------------------
# A plain caller (flows.batch.round_statistics, then the credit stage per batch: the benchmarks, run_batch_plain)
# builds each batch twice, once per pass. Within `keeping_credit_batches()` the statistics pass builds it with
# the steps columns credit declares too and keeps it, keyed by the Arrow tables it was given (held here, so their
# identity stands); process_batch of those very tables (flows.batch serves credit the statistics pass's kept
# reads) starts from it with the round's statistics in place of building it again. Only without annotations
# (neither pass reads any: gae, turn_ppo, gdpo) and with the same settings and round; each kept batch is used
# once; anything else builds its own, as before.


@dataclasses.dataclass(frozen=True)
class _KeptBatch:
    trajectories: pa.Table  # the tables the statistics pass was given
    steps: pa.Table
    batch: CreditBatch  # built from them (less the quarantined groups), without round statistics
    columns: frozenset[str]  # the steps columns it was built with
    quarantined: list[str]


_kept_batches: dict[tuple[int, int], _KeptBatch] = {}
_keeping: ContextVar[bool] = ContextVar("keeping_credit_batches", default=False)  # this thread's call only


@contextmanager
def keeping_credit_batches() -> Iterator[None]:
    """Within: the statistics pass keeps the credit batch it builds for credit (see above); a statistics pass of
    another thread at the same time (a flow's thread runner) keeps nothing."""
    token = _keeping.set(True)
    try:
        yield
    finally:
        _keeping.reset(token)


def kept_bytes() -> int:
    """What the kept credit batches hold beyond the Arrow tables they were built from: the estimators'
    intermediates (`CreditBatch.memo`: gae's advantages and returns, GDPO's Eq. 1-2) and the token mask where
    it was built."""
    total = 0
    for kept in list(_kept_batches.values()):  # a copy: another thread (the flow's) may keep one meanwhile
        mask = kept.batch.derived.get("tok_mask")
        total += mask.nbytes if isinstance(mask, np.ndarray) else 0
        for value in kept.batch.memo.values():
            if dataclasses.is_dataclass(value):
                fields = list(vars(value).values())
            else:
                fields = list(value) if isinstance(value, tuple) else [value]
            total += sum(v.nbytes for v in fields if isinstance(v, np.ndarray))
    return total


def forget_credit_batches(tables: Collection[int] | None = None) -> None:
    """Drop every kept credit batch (a statistics pass starting over), or those built from the tables whose ids
    are `tables` (a flow's round ending: flows.batch.keeping_round)."""
    if tables is None:
        _kept_batches.clear()
        return
    for key in [k for k in list(_kept_batches) if k[0] in tables or k[1] in tables]:
        _kept_batches.pop(key, None)


def _kept_batch(
    trajectories: pa.Table,
    steps: pa.Table,
    methods: list[str],
    config: Config | None,
    annotations: dict[str, pa.Table] | None,
    round_: int,
) -> _KeptBatch | None:
    kept = _kept_batches.pop((id(trajectories), id(steps)), None)
    if kept is None or kept.trajectories is not trajectories or kept.steps is not steps or annotations:
        return None
    batch = kept.batch
    same = batch.round == round_ and batch.config == config
    return kept if same and set(method_step_columns(methods)) <= kept.columns else None


def batch_statistics(
    trajectories: pa.Table,
    steps: pa.Table,
    methods: list[str],
    config: Config | None = None,
    annotations: dict[str, pa.Table] | None = None,
    round_: int = 0,
) -> dict[str, Moments]:
    """The statistics pass on one batch: {estimator: its batch-level statistic's moments on this batch} for each
    estimator of `methods` that takes one over the round (empty moments when it takes none under its settings,
    e.g. `whiten=false`): each estimator's declared statistics function (registry.RoundStatistics), no
    estimate, no advantages."""
    config = config or Config()
    stages = round_statistics_methods(methods, config)
    if not stages:
        return {}
    given = trajectories, steps
    quarantined = overflow_groups(trajectories)
    if quarantined:  # the same groups as process_batch leaves out
        trajectories, steps = _without_groups(trajectories, steps, quarantined)
    columns = statistics_step_columns([s.name for s in stages], config)
    # kept for credit: built with the columns credit declares too, where the read holds every one of them (the
    # flow reads them for the statistics pass only when it keeps the read; a batch built without one of them, a
    # read kept without the per-token lists, would never be taken)
    wanted = method_step_columns(config.methods)
    keep = _keeping.get() and not annotations and set(wanted) <= set(steps.column_names)
    if keep:
        columns += [c for c in wanted if c not in columns]
    batch = CreditBatch.from_arrow(
        trajectories,
        steps,
        columns,
        config=config,
        annotations=annotations,
        round_=round_,
        tokens="n_tokens" in columns,
    )
    if keep:
        _kept_batches[(id(given[0]), id(given[1]))] = _KeptBatch(
            *given, batch, frozenset(columns), quarantined
        )
    out = {stage.name: Moments() for stage in stages}
    for stage in stages:
        assert stage.statistics is not None  # round_statistics_methods: the estimators that declare one
        own = stage.statistics.fn(batch, batch.settings_named(stage.settings) if stage.settings else None)
        for key, moments in own.items():
            out[key] = out[key].merge(moments) if key in out else moments
    return out


def statistics_table(stats: dict[str, Moments], round_: int = 0, source: str | None = None) -> pa.Table:
    """One batch's moments as `credit_stats` rows (`source`: what they were computed from)."""
    keys = sorted(stats)
    return pa.table(
        {
            "round": pa.array([round_] * len(keys), pa.int32()),
            "key": pa.array(keys, pa.string()),
            "n": pa.array([stats[k].n for k in keys], pa.float64()),
            "mean": pa.array([stats[k].mean for k in keys], pa.float64()),
            "m2": pa.array([stats[k].m2 for k in keys], pa.float64()),
            "source": pa.array([source] * len(keys), pa.string()),
        }
    )


def merge_statistics(rows: pa.Table) -> dict[str, Moments]:
    """The round's moments from every batch's `credit_stats` rows (merged in row order, per key)."""
    out: dict[str, Moments] = {}
    cols = [rows.column(c).to_pylist() for c in ("key", "n", "mean", "m2")]
    for key, n, mean, m2 in zip(*cols, strict=True):
        out[key] = out.get(key, Moments()).merge(Moments(n, mean, m2))
    return out


def statistics_json(stats: dict[str, Moments]) -> dict[str, list[float]]:
    """Moments as plain JSON (a flow parameter and a cache key): {key: [n, mean, m2]}, sorted by key."""
    return {k: [stats[k].n, stats[k].mean, stats[k].m2] for k in sorted(stats)}


def statistics_from_json(data: dict[str, list[float]]) -> dict[str, Moments]:
    return {k: Moments(*map(float, v)) for k, v in data.items()}


# ---- the batch stages: the statistics pass and credit, declared like every stage (pipeline/stages.py) ---------

CREDIT_CODE = ("pipeline/credit", "schemas/advantages.py")


def statistics_methods(config: Config) -> list[str]:
    """The estimators of the round's methods whose batch-level statistics span the round (empty: no pass)."""
    return [stage.name for stage in round_statistics_methods(config.methods, config)]


def _round_of(trajectories: pa.Table) -> int:
    return int(trajectories.column("round")[0].as_py()) if trajectories.num_rows else 0


@batch_stage(
    STATS,
    order=40,
    produces=(STATS,),
    needs=lambda config: sorted(annotation_names(statistics_methods(config))),
    step_columns=lambda config: statistics_step_columns(statistics_methods(config), config),
    settings=lambda config: sorted(method_settings(statistics_methods(config))),
    methods=statistics_methods,
    runs_if=lambda config: bool(statistics_methods(config)),
    records_source=True,
    code=CREDIT_CODE,
)
def credit_stats(
    trajectories: pa.Table, steps: pa.Table, config: Config, inputs: dict[str, pa.Table], io: StageIO = NO_IO
) -> StageOutput:
    """The statistics pass on one batch: a few rows of moments (`credit_stats`), no advantages."""
    round_ = _round_of(trajectories)
    stats = batch_statistics(trajectories, steps, statistics_methods(config), config, inputs, round_=round_)
    return StageOutput({STATS: statistics_table(stats, round_)})


@batch_stage(
    CREDIT,
    order=50,
    produces_per_method=("advantages",),
    needs=lambda config: sorted(annotation_names(config.methods)),
    step_columns=lambda config: method_step_columns(config.methods),
    settings=lambda config: sorted(method_settings(config.methods)),
    methods=lambda config: list(config.methods),
    runs_if=lambda config: True,
    round_statistics=True,
    code=CREDIT_CODE,
)
def credit(
    trajectories: pa.Table, steps: pa.Table, config: Config, inputs: dict[str, pa.Table], io: StageIO = NO_IO
) -> StageOutput:
    """Every method on one batch: one advantages table per method; `inputs["credit_stats"]` (the round's merged
    statistics, when the round has a statistics pass) makes a batch-level statistic span the round."""
    annotations = {k: v for k, v in inputs.items() if k != STATS}
    stats = merge_statistics(inputs[STATS]) if STATS in inputs else None
    tables, method_notes = process_batch(
        trajectories, steps, list(config.methods), config, annotations, _round_of(trajectories), stats
    )
    notes = {f"{m}.{k}": float(v) for m, n in method_notes.items() for k, v in n.items()}
    return StageOutput({method_key("advantages", m): t for m, t in tables.items()}, notes)
