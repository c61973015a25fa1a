"""The plain per-batch work of a round, without Prefect: each function reads one batch of whole groups from
the lake, calls pipeline/, writes its parts and a `stage_runs` row, and returns a small summary (a dict).
The flow's tasks (flows/process_round.py) call exactly these; the benchmark runs them bare."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.compute as pc

from flows.caching import stage_cache_key
from flows.stage_names import (  # noqa: F401  (CREDIT, EXPORT, advantages_part, method_slug: re-exported)
    CREDIT,
    EXPORT,
    STATS,
    advantages_part,
    method_slug,
    stage_reads,
    stage_writes,
    statistics_methods,
)
from pipeline.config import Config
from pipeline.credit.process import merge_statistics, statistics_from_json, statistics_table
from pipeline.stages import NO_IO, StageIO, execute, get_stage
from pipeline.stages import round_stages as pipeline_round_stages
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
    failures: dict[str, int] | None = None,
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
    if failures:  # an LLM stage's requests that failed for good, by cause (flows.run: the degradation check)
        summary["failures"] = dict(failures)
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


def run_stage(
    lake: Lake,
    round_: int,
    batch: str,
    stage_name: str,
    config: Config,
    cache_key: str | None = None,
    round_stats: dict[str, list[float]] | None = None,
) -> dict:
    """Any batch stage on one batch, from its declaration (pipeline.stages.BatchStage): read its inputs, call
    its function, write its outputs as parts named like the batch (per method: `<batch>.<method>`).
    `round_stats`: the round's merged moments (`process.statistics_json`) for a stage that reads them, as the
    flow passes them; None: read (or made) here from the lake."""
    stage = get_stage(stage_name)
    t0 = time.perf_counter()
    traj = read_batch(lake, "trajectories", round_, batch)
    steps = read_batch(lake, "steps", round_, batch, columns=stage.columns(config))
    inputs = {
        key: read_batch(lake, table, round_, part) for table, part, key in stage_reads(stage, batch, config)
    }
    if stage.round_statistics:
        if round_stats is not None:
            inputs[STATS] = statistics_table(statistics_from_json(round_stats), round_)
        elif statistics_methods(config):
            inputs[STATS] = statistics_table(round_statistics(lake, round_, config), round_)
    io = stage_io(config) if stage.calls_llm(config) else NO_IO
    out = execute(stage.fn(traj, steps, config, inputs, io=io), io)  # an LLM stage's requests: sent here
    source = (
        (cache_key or stage_cache_key(lake.uri, round_, batch, stage_name, config))
        if stage.records_source
        else None
    )
    rows: dict[str, int] = {}
    for table, part, key in stage_writes(stage, batch, list(config.methods)):
        result = out.tables[key]
        if source is not None:
            result = result.set_column(
                result.schema.get_field_index("source"),
                "source",
                pa.array([source] * result.num_rows, pa.string()),
            )
        lake.write_part(table, round_, result, part=part)
        rows[table] = rows.get(table, 0) + result.num_rows
    return _finish(
        lake,
        round_,
        stage_name,
        batch,
        t0,
        traj,
        steps,
        rows,
        cache_key,
        out.notes,
        out.warnings,
        out.failures,
    )


def _with_methods(config: Config, methods: list[str]) -> Config:
    return config if list(config.methods) == list(methods) else config.model_copy(update={"methods": methods})


def run_annotation_stage(
    lake: Lake, round_: int, batch: str, stage_name: str, config: Config, cache_key: str | None = None
) -> dict:
    """One annotation stage on one batch (`run_stage`)."""
    return run_stage(lake, round_, batch, stage_name, config, cache_key)


def stats_batch(lake: Lake, round_: int, batch: str, config: Config, cache_key: str | None = None) -> dict:
    """The statistics pass on one batch: the `credit_stats` part (a few rows of moments), no advantages."""
    return run_stage(lake, round_, batch, STATS, config, cache_key)


def stats_source(lake: Lake, round_: int, batch: str, config: Config) -> str:
    """What a batch's statistics are computed from: the statistics stage's cache key (its input parts' names,
    sizes and mtimes, the settings it reads, the code)."""
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
    """Every method on one batch: one advantages part per (batch, method) (`run_stage`)."""
    return run_stage(lake, round_, batch, CREDIT, _with_methods(config, methods), cache_key, round_stats)


def export_batch(
    lake: Lake,
    round_: int,
    batch: str,
    methods: list[str],
    cache_key: str | None = None,
    config: Config | None = None,
) -> dict:
    """The flat per-trajectory training layout of every method on one batch (train_batch parts)."""
    cfg = _with_methods(config or Config(), methods)
    return run_stage(lake, round_, batch, EXPORT, cfg, cache_key)


def run_stage_task(
    lake_root: str,
    round_: int,
    batch: str,
    stage: str,
    config: Config,
    cache_key: str | None = None,
    round_stats: dict[str, list[float]] | None = None,
) -> dict:
    """One stage on one batch, from the lake's root: what a flow task runs, in its thread or in a worker
    process (flows/workers.py)."""
    return run_stage(Lake(lake_root), round_, batch, stage, config, cache_key, round_stats)


def stage_calls_llm(stage: str, config: Config) -> bool:
    """Whether a round stage talks to an LLM endpoint under this config."""
    return get_stage(stage).calls_llm(config)


def takes_round_statistics(stage: str) -> bool:
    """Whether a stage reads the round's merged statistics (credit): the flow holds it until every batch's
    statistics are in and passes them (`round_stats`), and they enter its cache key."""
    return get_stage(stage).round_statistics


def stage_outputs(stage: str, batch: str, methods: list[str]) -> list[tuple[str, str]]:
    """(table, part) pairs a stage writes for a batch: all present = the stage's work is on disk."""
    return [(table, part) for table, part, _ in stage_writes(get_stage(stage), batch, methods)]


def round_stages(config: Config) -> list[str]:
    """The stages a round runs, in order (pipeline.stages.round_stages): the annotation stages the methods
    need, the statistics pass (when a method takes a statistic over the round), credit, export."""
    return [s.name for s in pipeline_round_stages(config)]


def run_batch_plain(lake: Lake, round_: int, batch: str, config: Config) -> list[dict]:
    """Every stage on one batch, in order, without Prefect (credit takes the round's statistics from the lake,
    running the statistics pass on the batches that lack it)."""
    return [run_stage(lake, round_, batch, stage, config) for stage in round_stages(config)]


def round_batches(lake: Lake, round_: int) -> list[str]:
    names = batch_names(lake, round_)
    if not names:
        raise FileNotFoundError(f"round {round_} has no trajectories in {lake.root}")
    return names
