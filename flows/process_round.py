"""`process_round_flow`: detect -> annotate -> counterfactual -> credit -> export over a round's batches,
then the round's stats.

Each stage (its declaration, pipeline.stages.BatchStage) is one Prefect task mapped over the batches (aligned
parts of whole groups) on the configured task runner (flows/runners.py); batch b's stage gets batch b's previous
stage's future as `upstream`, so it waits only for that one (Prefect resolves it). Tasks call
flows.batch.run_stage and return small summaries; the outputs are the lake's tables. Whoever runs it holds the
round's lock (flows.run.process_checked_round: the CLI, the loop, serve); the flow runs its stages inside
`round_execution` (flows/execution.py). Caching (flows/caching.py)
makes a re-run of a finished round do no work and an interrupted round resume at the missing batches. LLM
stages retry with exponential backoff; a stage that degraded (endpoint down, fallbacks used) completes with
warnings, and the flow run ends in the state `CompletedWithWarnings` instead of failing."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from prefect import flow, get_run_logger, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, as_completed
from prefect.states import Completed
from prefect.tasks import exponential_backoff

from flows import progress, workers
from flows.batch import (
    forget_round,
    keeping_round,
    keeps_round,
    round_batches,
    round_stages,
    round_statistics,
    run_stage,
    stage_note,
)
from flows.caching import (
    BatchStageCache,
    cache_dir,
    stage_cache_key,
    stage_key_prefix,
    would_run,
)
from flows.config import as_config
from flows.execution import round_execution
from flows.uptodate import derived_tables
from pipeline.config import Config
from pipeline.credit.process import STATS, statistics_json
from pipeline.stages import BatchStage
from warehouse.lake import Lake
from warehouse.runlog import prune_stale_parts

WARNING_STATE = "CompletedWithWarnings"


def unjoined_heartbeats() -> None:
    """A flow run's end no longer waits for its heartbeat thread. Prefect's sync flow engine starts a daemon
    thread that sends the run's heartbeats (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, default 180 s: with a server up
    it stays on) and sleeps in 1 s steps; at the run's end it sets the thread's stop event and joins it, which
    waits for the current step: 0-1 s of every round's wall time (0.5 s on average; it was the largest wall
    item of a new small round with a server up, issue 36). Prefect's async engine already leaves the thread
    unjoined (`join_on_exit=False`); so does the sync one now. The heartbeats sent are the same: the thread
    checks the stop event before each heartbeat and ends at its next step. Applied once per process, when
    this module is imported (before any round's flow run); left alone on a Prefect without that parameter."""
    import prefect.flow_engine as engine

    send = engine._send_heartbeats
    if getattr(send, "creditflow_unjoined", False):
        return
    if "join_on_exit" not in inspect.signature(send).parameters:
        return
    unjoined = functools.partial(send, join_on_exit=False)
    unjoined.creditflow_unjoined = True  # type: ignore[attr-defined]
    engine._send_heartbeats = unjoined


unjoined_heartbeats()


@task(task_run_name="{stage}-{batch}", persist_result=True, result_serializer="json")
def batch_stage_task(
    lake_root: str,
    round_: int,
    batch: str,
    stage: BatchStage,
    config: Config,
    upstream: dict | None = None,
    round_stats: dict | None = None,
) -> dict:
    """One stage on one batch; `upstream` (the previous stage's summary of this batch) only orders the work;
    `round_stats` (credit: the round's merged statistics) is part of the cache key."""
    key = None
    if config.flow.cache:
        key = _cache_key(
            round_,
            batch,
            stage,
            lambda: stage_cache_key(lake_root, round_, batch, stage, config, round_stats),
        )
    args = (lake_root, round_, batch, stage, config, key, round_stats)
    try:
        if workers.use_processes(config) and not stage.calls_llm(config):
            summary = workers.run(config.max_workers, run_stage, *args)  # off the flow's GIL
        elif config.task_runner == "threads":  # in the flow's process: the statistics pass keeps for credit
            keep = stage.name == STATS and keeps_round(lake_root, round_)
            try:
                extra = {"keep_reads": True} if keep else {}  # the call as before for every other stage
                summary = workers.run_here(config.max_workers, run_stage, *args, **extra)
            finally:
                if keep and not keeps_round(lake_root, round_):  # the round ended (failed) meanwhile
                    forget_round(lake_root, round_)
        else:  # processes, Ray, Dask: this is a worker process already
            summary = run_stage(*args)
    except Exception as exc:  # the command's one error line names the stage (flows.cli.error_line)
        exc.add_note(stage_note(stage, batch))
        raise
    _log_batch(summary)
    return summary


def _log_batch(summary: dict) -> None:
    """The batch stage's summary (and each warning) in the task run's log: the Prefect UI shows them."""
    logger = get_run_logger()
    rows = ", ".join(f"{t} {n}" for t, n in (summary.get("rows_out") or {}).items())
    logger.info(
        "%s %s: %s trajectories, %s tokens, %.2f s%s",
        summary.get("stage"),
        summary.get("batch"),
        summary.get("trajectories"),
        summary.get("tokens"),
        float(summary.get("seconds") or 0.0),
        f"; wrote {rows}" if rows else "",
    )
    for warning in summary.get("warnings", []):
        logger.warning("%s %s degraded: %s", summary.get("stage"), summary.get("batch"), warning)


def _cache_key(round_: int, batch: str, stage: BatchStage, compute: Callable[[], str]) -> str:
    """This task run's cache key: the one Prefect's transaction holds (BatchStageCache computed it a moment
    ago from the same inputs), else `compute()`."""
    from prefect.transactions import get_transaction

    txn = get_transaction()
    key = getattr(txn, "key", None)
    if isinstance(key, str) and key.startswith(stage_key_prefix(round_, batch, stage)):
        return key
    return compute()


@task(task_run_name="stats-round-{round_}", cache_policy=NO_CACHE, persist_result=False)
def round_stats_task(lake_root: str, round_: int, ran: list[str] | None = None) -> dict:
    """Refresh the DuckDB catalog and summarise the round from the lake, side by side (DuckDB and Arrow work
    outside the GIL; nothing else runs at the end of a round)."""
    from concurrent.futures import ThreadPoolExecutor

    from flows.summary import round_summary

    lake = Lake(lake_root)
    if (
        lake.format != "parquet"
    ):  # a Delta lake has no catalog file (warehouse.catalog.refresh): no DuckDB here
        return round_summary(lake, round_, ran)
    from warehouse.catalog import refresh

    with ThreadPoolExecutor(1, thread_name_prefix="creditflow-catalog") as pool:
        catalog = pool.submit(refresh, lake)
        summary = round_summary(lake, round_, ran)
        catalog.result()
    return summary


def _stage_task(config: Config, lake: Lake, calls_llm: bool):
    options: dict = {}
    if config.flow.cache:
        options["cache_policy"] = BatchStageCache(key_storage=str(cache_dir(lake)))
    else:
        options["cache_policy"] = NO_CACHE
        options["persist_result"] = False
    if calls_llm and config.flow.retries:
        options["retries"] = config.flow.retries
        options["retry_delay_seconds"] = exponential_backoff(backoff_factor=config.flow.retry_delay_s)
    return batch_stage_task.with_options(**options)


def flow_run_name() -> str:
    """`process <lake> round <n>`: the lake's folder name and the round, from the run's parameters."""
    from pathlib import Path

    from prefect.runtime import flow_run

    params = flow_run.parameters
    config = params.get("config")
    lake = config.lake if isinstance(config, Config) else (config or {}).get("lake", "lake")
    return f"process {Path(str(lake)).name or lake} round {params.get('round_')}"


def run_tags(config: Config) -> list[str]:
    """The tags of a round's flow run: one per method chain and the task runner."""
    return [f"method:{m}" for m in config.methods] + [f"runner:{config.task_runner}"]


def _tag_run(config: Config) -> None:
    """Add the round's tags (methods, runner) to this flow run, whoever started it (CLI, serve, loop)."""
    from prefect import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    tags = sorted(set(ctx.flow_run.tags or []) | set(run_tags(config)))
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(ctx.flow_run.id, tags=tags)
    except Exception as exc:  # tags are a convenience: a run without them is still a run
        get_run_logger().warning("could not tag the flow run: %s", exc)


@flow(name="process-round", flow_run_name=flow_run_name, validate_parameters=False)
def process_round_flow(round_: int, config: Config | dict):
    """Every stage of one round, batch by batch; returns the round summary (a warning state if degraded)."""
    t0 = time.perf_counter()
    config = as_config(config)
    _tag_run(config)
    lake = Lake(config.lake)
    # the caller holds the round's lock (flows.run.process_checked_round); cleanup removes only the leftovers
    # of writers that are gone, never a live run's temporary files
    lake.cleanup()
    batches = round_batches(lake, round_)
    prune_stale_parts(lake, round_, list(derived_tables()), batches)
    # worker processes, result storage, the API's priority (flows/execution.py)
    with round_execution(config, lake, batches) as (config, idle_api), _keeping(config, lake, round_):
        run = _run_stages(lake, round_, batches, config)
    # again at the end: a writer of a killed run may still have been exiting when the round started
    lake.cleanup()
    summary = round_stats_task(lake.uri, round_, [s.name for s in round_stages(config)])
    summary["this_run"] = run
    summary["wall_seconds"] = round(time.perf_counter() - t0, 3)
    # the round's fixed cost: its wall time less the stages' own work (orchestration, cache keys, the API's
    # calls, the lake's cleanup, the round's stats); what a new small round pays besides its work
    work = sum(r.get("work_s", 0.0) for r in run.values())
    summary["fixed_cost_seconds"] = round(max(summary["wall_seconds"] - work, 0.0), 3)
    summary["task_runs"] = sum(r["batches"] for r in run.values()) + 1  # the stats task
    summary["task_runner"] = config.task_runner
    summary["api_idle_during_stages"] = idle_api
    warnings = [f"{s}: {w}" for s, r in run.items() for w in r["warnings"]]
    summary["warnings"] = warnings
    _log_round(round_, summary, run)
    if warnings:
        return Completed(
            name=WARNING_STATE,
            data=summary,
            message=f"round {round_}: {len(warnings)} degraded batch stage(s); first: {warnings[0]}",
        )
    return summary


def _keeping(config: Config, lake: Lake, round_: int) -> AbstractContextManager:
    """The round's statistics tasks keep their reads and credit batches for its credit tasks where both run in
    this process: the thread runner without worker processes (flow.processes false, or a round of one batch).
    Worker processes take any batch's task (no batch is pinned to one): they never keep. What credit did not
    take is dropped when the stages end (flows.batch.keeping_round)."""
    if config.task_runner == "threads" and not workers.use_processes(config):
        return keeping_round(lake, round_)
    return nullcontext()


def _log_round(round_: int, summary: dict, run: dict[str, dict]) -> None:
    logger = get_run_logger()
    for stage, r in run.items():
        logger.info(
            "stage %s: %d batches (%d cached), %d warnings, done after %.2f s",
            stage,
            r["batches"],
            r["cached"],
            len(r["warnings"]),
            r.get("finished_after_s", 0.0),
        )
    logger.info(
        "round %s: %s trajectories, %s tokens, %s advantages rows, %s quarantined, %.2f s",
        round_,
        summary.get("trajectories"),
        summary.get("tokens"),
        (summary.get("rows") or {}).get("advantages"),
        summary.get("quarantined"),
        summary["wall_seconds"],
    )
    logger.info(
        "round %s: fixed cost %.2f s of %.2f s (wall less the stages' work: %d task runs, cache keys, the API, "
        "the lake's cleanup and the round's stats)",
        round_,
        summary["fixed_cost_seconds"],
        summary["wall_seconds"],
        summary["task_runs"],
    )
    for warning in summary["warnings"]:
        logger.warning("round %s degraded: %s", round_, warning)


def _run_stages(lake: Lake, round_: int, batches: list[str], config: Config) -> dict[str, dict]:
    """Each stage mapped over the batches, batch b's stage after batch b's previous stage (its future is the
    task's `upstream`: Prefect waits for it); progress is reported as tasks finish. Returns per stage: batches,
    cached, warnings, finished_after_s.

    With a statistics pass (STATS), credit is mapped once every batch's statistics are in: it gets the round's
    merged moments (read once from the `credit_stats` parts), which enter its cache key, so a credit part
    computed with other round statistics is recomputed."""
    tally = _Tally(time.perf_counter())
    upstream: list | None = None
    for stage in round_stages(config):
        round_stats = None
        if stage.round_statistics and STATS in tally.run:  # the barrier: the round's statistics, merged
            tally.wait()
            round_stats = statistics_json(round_statistics(lake, round_, config, batches))
        upstream = _map_stage(lake, round_, batches, stage, config, upstream, round_stats)
        tally.add(stage.name, upstream)
    tally.wait()
    return tally.run


def _map_stage(
    lake: Lake,
    round_: int,
    batches: list[str],
    stage: BatchStage,
    config: Config,
    upstream: list | None,
    round_stats: dict | None,
) -> list:
    """One stage's task mapped over the batches; returns its futures in batch order. A batch the stage must
    run on whatever the cache holds (`would_run`: outputs missing, or an LLM stage's degraded) refreshes its
    cache record; the others may be served from it."""
    progress.report("stage", stage.name, total=len(batches))
    must = would_run(lake, round_, stage, batches, config)
    task_ = _stage_task(config, lake, stage.calls_llm(config))
    futures: dict[str, object] = {}
    for refresh in (False, True):
        index = [i for i, b in enumerate(batches) if (b in must) == refresh]
        if not index:
            continue
        mapped = task_.with_options(refresh_cache=refresh).map(
            lake_root=unmapped(lake.uri),
            round_=unmapped(round_),
            batch=[batches[i] for i in index],
            stage=unmapped(stage),
            config=unmapped(config),
            upstream=[upstream[i] for i in index] if upstream else unmapped(None),
            round_stats=unmapped(round_stats),
        )
        futures.update(zip((batches[i] for i in index), mapped, strict=True))
    return [futures[b] for b in batches]


class _Tally:
    """The per-stage run summary and the progress bars, from the stage tasks' futures as they finish."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.pending: dict[object, tuple[PrefectFuture[Any], str]] = {}  # task run id -> (future, stage)
        self.run: dict[str, dict] = {}

    def add(self, stage: str, futures: list) -> None:
        self.run[stage] = {"batches": 0, "cached": 0, "warnings": []}
        self.pending.update((f.task_run_id, (f, stage)) for f in futures)

    def wait(self) -> None:
        """Until every task mapped so far has finished; a failed task raises here and fails the flow run."""
        for future in as_completed([f for f, _ in self.pending.values()]):
            _, stage = self.pending.pop(future.task_run_id)
            summary = future.result()
            cached = future.state.name == "Cached"
            r = self.run[stage]
            r["batches"] += 1
            r["cached"] += int(cached)
            r["work_s"] = r.get("work_s", 0.0) + (0.0 if cached else float(summary.get("seconds") or 0.0))
            r["warnings"] += [f"{summary['batch']}: {w}" for w in summary.get("warnings", [])]
            notes = summary.get("notes") or {}
            if "llm_requests_total" in notes:  # an LLM stage: what it asked and what failed, by cause
                r["llm_requests"] = r.get("llm_requests", 0) + int(notes["llm_requests_total"])
                r["llm_failed"] = r.get("llm_failed", 0) + int(notes.get("llm_requests_failed", 0))
                causes = r.setdefault("failures", {})
                for cause, n in (summary.get("failures") or {}).items():
                    causes[cause] = causes.get(cause, 0) + int(n)
            r["finished_after_s"] = round(time.perf_counter() - self.t0, 3)
            progress.report("batch", stage, batch=summary["batch"], cached=cached)
