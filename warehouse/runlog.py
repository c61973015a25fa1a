"""The flow's run log in the lake: `stage_runs/round=<n>/part-<stage>.<batch>.parquet`, one row per stage
and batch, replaced when the stage runs again, so the log always describes the outputs on disk.

On a local Delta lake a row is not a commit of its own (two of a gae batch's four commits were run-log rows):
`record_stage_run` writes it to a spool file, `LAKE/_flow/runlog/round=<n>/<stage>.<batch>~<ns>~<random>.arrow`
(written to a temporary name and renamed: there whole or not at all, before the stage's cache record as the
part was), and `flush_stage_runs` commits every spooled row of the round in one Delta commit, then removes the
files it committed. Every reader of the run log flushes first (`read_stage_runs`, `prune_stale_parts`, the
flow's summary at the round's end), so a reader sees the same rows as when each was its own commit; a run
killed before its flush leaves its rows in the spool, and the next reader or run commits them. Flushes of one
round hold a lock file (`round=<n>.lock`, flock) so two never commit over each other; a flush killed between its
commit and the removal commits the same rows again (an idempotent overwrite). A hive lake and a remote Delta
lake write each row as its part, as before."""

from __future__ import annotations

import datetime as dt
import fcntl
import logging
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from schemas import stage_runs as _stage_runs  # noqa: F401  (registers the table)
from warehouse.lake import Lake, LakeError, safe_part_name
from warehouse.tempfiles import temp_token

TABLE = "stage_runs"
SPOOL_DIR = "_flow/runlog"
log = logging.getLogger(__name__)


def spools(lake: Lake) -> bool:
    """Whether the lake's run-log rows go through the spool (a local Delta lake: a row costs a commit there)."""
    return getattr(lake, "format", "parquet") == "delta" and not getattr(lake, "remote", False)


def spool_dir(lake: Lake, round_: int) -> Path:
    return lake.root / SPOOL_DIR / f"round={int(round_)}"


def stage_run_row(
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
) -> pa.Table:
    """One stage's run on one batch as a `stage_runs` row (its part: `<stage>.<batch>`)."""
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
    return pa.table(row, schema=_stage_runs.SCHEMA)


def record_stage_run(lake: Lake, round_: int, stage: str, batch: str, **row) -> None:
    """Record one stage's run on one batch (`stage_run_row`'s fields), replacing its earlier row."""
    record_stage_runs(lake, round_, {f"{stage}.{batch}": stage_run_row(round_, stage, batch, **row)})


def record_stage_runs(lake: Lake, round_: int, rows: dict[str, pa.Table]) -> None:
    """Record several rows of one round ({`<stage>.<batch>`: its `stage_run_row`}): on a hive lake (or a remote
    Delta lake) one `write_parts` (a file each, the folder synced once; one commit), on a local Delta lake a
    spool file each."""
    if not rows:
        return
    if not spools(lake):
        lake.write_parts(TABLE, round_, rows)
        return
    folder = spool_dir(lake, round_)
    folder.mkdir(parents=True, exist_ok=True)
    for part, table in rows.items():
        name = f"{safe_part_name(part)}~{time.time_ns():020d}~{uuid.uuid4().hex}.arrow"  # '~': not in a part name
        tmp = folder / f".tmp-{temp_token()}-{name}"
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        os.replace(tmp, folder / name)


@contextmanager
def _flush_lock(lake: Lake, round_: int) -> Iterator[None]:
    path = lake.root / SPOOL_DIR / f"round={int(round_)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _spooled(folder: Path) -> list[Path]:
    """The round's spool files, oldest first (the name's nanosecond stamp: a later row of a (stage, batch)
    replaces an earlier one)."""
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if p.suffix == ".arrow" and not p.name.startswith(".tmp-")]
    return sorted(files, key=lambda p: p.name.split("~")[1:])


def spooled_parts(lake: Lake, round_: int) -> list[str]:
    """The run-log parts (`<stage>.<batch>`) with a row still in the round's spool, not yet committed; read only
    (a reader that commits them: `flush_stage_runs`)."""
    return (
        sorted({p.name.split("~", 1)[0] for p in _spooled(spool_dir(lake, round_))}) if spools(lake) else []
    )


def flush_stage_runs(lake: Lake, round_: int, reading: bool = False) -> int:
    """Commit the round's spooled run-log rows (one Delta commit: the round's run log with each spooled
    (stage, batch) row in place of its older one), then remove the spool files committed. Returns the rows
    committed; 0 (and no commit) when nothing is spooled. A spool file that cannot be read (cut short by a
    crash of the machine) is skipped with a warning and removed. `reading`: a reader's flush, which a lake it
    cannot write (read-only) does not stop: it reads the rows committed so far."""
    if not spools(lake):
        return 0
    folder = spool_dir(lake, round_)
    if not _spooled(folder):
        return 0
    if not reading:
        return _flush(lake, round_, folder)
    try:
        return _flush(lake, round_, folder)
    except (OSError, LakeError) as exc:
        log.warning("run log of round %s: spooled rows not committed (%s)", round_, exc)
        return 0


def _flush(lake: Lake, round_: int, folder: Path) -> int:
    with _flush_lock(lake, round_):
        files = _spooled(folder)  # again under the lock: another flush may have committed them
        if not files:
            return 0
        pending: dict[str, pa.Table] = {}
        for path in files:
            try:
                with pa.memory_map(str(path)) as source:
                    row = pa.ipc.open_file(source).read_all()
            except (OSError, pa.ArrowInvalid) as exc:
                log.warning("run log: skipping unreadable spool file %s (%s)", path, exc)
                continue
            pending[path.name.split("~", 1)[0]] = row.cast(_stage_runs.SCHEMA)
        if pending:  # in place of their older rows, the others as they are (one commit: tiny parts)
            lake.write_parts(TABLE, round_, pending)
        for path in files:
            path.unlink(missing_ok=True)
    return len(pending)


def read_stage_runs(lake: Lake, round_: int) -> pa.Table:
    flush_stage_runs(lake, round_, reading=True)
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
    if TABLE in tables:
        flush_stage_runs(lake, round_)
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
