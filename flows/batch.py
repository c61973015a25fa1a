"""The plain per-batch work of a round, without Prefect: each function reads one batch of whole groups from
the lake, calls pipeline/, writes its parts and a `stage_runs` row, and returns a small summary (a dict).
The flow's tasks (flows/process_round.py) call exactly these; the benchmark runs them bare."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.compute as pc

from flows.stage_names import (  # noqa: F401  (CREDIT, EXPORT, method_slug: re-exported)
    CREDIT,
    EXPORT,
    STATS,
    advantages_part,
    method_slug,
    statistics_methods,
)
from pipeline.config import Config
from pipeline.credit.ops import Moments
from pipeline.credit.process import (
    annotation_names,
    batch_statistics,
    merge_statistics,
    process_batch,
    statistics_from_json,
    statistics_table,
)
from pipeline.stages import NO_IO, StageIO
from warehouse.lake import Lake
from warehouse.rounds import batch_names, read_batch
from warehouse.runlog import record_stage_run


def stage_io(config: Config) -> StageIO:
    """The effects an LLM stage gets: the shared OpenAI-compatible client, and a thread pool for its checks."""
    from concurrent.futures import ThreadPoolExecutor

    from trainer import sandbox  # registers the `code_tests` verifier (it runs candidate code: trainer floor)
    from trainer.llm.client import LLMClient

    sandbox.configure(config=config)
    workers = int(getattr(config.stage("counterfactual"), "verify_workers", 4) or 4)

    def pool_map(fn, *iterables):
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(fn, *iterables))

    return StageIO(llm=LLMClient, map=pool_map)


def _tokens(steps: pa.Table) -> int:
    return int(pc.sum(pc.list_value_length(steps.column("token_ids"))).as_py() or 0)


def _finish(
    lake: Lake,
    round_: int,
    stage: str,
    batch: str,
    t0: float,
    traj: pa.Table,
    steps: pa.Table,
    rows_out: dict[str, int],
    cache_key: str | None,
    notes: dict[str, float] | None = None,
    warnings: list[str] | None = None,
) -> dict:
    """A batch stage's summary (what its task returns), recorded in the lake's run log (`stage_runs`)."""
    summary = {
        "stage": stage,
        "batch": batch,
        "seconds": time.perf_counter() - t0,
        "trajectories": traj.num_rows,
        "steps": steps.num_rows,
        "tokens": _tokens(steps),
        "rows_out": rows_out,
        "notes": dict(notes or {}),
        "warnings": list(warnings or []),
    }
    record_stage_run(
        lake,
        round_,
        stage,
        batch,
        seconds=summary["seconds"],
        trajectories=traj.num_rows,
        steps=steps.num_rows,
        tokens=summary["tokens"],
        rows_out=rows_out,
        notes=summary["notes"],
        warnings=summary["warnings"],
        cache_key=cache_key,
    )
    return summary


# ---- plain per-batch work (what the flow's tasks call; the benchmark's bare baseline) --------------------


def run_annotation_stage(
    lake: Lake, round_: int, batch: str, stage_name: str, config: Config, cache_key: str | None = None
) -> dict:
    """One annotation stage on one batch: its tables as parts named like the batch."""
    from pipeline.stages import load_stages

    stage = load_stages()[stage_name]
    t0 = time.perf_counter()
    traj = read_batch(lake, "trajectories", round_, batch)
    steps = read_batch(lake, "steps", round_, batch)
    inputs = {t: read_batch(lake, t, round_, batch) for t in stage.needs}
    out = stage.fn(traj, steps, config, inputs, io=stage_io(config) if stage.calls_llm(config) else NO_IO)
    for table in stage.produces:
        lake.write_part(table, round_, out.tables[table], part=batch)
    rows = {t: out.tables[t].num_rows for t in stage.produces}
    return _finish(lake, round_, stage_name, batch, t0, traj, steps, rows, cache_key, out.notes, out.warnings)


def _credit_inputs(lake: Lake, round_: int, batch: str, methods: list[str]) -> tuple:
    from pipeline.credit.registry import method_step_columns

    traj = read_batch(lake, "trajectories", round_, batch)
    # only the steps columns the methods read: content, offsets and tool calls stay on disk
    steps = read_batch(lake, "steps", round_, batch, columns=method_step_columns(methods))
    annotations = {name: read_batch(lake, name, round_, batch) for name in sorted(annotation_names(methods))}
    return traj, steps, annotations


def stats_batch(lake: Lake, round_: int, batch: str, config: Config, cache_key: str | None = None) -> dict:
    """The statistics pass on one batch: the `credit_stats` part (a few rows of moments), no advantages."""
    t0 = time.perf_counter()
    methods = statistics_methods(config)
    traj, steps, annotations = _credit_inputs(lake, round_, batch, methods)
    stats = batch_statistics(traj, steps, methods, config, annotations, round_=round_)
    source = cache_key or stats_source(lake, round_, batch, config)
    lake.write_part(STATS, round_, statistics_table(stats, round_, source), part=batch)
    return _finish(lake, round_, STATS, batch, t0, traj, steps, {STATS: len(stats)}, cache_key)


def stats_source(lake: Lake, round_: int, batch: str, config: Config) -> str:
    """What a batch's statistics are computed from: the statistics stage's cache key (its input parts' names,
    sizes and mtimes, the settings it reads, the code)."""
    from flows.caching import stage_cache_key

    return stage_cache_key(lake.uri, round_, batch, STATS, config)


def round_statistics(lake: Lake, round_: int, config: Config, batches: list[str] | None = None) -> dict:
    """The round's merged moments from every batch's `credit_stats` part, in batch order. A batch without a
    current part (none, or computed from other inputs, settings or code: its `source`) gets the statistics pass
    first, so a plain caller of `credit_batch` gets the round's statistics too."""
    if not statistics_methods(config):
        return {}
    batches = round_batches(lake, round_) if batches is None else batches
    parts = []
    for b in batches:
        part = read_batch(lake, STATS, round_, b)
        source = stats_source(lake, round_, b, config)
        if part.num_rows == 0 or set(part.column("source").to_pylist()) != {source}:
            stats_batch(lake, round_, b, config, cache_key=source)
            part = read_batch(lake, STATS, round_, b)
        parts.append(part)
    import pyarrow as pa

    return merge_statistics(pa.concat_tables(parts))


