"""The read side of a Delta lake (`warehouse.delta_lake.DeltaLake` delegates to these): lake versions and time
travel (`table_at`), a part's identity and row count from the Delta log, the table as a pyarrow dataset of the
visible generation (what DuckDB scans), and `read` (with a fast local path reading the parts' data files)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from schemas import round_column
from warehouse.delta_store import PART
from warehouse.lake import (
    INGEST_TABLES,
    LakeError,
    safe_part_name,
    split_generation,
    tag_generation,
)

if TYPE_CHECKING:
    from warehouse.delta_lake import DeltaLake


def parse_version(token: str) -> dict[str, int] | dt.datetime:
    """`table=v,...` (a token from `version()`) or an ISO timestamp."""
    token = token.strip()
    if "=" in token:
        out = {}
        for item in token.split(","):
            name, _, v = item.partition("=")
            try:
                out[name.strip()] = int(v)
            except ValueError:
                raise LakeError(f"lake version {token!r}: {item!r} is not table=<int>") from None
        return out
    try:
        when = dt.datetime.fromisoformat(token)
    except ValueError:
        raise LakeError(
            f"lake version {token!r}: give a token from `export` (table=v,...) or an ISO timestamp"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def table_at(lake: DeltaLake, table: str, as_of: str | dict | dt.datetime | None):
    """The Delta table as of a lake version (None: absent then)."""
    if as_of is None:
        return lake._table(table)
    spec = parse_version(as_of) if isinstance(as_of, str) else as_of
    if isinstance(spec, dict):
        return lake._table(table, spec[table]) if table in spec else None
    t = lake._table(table, fresh=True)
    if t is None:
        return None
    try:
        t.load_as_version(spec)
    except Exception:  # noqa: BLE001 - created after that time
        return None
    return t


def part_stat(lake: DeltaLake, table: str, round_: int, part: str) -> tuple[str, int, int]:
    """(id, bytes, newest file's modification time in ns) of a part from the Delta log (-1: absent)."""
    name = safe_part_name(part)
    ident = f"{lake.table_uri(table)}/round={int(round_)}/part-{name}"
    acts = lake._actions(table)
    if acts is None or acts.num_rows == 0:
        return (f"{ident}:empty", 0, 0) if name in lake._empty_names(table, round_) else (ident, -1, 0)
    import pyarrow.compute as pc

    mask = pc.and_(
        pc.equal(acts.column("partition.round").cast(pa.int64()), int(round_)),
        pc.equal(acts.column(f"partition.{PART}"), name),
    )
    mine = acts.filter(mask)
    if mine.num_rows == 0:
        return (f"{ident}:empty", 0, 0) if name in lake._empty_names(table, round_) else (ident, -1, 0)
    mtime = pc.max(mine.column("modification_time").cast(pa.int64())).as_py()
    paths = ",".join(sorted(mine.column("path").to_pylist()))
    return (f"{ident}:{paths}", int(pc.sum(mine.column("size_bytes")).as_py()), int(mtime) * 1_000_000)


def count_rows(lake: DeltaLake, table: str, round_: int) -> int:
    acts = lake._actions(table)
    if acts is None or acts.num_rows == 0:
        return 0
    rounds = acts.column("partition.round").to_pylist()
    counts = acts.column("num_records").to_pylist()
    return sum(int(c or 0) for r, c in zip(rounds, counts, strict=True) if int(r) == int(round_))


def dataset(lake: DeltaLake, table: str, as_of=None):
    """The table as a pyarrow dataset (None when absent): what DuckDB scans. A table of a round's ingest:
    only the files of each round's visible generation (`generations`)."""
    t = lake.table_at(table, as_of)
    if t is None:
        return None
    if lake.remote:
        ds = t.to_pyarrow_dataset()
    else:  # Arrow's own file system, not delta-rs's Python one (`native_fs`)
        ds = t.to_pyarrow_dataset(filesystem=lake.native_fs(table))
    if table not in INGEST_TABLES:
        return ds
    import pyarrow.dataset as pads

    gens = lake.generations(as_of)
    fragments = []
    for fragment in ds.get_fragments():
        keys = pads.get_partition_keys(fragment.partition_expression)
        if split_generation(str(keys.get(PART, "")))[1] == gens.get(int(keys.get("round", -1)), ""):
            fragments.append(fragment)
    return pads.FileSystemDataset(fragments, ds.schema, ds.format, ds.filesystem)


def read(
    lake: DeltaLake,
    table_name: str,
    round_: int | Iterable[int] | None = None,
    columns: list[str] | None = None,
    parts: list[Path] | None = None,
    as_of=None,
) -> pa.Table:
    import pyarrow.dataset as pads

    from schemas import TABLES

    spec = TABLES.get(table_name)
    if not lake.remote and as_of is None and parts is not None and isinstance(round_, int):
        fast = read_files(lake, table_name, round_, [lake.part_name(p) for p in parts], columns)
        if fast is not None:
            return spec.conform(fast) if spec is not None and columns is None else fast
    ds = lake.dataset(table_name, as_of)
    if ds is None:
        if spec is None:
            return pa.table({})
        empty = spec.empty()
        return empty.select(columns) if columns else empty
    flt = None
    if round_ is not None:
        rounds = [int(round_)] if isinstance(round_, int) else [int(r) for r in round_]
        flt = pads.field("round").isin(pa.array(rounds, pa.int32()))
    if parts is not None:
        names = [lake.part_name(p) for p in parts]
        if table_name in INGEST_TABLES:  # stored with their generation (the dataset holds the visible one)
            names = [tag_generation(n, g) for n in names for g in {"", *lake.generations(as_of).values()}]
        cond = pads.field(PART).isin(pa.array(names, pa.string()))
        flt = cond if flt is None else flt & cond
    file_cols = None
    if columns is not None:
        held = spec.readable(ds.schema.names) if spec is not None else ds.schema.names
        missing = [c for c in columns if c not in held]
        if missing:
            raise KeyError(
                f"table {table_name!r}: no column {', '.join(map(repr, missing))}; "
                f"columns: {', '.join(n for n in ds.schema.names if n != PART)}"
            )
        file_cols = [c for c in columns if c in ds.schema.names]
    wanted = [c for c in (spec.derived if spec is not None else {}) if columns is None or c in columns]
    # a data file written before a derived column (its own schema, not the table's, which the log merged):
    # read with the column's sources and derive it there (a derived column may be null by right: values_mean
    # of a step without values, so its nulls do not say which files are older)
    older = wanted and any(
        c not in frag.physical_schema.names for frag in ds.get_fragments(filter=flt) for c in wanted
    )
    if older and spec is not None and columns is not None:
        file_cols = [c for c in spec.with_sources(list(columns)) or [] if c in ds.schema.names]
    out = ds.to_table(columns=file_cols, filter=flt)
    if older and spec is not None:
        out = spec.complete(out, columns)
    if PART in out.column_names:
        out = out.drop([PART])
    if spec is not None:
        if columns is None:
            out = spec.conform(out)
        else:
            out = out.select(columns)
    return out


def read_files(lake: DeltaLake, table: str, round_: int, names: list[str], columns: list[str] | None):
    """A local batch read without a dataset: the parts' data files from the Delta log, read one by one
    like hive parts (a dataset scan costs ~2x more per batch). None: take the dataset path."""
    from urllib.parse import unquote

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from schemas import TABLES

    acts = lake._actions(table)
    if acts is None or acts.num_rows == 0:
        return None
    mask = pc.and_(
        pc.equal(acts.column("partition.round").cast(pa.int64()), int(round_)),
        pc.is_in(acts.column(f"partition.{PART}"), value_set=pa.array(names, pa.string())),
    )
    paths = acts.filter(mask).column("path").to_pylist()
    if not paths:
        return None
    file_cols = None if columns is None else [c for c in columns if c != "round"]
    spec = TABLES.get(table)
    derived = spec.derived if spec is not None else {}
    pieces = []
    try:
        for rel in sorted(paths):
            with pq.ParquetFile(lake.root / table / unquote(rel)) as pf:
                names = pf.schema_arrow.names
                if file_cols is not None and any(c not in names and c not in derived for c in file_cols):
                    return None  # an older part without a column: the dataset reads it as nulls
                t = pf.read(columns=file_cols) if spec is None else spec.read_file(pf, file_cols)
            pieces.append(t.append_column("round", round_column(round_, t.num_rows)))
    except (OSError, pa.ArrowInvalid):
        return None
    out = pa.concat_tables(pieces, promote_options="permissive")
    return out if columns is None else out.select(columns)
