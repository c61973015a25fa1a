"""Round-level reads and writes. A round's `trajectories` and `steps` are written in aligned parts, each
holding whole groups (`part-b00000`, `part-b00001`, ...): a part is the unit of processing, so memory is
bounded by a part and an interrupted run resumes at the first missing part."""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from typing import TypeVar, cast

import pyarrow as pa
import pyarrow.compute as pc

from schemas import TABLES
from warehouse.lake import PUBLISH_DIR, Lake, fault_point, new_generation
from warehouse.tempfiles import temp_token

T = TypeVar("T")


def batch_name(index: int) -> str:
    return f"b{index:05d}"


def split_groups(
    trajectories: pa.Table, steps: pa.Table, batch_groups: int
) -> list[tuple[pa.Table, pa.Table]]:
    """Split a round into batches of whole groups (groups in sorted order)."""
    import polars as pl

    traj = cast(pl.DataFrame, pl.from_arrow(trajectories.select(["traj_id", "group_id"])))
    groups = traj["group_id"].unique().sort()
    out = []
    for start in range(0, len(groups), batch_groups):
        chosen = groups[start : start + batch_groups]
        t = trajectories.filter(pc.is_in(trajectories.column("group_id"), value_set=chosen.to_arrow()))
        s = steps.filter(pc.is_in(steps.column("traj_id"), value_set=t.column("traj_id")))
        out.append((t, s))
    return out


def write_round(
    lake: Lake,
    round_: int,
    trajectories: pa.Table,
    steps: pa.Table,
    batch_groups: int = 64,
    quarantine: pa.Table | None = None,
) -> list[str]:
    """Replace the round's trajectories and steps (and quarantine, when given) with aligned batch parts, all of
    them or none (`write_round_parts`)."""
    batches = split_groups(trajectories, steps, batch_groups) or [(trajectories, steps)]
    return write_round_parts(lake, round_, batches, quarantine)


def write_round_parts(
    lake: Lake,
    round_: int,
    batches: Iterable[tuple[pa.Table, pa.Table]],
    quarantine: pa.Table | None = None,
) -> list[str]:
    """Write a round's ingest tables as one: each (trajectories, steps) batch of whole groups becomes one aligned
    part (b00000, b00001, ...), and `quarantine` the round's quarantine (None: the round's quarantine stays).
    Readers see the round as it was until every table is written, then the new round whole: a run killed at
    any point, or stopped by a full disk, leaves one or the other, never half, and a re-run completes it.

    Hive Parquet: every partition is written to a staging folder as its batch arrives (memory is one batch),
    then a journal naming the moves is committed and the folders renamed in (`Lake.publish`; a kill after the
    journal is rolled forward by the next reader). Delta: the steps and quarantine parts are committed with a
    new generation that no reader sees, then the round's trajectories are replaced with parts of that
    generation in one commit, which publishes the round (`DeltaLake.generations`); older generations go last."""
    if lake.format != "parquet":
        return _write_round_delta(lake, round_, list(batches), quarantine)
    lake.cleanup()  # a killed writer's staging folders (its finished publish rolled forward first)
    tables = ("trajectories", "steps")
    staging = {t: lake.table_dir(t) / f".staging-{temp_token()}" for t in (*tables, "quarantine")}
    try:
        names: list[str] = []
        for index, batch in enumerate(batches):
            name = batch_name(index)
            for table_name, table in zip(tables, batch, strict=True):
                lake._write_file(
                    lake._prepare(table_name, table), staging[table_name] / f"part-{name}.parquet"
                )
            names.append(name)
            fault_point("ingest-stage")
        if not names:
            for table_name in tables:
                empty = lake._prepare(table_name, TABLES[table_name].empty())
                lake._write_file(empty, staging[table_name] / f"part-{batch_name(0)}.parquet")
            names.append(batch_name(0))
        if quarantine is not None:
            lake._write_file(
                lake._prepare("quarantine", quarantine), staging["quarantine"] / "part-0.parquet"
            )
        else:
            del staging["quarantine"]
        fault_point("ingest-staged")
        lake.publish(round_, staging)
        return names
    finally:
        for path in staging.values():
            if path.exists() and not any((lake.root / PUBLISH_DIR).glob(f"round={int(round_)}.*.json")):
                shutil.rmtree(path, ignore_errors=True)


def _write_round_delta(
    lake: Lake, round_: int, held: list[tuple[pa.Table, pa.Table]], quarantine: pa.Table | None
) -> list[str]:
    if not held:
        held = [(TABLES["trajectories"].empty(), TABLES["steps"].empty())]
    names = [batch_name(i) for i in range(len(held))]
    gen = new_generation()
    if quarantine is None:  # the round's quarantine stays: carried into the new generation
        kept = {
            lake.part_name(p): lake.read("quarantine", round_, parts=[p])
            for p in lake.parts("quarantine", round_)
        }
    else:
        kept = {"0": quarantine}
    lake.replace_partition("quarantine", round_, kept, gen=gen, staged=True)
    fault_point("ingest-stage")
    lake.replace_partition(
        "steps", round_, {n: b[1] for n, b in zip(names, held, strict=True)}, gen=gen, staged=True
    )
    fault_point("ingest-staged")
    lake.replace_partition(  # the publish: one commit
        "trajectories", round_, {n: b[0] for n, b in zip(names, held, strict=True)}, gen=gen
    )
    fault_point("ingest-published")
    lake.drop_generations(round_, gen)
    return names


def batch_names(lake: Lake, round_: int) -> list[str]:
    names = [lake.part_name(p) for p in lake.parts("trajectories", round_)]
    steps = {lake.part_name(p) for p in lake.parts("steps", round_)}
    missing = [n for n in names if n not in steps]
    if missing:
        raise FileNotFoundError(f"round {round_}: steps part(s) {missing} missing for trajectories parts")
    return names


def read_batch(lake: Lake, table: str, round_: int, batch: str, columns: list[str] | None = None) -> pa.Table:
    path = lake.partition_dir(table, round_) / f"part-{batch}.parquet"
    if table in ("trajectories", "steps"):
        return lake.read(table, round_, columns=columns, parts=[path])
    # annotation tables are written per batch with the same name (or absent)
    if not lake.has_part(table, round_, batch):
        from schemas import TABLES

        return TABLES[table].empty()
    return lake.read(table, round_, columns=columns, parts=[path])


def prefetched(batches: Iterator[T]) -> Iterator[T]:
    """The items of `batches`, the next one made on a worker thread while the caller uses this one (NumPy,
    Arrow and Parquet release the GIL), so at most two are in memory."""
    from concurrent.futures import ThreadPoolExecutor

    it = iter(batches)
    done = object()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") as pool:
        pending = pool.submit(next, it, done)
        while True:
            item = pending.result()
            if item is done:
                return
            pending = pool.submit(next, it, done)
            yield cast(T, item)
