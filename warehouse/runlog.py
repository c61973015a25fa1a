"""The flow's run log in the lake: `stage_runs/round=<n>/part-<stage>.<batch>.parquet`, one row per stage
and batch, replaced when the stage runs again, so the log always describes the outputs on disk."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pyarrow.compute as pc

from schemas import stage_runs as _stage_runs  # noqa: F401  (registers the table)
from warehouse.lake import Lake

TABLE = "stage_runs"


def record_stage_run(
    lake: Lake,
    round_: int,
    stage: str,
    batch: str,
    *,
    seconds: float,
    trajectories: int = 0,
    steps: int = 0,
    tokens: int = 0,
    rows_out: dict[str, int] | None = None,
    notes: dict[str, float] | None = None,
    warnings: list[str] | None = None,
    cache_key: str | None = None,
) -> None:
    row = {
        "round": [int(round_)],
        "stage": [stage],
        "batch": [batch],
        "seconds": [float(seconds)],
        "trajectories": [int(trajectories)],
        "steps": [int(steps)],
        "tokens": [int(tokens)],
        "rows_out": [list((rows_out or {}).items())],
        "notes": [[(k, float(v)) for k, v in (notes or {}).items()]],
        "warnings": [list(warnings or [])],
        "cache_key": [cache_key],
        "finished_at": [dt.datetime.now(dt.UTC)],
    }
    lake.write_part(TABLE, round_, pa.table(row, schema=_stage_runs.SCHEMA), part=f"{stage}.{batch}")


def read_stage_runs(lake: Lake, round_: int) -> pa.Table:
    return lake.read(TABLE, round_)


def count_rows(lake: Lake, table: str, round_: int) -> int:
    """Rows of a (table, round) partition from the Parquet footers or the Delta log (no data read)."""
    return lake.count_rows(table, round_)


def part_fingerprints(lake: Lake, round_: int, parts: list[tuple[str, str]]) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of each (table, part) (absent parts as size -1): the cheap identity of a
    batch's inputs the flow caches on."""
    return [lake.part_stat(table, round_, part) for table, part in parts]


def prune_stale_parts(lake: Lake, round_: int, tables: list[str], batches: list[str]) -> int:
    """Delete parts of derived tables whose batch is no longer in the round (the round was re-split)."""
    keep = set(batches)
    removed = 0
    for table in tables:
        stale = []
        for path in lake.parts(table, round_):
            name = lake.part_name(path)
            batch = name.split(".", 1)[-1] if table == TABLE else name.split(".", 1)[0]  # stage.batch
            if batch not in keep:
                stale.append(name)
        removed += lake.delete_part_names(table, round_, stale)
    return removed


def parts_present(lake: Lake, round_: int, parts: list[tuple[str, str]]) -> bool:
    return all(lake.has_part(table, round_, part) for table, part in parts)


def stage_seconds(runs: pa.Table) -> dict[str, float]:
    if runs.num_rows == 0:
        return {}
    grouped = runs.group_by("stage").aggregate([("seconds", "sum")])
    return dict(
        zip(grouped.column("stage").to_pylist(), grouped.column("seconds_sum").to_pylist(), strict=True)
    )


def total_notes(runs: pa.Table, stages: list[str] | None = None) -> dict[str, float]:
    """Sum of every note over the runs (optionally only some stages), keyed `stage.note`."""
    if runs.num_rows == 0:
        return {}
    if stages is not None:
        runs = runs.filter(pc.is_in(runs.column("stage"), pa.array(stages, pa.string())))
    out: dict[str, float] = {}
    for stage, notes in zip(runs.column("stage").to_pylist(), runs.column("notes").to_pylist(), strict=True):
        for key, value in notes or []:
            name = f"{stage}.{key}"
            out[name] = out.get(name, 0.0) + (value or 0.0)
    return out
