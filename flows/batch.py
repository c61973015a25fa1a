"""The plain per-batch work of a round, without Prefect: `run_stage` reads one batch of whole groups from the
lake, calls the stage's function (pipeline.stages.BatchStage: what it reads and writes is on the declaration),
writes its parts and a `stage_runs` row, and returns a small summary (a dict). The flow's tasks
(flows/process_round.py) call exactly this; the benchmarks run it bare."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.compute as pc

from flows.caching import stage_cache_key
from pipeline.config import Config
from pipeline.credit.process import (
    STATS,
    merge_statistics,
    statistics_from_json,
    statistics_methods,
    statistics_table,
)
from pipeline.stages import NO_IO, BatchStage, StageIO, execute, get_stage
from pipeline.stages import round_stages as round_stages
from warehouse.lake import Lake
from warehouse.rounds import batch_names, read_batch
from warehouse.runlog import record_stage_run


def stage_io(config: Config) -> StageIO:
    """The effects an LLM stage gets: the shared OpenAI-compatible client, and a thread pool for its checks."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.counterfactual.stage import CounterfactualSettings
    from trainer import sandbox  # registers the `code_tests` verifier (it runs candidate code: trainer floor)
    from trainer.llm.client import LLMClient

    sandbox.configure(config=config)
    workers = config.settings(CounterfactualSettings).verify_workers

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
    lake: Lake | str,
    round_: int,
    batch: str,
    stage: BatchStage,
    config: Config,
    cache_key: str | None = None,
    round_stats: dict[str, list[float]] | None = None,
) -> dict:
    """One batch stage on one batch, from its declaration: read its inputs, call its function, write its outputs
    as parts named like the batch (per method: `<batch>.<method>`). `round_stats`: the round's merged moments
    (`process.statistics_json`) for a stage that reads them, as the flow passes them; None: read (or made)
    here from the lake. A flow task passes the lake's URI and the stage (to a worker process by name,
    `BatchStage.__reduce__`)."""
    t0 = time.perf_counter()
    lake = Lake(lake) if isinstance(lake, str) else lake
    traj = read_batch(lake, "trajectories", round_, batch)
    steps = read_batch(lake, "steps", round_, batch, columns=stage.columns(config))
    inputs = {key: read_batch(lake, table, round_, part) for table, part, key in stage.reads(batch, config)}
    if stage.round_statistics:
        if round_stats is not None:
            inputs[STATS] = statistics_table(statistics_from_json(round_stats), round_)
        elif statistics_methods(config):
            inputs[STATS] = statistics_table(round_statistics(lake, round_, config), round_)
    io = stage_io(config) if stage.calls_llm(config) else NO_IO
    out = execute(stage.fn(traj, steps, config, inputs, io=io), io)  # an LLM stage's requests: sent here
    source = None
    if stage.records_source:
        source = cache_key or stage_cache_key(lake.uri, round_, batch, stage, config)
    rows: dict[str, int] = {}
    for table, part, key in stage.writes(batch, config.methods):
        result = out.tables[key]
        if source is not None:
            result = result.set_column(
                result.schema.get_field_index("source"),
                "source",
                pa.array([source] * result.num_rows, pa.string()),
            )
        lake.write_part(table, round_, result, part=part)
        rows[table] = rows.get(table, 0) + result.num_rows
    notes = (out.notes, out.warnings, out.failures)
    return _finish(lake, round_, stage.name, batch, t0, traj, steps, rows, cache_key, *notes)


def current_statistics(lake: Lake, round_: int, batch: str, config: Config) -> tuple[pa.Table, str]:
    """A batch's `credit_stats` part and what it must have been computed from to be current (the statistics
    stage's cache key: its input parts, the settings it reads, its code); the part is current when every row's
    `source` is that key."""
    return read_batch(lake, STATS, round_, batch), stage_cache_key(
        lake.uri, round_, batch, get_stage(STATS), config
    )


def is_current(part: pa.Table, source: str) -> bool:
    return part.num_rows > 0 and set(part.column("source").to_pylist()) == {source}


def round_statistics(lake: Lake, round_: int, config: Config, batches: list[str] | None = None) -> dict:
    """The round's merged moments from every batch's `credit_stats` part, in batch order. A batch without a
    current part (`current_statistics`) gets the statistics pass first, so a plain caller of the credit stage
    gets the round's statistics too."""
    if not statistics_methods(config):
        return {}
    batches = round_batches(lake, round_) if batches is None else batches
    parts = []
    for b in batches:
        part, source = current_statistics(lake, round_, b, config)
        if not is_current(part, source):
            run_stage(lake, round_, b, get_stage(STATS), config, cache_key=source)
            part = read_batch(lake, STATS, round_, b)
        parts.append(part)
    return merge_statistics(pa.concat_tables(parts))


def run_batch_plain(lake: Lake, round_: int, batch: str, config: Config) -> list[dict]:
    """Every stage on one batch, in order, without Prefect (credit takes the round's statistics from the lake,
    running the statistics pass on the batches that lack it)."""
    return [run_stage(lake, round_, batch, stage, config) for stage in round_stages(config)]


def round_batches(lake: Lake, round_: int) -> list[str]:
    names = batch_names(lake, round_)
    if not names:
        raise FileNotFoundError(f"round {round_} has no trajectories in {lake.root}")
    return names
