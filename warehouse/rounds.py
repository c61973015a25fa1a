"""Round-level reads and writes. A round's `trajectories` and `steps` are written in aligned parts, each
holding whole groups (`part-b00000`, `part-b00001`, ...): a part is the unit of processing, so memory is
bounded by a part and an interrupted run resumes at the first missing part."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from warehouse.lake import Lake, temp_token

T = TypeVar("T")


def batch_name(index: int) -> str:
    return f"b{index:05d}"


def split_groups(
    trajectories: pa.Table, steps: pa.Table, batch_groups: int
) -> list[tuple[pa.Table, pa.Table]]:
    """Split a round into batches of whole groups (groups in sorted order)."""
    import polars as pl

    traj = pl.from_arrow(trajectories.select(["traj_id", "group_id"]))
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
    """Replace the round's trajectories and steps partitions with aligned batch parts."""
    batches = split_groups(trajectories, steps, batch_groups) or [(trajectories, steps)]
    names = [batch_name(i) for i in range(len(batches))]
    lake.replace_partition("trajectories", round_, {n: b[0] for n, b in zip(names, batches, strict=True)})
    lake.replace_partition("steps", round_, {n: b[1] for n, b in zip(names, batches, strict=True)})
    if quarantine is not None:
        lake.replace_partition("quarantine", round_, quarantine)
    return names


def write_round_parts(lake: Lake, round_: int, batches: Iterable[tuple[pa.Table, pa.Table]]) -> list[str]:
    """Streaming `write_round`: each (trajectories, steps) batch of whole groups becomes one aligned part
    (b00000, b00001, ...), validated and written to staging folders as it arrives (memory is one batch); once all
    are written the two partitions are swapped in, each in one rename. An error while writing leaves the lake as it was."""
    tables = ("trajectories", "steps")
    if lake.format != "parquet":  # a Delta lake: one commit per table (the batches are held until then)
        held = list(batches)
        if not held:
            from schemas import TABLES

            held = [(TABLES["trajectories"].empty(), TABLES["steps"].empty())]
        names = [batch_name(i) for i in range(len(held))]
        for k, table_name in enumerate(tables):
            lake.replace_partition(table_name, round_, {n: b[k] for n, b in zip(names, held, strict=True)})
        return names
    staging = {t: lake.table_dir(t) / f".staging-{temp_token()}" for t in tables}
    try:
        names: list[str] = []
        for index, batch in enumerate(batches):
            name = batch_name(index)
            for table_name, table in zip(tables, batch, strict=True):
                lake._write_file(
                    lake._prepare(table_name, table), staging[table_name] / f"part-{name}.parquet"
                )
            names.append(name)
        if not names:
            from schemas import TABLES

            for table_name in tables:
                empty = lake._prepare(table_name, TABLES[table_name].empty())
                lake._write_file(empty, staging[table_name] / f"part-{batch_name(0)}.parquet")
            names.append(batch_name(0))
        for table_name in tables:
            final = lake.partition_dir(table_name, round_)
            old = None
            if final.exists():
                old = lake.table_dir(table_name) / f".old-{temp_token()}"
                os.replace(final, old)
            os.replace(staging[table_name], final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return names
    finally:
        for path in staging.values():
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)


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
            yield item
