"""`ingest_flow`: rollout logs -> a round's `trajectories`, `steps` and `quarantine` in the lake.

The flow runs the one ingest path (`warehouse.ingest_run.ingest_sources`, which `creditflow ingest` runs
too) with each of its steps as a task: read the source files (a file that cannot be read at all is quarantined
as one record with the reason `unreadable_file`, and the other files are ingested), convert them
(pipeline.ingest: bad records are quarantined with their reason), write the round in aligned parts of whole
groups, all its tables or none (warehouse.rounds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import Task, flow, task
from prefect.cache_policies import NO_CACHE

from pipeline.config import Config
from warehouse.ingest_run import (
    UNREADABLE,
    NothingIngested,
    convert_step,
    ingest_sources,
    read_step,
    write_step,
)

__all__ = ["UNREADABLE", "NothingIngested", "ingest_flow"]

_TASKS: dict[Callable[..., Any], Task[..., Any]] = {
    read_step: task(task_run_name="read-sources", cache_policy=NO_CACHE, persist_result=False)(read_step),
    convert_step: task(task_run_name="convert-{fmt}", cache_policy=NO_CACHE, persist_result=False)(
        convert_step
    ),
    write_step: task(task_run_name="write-round-{round_}", cache_policy=NO_CACHE, persist_result=False)(
        write_step
    ),
}


def _as_task(step, *args: Any) -> Any:
    return _TASKS[step](*args)


@flow(name="ingest", flow_run_name="ingest-{fmt}-round-{round_}", validate_parameters=False)
def ingest_flow(sources: list[str], fmt: str, round_: int, config: Config | dict) -> dict:
    """Ingest the sources into round `round_` of the config's lake (the round's ingest tables are replaced,
    all or none)."""
    from flows.config import as_config

    config = as_config(config)
    run = ingest_sources(
        [str(s) for s in sources],
        fmt,
        round_,
        config.lake,
        config.tokenizer,
        config.batch_groups,
        run=_as_task,
    )
    return run.summary()