def credit_batch(
    lake: Lake,
    round_: int,
    batch: str,
    methods: list[str],
    config: Config,
    cache_key: str | None = None,
    round_stats: dict[str, list[float]] | None = None,
) -> dict:
    """Every method on one batch: one advantages part per (batch, method). `round_stats`: the round's merged
    moments (`process.statistics_json`), as the flow passes them; None: read (or made) here from the lake."""
    t0 = time.perf_counter()
    cfg = config if list(config.methods) == list(methods) else config.model_copy(update={"methods": methods})
    stats: dict[str, Moments] | None = None
    if round_stats is not None:
        stats = statistics_from_json(round_stats)
    elif statistics_methods(cfg):
        stats = round_statistics(lake, round_, cfg)
    traj, steps, annotations = _credit_inputs(lake, round_, batch, methods)
    tables, method_notes = process_batch(
        traj, steps, methods, config, annotations, round_=round_, round_stats=stats
    )
    for method, table in tables.items():
        lake.write_part("advantages", round_, table, part=advantages_part(batch, method))
    notes = {f"{m}.{k}": float(v) for m, n in method_notes.items() for k, v in n.items()}
    rows = {"advantages": sum(t.num_rows for t in tables.values())}
    return _finish(lake, round_, CREDIT, batch, t0, traj, steps, rows, cache_key, notes)


