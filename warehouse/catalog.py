"""The DuckDB catalog: every lake table as a view of the same name over all rounds, plus the named
analysis views registered in `warehouse.views`. Queries run on a read-only connection."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from schemas import TABLES
from warehouse.lake import Lake
from warehouse.views import VIEWS

CATALOG_FILE = "catalog.duckdb"


def _quote(path: Path | str) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def _empty_file(lake: Lake, table: str) -> Path:
    path = lake.root / "_empty" / f"{table}.parquet"
    if not path.exists():
        spec = TABLES[table]
        schema = (
            spec.schema.remove(spec.schema.get_field_index("round"))
            if "round" in spec.schema.names
            else spec.schema
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{uuid.uuid4().hex}.parquet")
        pq.write_table(schema.empty_table(), tmp)
        os.replace(tmp, path)
    return path


def table_view_sql(lake: Lake, table: str) -> str:
    has_files = any(lake.parts(table, r) for r in lake.rounds(table))
    if has_files:
        glob = lake.table_dir(table) / "round=*" / "part-*.parquet"
        src = (
            f"read_parquet({_quote(glob)}, hive_partitioning=true, union_by_name=true, "
            "hive_types={'round': INTEGER})"
        )
        return f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM {src}"
    src = f"read_parquet({_quote(_empty_file(lake, table))})"
    return f"CREATE OR REPLACE VIEW {table} AS SELECT CAST(NULL AS INTEGER) AS round, * FROM {src}"


def build_catalog(lake: Lake, con: duckdb.DuckDBPyConnection) -> None:
    for table in TABLES:
        con.execute(table_view_sql(lake, table))
    for view in VIEWS.values():
        con.execute(f"CREATE OR REPLACE VIEW {view.name} AS {view.sql}")


def refresh(lake: Lake) -> Path:
    """(Re)build LAKE/catalog.duckdb atomically: views only, the data stays in Parquet."""
    lake.root.mkdir(parents=True, exist_ok=True)
    target = lake.root / CATALOG_FILE
    tmp = lake.root / f".tmp-{uuid.uuid4().hex}.duckdb"
    con = duckdb.connect(str(tmp))
    try:
        build_catalog(lake, con)
    finally:
        con.close()
    os.replace(tmp, target)
    return target


def connect(lake: Lake | str, read_only: bool = True) -> duckdb.DuckDBPyConnection:
    """A connection with every table and view defined. Read-only by default."""
    lake = lake if isinstance(lake, Lake) else Lake(lake)
    if not read_only:
        con = duckdb.connect()
        build_catalog(lake, con)
        return con
    path = refresh(lake)
    return duckdb.connect(str(path), read_only=True)


def query(lake: Lake | str, sql: str):
    """Run SQL on a read-only connection; returns a pyarrow Table."""
    con = connect(lake, read_only=True)
    try:
        return con.sql(sql).to_arrow_table()
    finally:
        con.close()
