"""`ingest_flow`: rollout logs -> a round's `trajectories`, `steps` and `quarantine` in the lake.

Three tasks: read the source files (warehouse.sources), convert them (pipeline.ingest: bad records are
quarantined with their reason), write the round in aligned parts of whole groups (warehouse.rounds). A file
that cannot be read at all (not UTF-8, not Parquet, truncated) is quarantined as one record with the reason
`unreadable_file`, and the other files are ingested."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from pipeline.config import Config

UNREADABLE = "unreadable_file"
RAW_LIMIT = 1 << 20  # verbatim bytes kept of an unreadable file


def _unreadable(path: Path, exc: Exception, round_: int) -> dict:
    try:
        raw = (
            path.read_bytes()[:RAW_LIMIT].decode("utf-8", errors="backslashreplace") if path.is_file() else ""
        )
    except OSError:
        raw = ""
    return {
        "round": round_,
        "source_file": str(path),
        "location": "file",
        "record_id": None,
        "field": None,
        "reason": UNREADABLE,
        "detail": f"{type(exc).__name__}: {exc}"[:2000],
        "raw": raw,
        "stage": "ingest_flow",
    }


@task(task_run_name="read-sources", cache_policy=NO_CACHE, persist_result=False)
def read_sources_task(sources: list[str], fmt: str, round_: int) -> tuple[list, list[dict]]:
    """(inputs for pipeline.ingest, quarantine rows of unreadable files)."""
    from pipeline.ingest import get_adapter
    from warehouse.sources import read_table_sources, read_text_sources, source_files

    spec = get_adapter(fmt)
    inputs: list = []
    bad: list[dict] = []
    if spec.options.get("raw_files") or spec.kind == "tables":
        for source in sources:
            try:
                if spec.options.get("raw_files"):
                    from warehouse.interop_sources import read_raw_sources

                    inputs += read_raw_sources([source], spec.extensions)
                else:
                    inputs += read_table_sources([source])
            except (OSError, ValueError, pa.ArrowException) as exc:
                bad.append(_unreadable(Path(source), exc, round_))
        return inputs, bad
    for path in source_files(sources, spec.extensions):
        try:
            inputs += read_text_sources([path], spec.extensions)
        except (OSError, UnicodeDecodeError) as exc:
            bad.append(_unreadable(path, exc, round_))
    return inputs, bad


@task(task_run_name="convert-{fmt}", cache_policy=NO_CACHE, persist_result=False)
def convert_task(fmt: str, inputs: list, round_: int, tokenizer: str | None):
    from pipeline.ingest import ingest
    from warehouse.tokenizers import get_tokenizer

    return ingest(fmt, inputs, round_=round_, tokenizer=get_tokenizer(tokenizer))


@task(task_run_name="write-round-{round_}", cache_policy=NO_CACHE, persist_result=False)
def write_round_task(
    lake_root: str,
    round_: int,
    trajectories: pa.Table,
    steps: pa.Table,
    quarantine: pa.Table,
    batch_groups: int,
) -> list[str]:
    from warehouse.lake import Lake
    from warehouse.rounds import write_round

    return write_round(Lake(lake_root), round_, trajectories, steps, batch_groups, quarantine)


@flow(name="ingest", flow_run_name="ingest-{fmt}-round-{round_}", validate_parameters=False)
def ingest_flow(sources: list[str], fmt: str, round_: int, config: Config | dict) -> dict:
    """Ingest the sources into round `round_` of the config's lake (the round's ingest tables are replaced)."""
    from flows.config import as_config

    config = as_config(config)
    sources = [str(s) for s in sources]
    from schemas import quarantine as quarantine_schema
    from warehouse.lake import Lake

    lake = Lake(config.lake)
    inputs, unreadable = read_sources_task(sources, fmt, round_)
    if inputs:
        result = convert_task(fmt, inputs, round_, config.tokenizer)
        trajectories, steps, quarantine, stats = (
            result.trajectories,
            result.steps,
            result.quarantine,
            result.stats,
        )
    else:
        from schemas import steps as steps_schema
        from schemas import trajectories as trajectories_schema

        trajectories, steps = trajectories_schema.SPEC.empty(), steps_schema.SPEC.empty()
        quarantine, stats = quarantine_schema.SPEC.empty(), {}
    if unreadable:
        extra = pa.Table.from_pylist(unreadable, schema=quarantine_schema.SCHEMA)
        quarantine = pa.concat_tables([quarantine_schema.SPEC.conform(quarantine), extra])
    if trajectories.num_rows == 0:
        lake.replace_partition("quarantine", round_, quarantine)
        raise ValueError(
            f"ingest {fmt}: no trajectory could be ingested from {len(sources)} source(s); "
            f"{quarantine.num_rows} record(s) quarantined in {lake.partition_dir('quarantine', round_)}"
        )
    parts = write_round_task(lake.uri, round_, trajectories, steps, quarantine, config.batch_groups)
    return {
        "format": fmt,
        "round": round_,
        "sources": len(sources),
        "files_read": len(inputs),
        "unreadable_files": len(unreadable),
        "trajectories": trajectories.num_rows,
        "steps": steps.num_rows,
        "quarantined": quarantine.num_rows,
        "parts": len(parts),
        "tokens": stats.get("tokens"),
        "lake": lake.uri,
    }