def export_batch(
    lake: Lake, round_: int, batch: str, methods: list[str], cache_key: str | None = None
) -> dict:
    """The flat per-trajectory training layout of every method on one batch (train_batch parts)."""
    from pipeline.export import STEP_COLUMNS, TrainLayout

    t0 = time.perf_counter()
    traj = read_batch(lake, "trajectories", round_, batch)
    steps = read_batch(lake, "steps", round_, batch, columns=STEP_COLUMNS)
    layout = TrainLayout(traj, steps)  # what every method shares, built once
    rows = 0
    for method in methods:
        part = advantages_part(batch, method)
        adv = read_batch(lake, "advantages", round_, part)
        table = layout.table(adv)
        lake.write_part("train_batch", round_, table, part=part)
        rows += table.num_rows
    return _finish(lake, round_, EXPORT, batch, t0, traj, steps, {"train_batch": rows}, cache_key)


def run_stage_task(
    lake_root: str,
    round_: int,
    batch: str,
    stage: str,
    config: Config,
    cache_key: str | None = None,
    round_stats: dict[str, list[float]] | None = None,
) -> dict:
    """One stage (an annotation stage, the statistics pass, credit or export) on one batch, from the lake's
    root: what a flow task runs, in its thread or in a worker process (flows/workers.py)."""
    lake = Lake(lake_root)
    if stage == STATS:
        return stats_batch(lake, round_, batch, config, cache_key=cache_key)
    if stage == CREDIT:
        return credit_batch(
            lake, round_, batch, config.methods, config, cache_key=cache_key, round_stats=round_stats
        )
    if stage == EXPORT:
        return export_batch(lake, round_, batch, config.methods, cache_key=cache_key)
    return run_annotation_stage(lake, round_, batch, stage, config, cache_key=cache_key)


def stage_calls_llm(stage: str, config: Config) -> bool:
    """Whether a round stage talks to an LLM endpoint under this config."""
    if stage in (STATS, CREDIT, EXPORT):
        return False
    from pipeline.stages import load_stages

    return load_stages()[stage].calls_llm(config)


def stage_outputs(stage: str, batch: str, methods: list[str]) -> list[tuple[str, str]]:
    """(table, part) pairs a stage writes for a batch: all present = the stage's work is on disk."""
    if stage == STATS:
        return [(STATS, batch)]
    if stage == CREDIT:
        return [("advantages", advantages_part(batch, m)) for m in methods]
    if stage == EXPORT:
        return [("train_batch", advantages_part(batch, m)) for m in methods]
    from pipeline.stages import load_stages

    return [(t, batch) for t in load_stages()[stage].produces]


def round_stages(config: Config) -> list[str]:
    """The stages a round runs, in order: the annotation stages the methods need, the statistics pass (when a
    method takes a statistic over the round), credit, export."""
    from pipeline.stages import stages_for

    needed = annotation_names(config.methods)
    names = [s.name for s in stages_for(needed)] if needed else []
    if statistics_methods(config):
        names.append(STATS)
    names.append(CREDIT)
    if config.flow.export:
        names.append(EXPORT)
    return names


def run_batch_plain(lake: Lake, round_: int, batch: str, config: Config) -> list[dict]:
    """Every stage on one batch, in order, without Prefect (credit takes the round's statistics from the lake,
    running the statistics pass on the batches that lack it)."""
    out = []
    for stage in round_stages(config):
        if stage == STATS:
            out.append(stats_batch(lake, round_, batch, config))
        elif stage == CREDIT:
            out.append(credit_batch(lake, round_, batch, config.methods, config))
        elif stage == EXPORT:
            out.append(export_batch(lake, round_, batch, config.methods))
        else:
            out.append(run_annotation_stage(lake, round_, batch, stage, config))
    return out


def round_batches(lake: Lake, round_: int) -> list[str]:
    names = batch_names(lake, round_)
    if not names:
        raise FileNotFoundError(f"round {round_} has no trajectories in {lake.root}")
    return names
