"""The DuckDB catalog: every lake table as a view of the same name over all rounds, plus the named
analysis views registered in `warehouse.views`. Queries run on a read-only, locked connection.

The views are built for each connection from the lake as it is (#25): no catalog file is read and no path is
stored, so a copied or pruned lake reads its own files. Hive Parquet: `read_parquet` over the table's part files;
Delta (local or object storage): each table's Arrow dataset registered on the connection (delta-rs reads the
storage; DuckDB needs no extension and no file access). `refresh` still writes LAKE/catalog.duckdb for outside
tools on a hive lake.

The guard of `query` (what `creditflow query` runs), in two layers:
- only SELECT statements (and EXPLAIN of one) are run: COPY, ATTACH, INSTALL/LOAD, SET/RESET, PRAGMA,
  CREATE/INSERT/DROP, EXPORT, ... are refused before DuckDB executes anything (`QueryRefused`);
- the connection itself (in memory) has `enable_external_access=false`, file access limited to the lake's
  table folders (none on a Delta lake) (`allowed_directories`), extension autoinstall/autoload and community
  extensions off, DuckDB's temp folder (which SQL may read) a private one per query or none, and
  `lock_configuration=true` (no SET can undo any of it). `query` also takes a time and a memory limit.
DuckDB cannot make a directory read-only but readable, so the statement check is what stops a write inside
the lake; the connection settings stop reads and writes everywhere else, and any extension."""

from __future__ import annotations

import os
import re
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, cast

import duckdb
import pyarrow.parquet as pq

from schemas import TABLES, TableSpec
from warehouse.lake import Lake, LakeError
from warehouse.tempfiles import temp_token
from warehouse.views import VIEWS

if TYPE_CHECKING:
    from warehouse.delta_lake import DeltaLake

CATALOG_FILE = "catalog.duckdb"

# settings fixed when the connection opens (the rest are SET before the configuration is locked)
_SAFE_CONFIG = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "allow_unsigned_extensions": False,
    "allow_persistent_secrets": False,
}
_EXPLAIN = re.compile(r"^\s*explain\b(\s+analy[sz]e\b)?", re.IGNORECASE)


class QueryRefused(duckdb.PermissionException):
    """A statement the read-only query guard does not run (one line, naming the statement type)."""


def _quote(path: Path | str) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def _empty_file(lake: Lake, table: str) -> Path:
    """An empty Parquet file of the table's schema (`round` left out: the path holds it), written again when the
    schema changed since (a lake written by an older creditflow)."""
    path = lake.root / "_empty" / f"{table}.parquet"
    spec = TABLES[table]
    schema = (
        spec.schema.remove(spec.schema.get_field_index("round"))
        if "round" in spec.schema.names
        else spec.schema
    )
    if not path.exists() or not pq.read_schema(path).equals(schema):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{temp_token()}.parquet")
        pq.write_table(schema.empty_table(), tmp)
        os.replace(tmp, path)
    return path


def table_view_sql(lake: Lake, table: str) -> str:
    spec = TABLES[table]
    rounds = lake.rounds(table)
    if spec.derived:  # every part of every round, listed once: the view checks them (`_hold_all`)
        parts = [p for r in rounds for p in lake.parts(table, r)]
        has_files = bool(parts)
    else:  # up to the first round with a part
        parts, has_files = [], any(lake.parts(table, r) for r in rounds)
    if has_files:
        glob = lake.table_dir(table) / "round=*" / "part-*.parquet"
        src = (
            f"read_parquet({_quote(glob)}, hive_partitioning=true, union_by_name=true, "
            "hive_types={'round': INTEGER})"
        )
        if spec.derived:  # every column of the schema, whether the parts hold it or not (older ones)
            empty = f"SELECT CAST(NULL AS INTEGER) AS round, * FROM read_parquet({_quote(_empty_file(lake, table))})"
            src = f"(SELECT * FROM {src} UNION ALL BY NAME {empty})"
            if not _hold_all(spec, parts):
                return f"CREATE OR REPLACE VIEW {table} AS {_derived_select(table, None, src)}"
        return f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM {src}"
    src = f"read_parquet({_quote(_empty_file(lake, table))})"
    return f"CREATE OR REPLACE VIEW {table} AS SELECT CAST(NULL AS INTEGER) AS round, * FROM {src}"


def _hold_all(spec: TableSpec, parts: list[Path]) -> bool:
    """Whether no part file `lacks` a derived column of `spec` (its footer's schema), each of the schema's type:
    then the view reads the parts' own derived columns and derives nothing. The lake writes them into every part,
    so only a lake written before a column needs the derivation; it reads the derivation's sources too, whatever
    a query asks for (`SELECT sum(n_tokens)` read every `token_ids`: 56 against 2 ms on a 24.5M-token round). A
    footer that cannot be read, or a column of another type (a file the lake did not write), counts as lacking
    them: the view derives, and casts, as before."""
    for path in parts:
        try:
            schema = pq.read_schema(path)
        except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
            return False
        if spec.lacks(None, schema.names):
            return False
        if any(schema.field(name).type != spec.schema.field(name).type for name in spec.derived):
            return False
    return True


def _derived_select(table: str, present: list[str] | None, src: str, exclude: str = "") -> str:
    """SELECT of the table's view that derives its derived columns (schemas `Derived`) where older parts lack
    them: the parts' own value where they hold it, the derivation where null. `present`: the columns `src` gives
    (None: every column of the schema)."""
    spec = TABLES[table]
    replace, add = [], []
    for name, d in spec.derived.items():
        typ = _SQL_TYPES[str(spec.schema.field(name).type)]
        if present is None or name in present:
            replace.append(f"CAST(coalesce({name}, {d.sql}) AS {typ}) AS {name}")
        elif set(d.sources) <= set(present):
            add.append(f"CAST({d.sql} AS {typ}) AS {name}")
    star = "*" + (f" EXCLUDE ({exclude})" if exclude else "")
    star += f" REPLACE ({', '.join(replace)})" if replace else ""
    return f"SELECT {', '.join([star, *add])} FROM {src}"


_SQL_TYPES = {"int32": "INTEGER", "int64": "BIGINT", "double": "DOUBLE"}


def _delta_catalog(lake: DeltaLake, con: duckdb.DuckDBPyConnection, as_of=None) -> None:
    """A Delta lake's tables as Arrow datasets registered on this connection (no path is stored anywhere;
    object storage is read by delta-rs/Arrow, not by a DuckDB extension). The latest lake's spooled run-log
    rows are committed first, as every reader of the run log does (warehouse.runlog): a run killed before its
    flush shows its rows in `stage_runs` and the views over it."""
    if as_of is None:
        flush_spooled_runs(lake)
    for table in TABLES:
        ds = lake.dataset(table, as_of)
        if ds is None:
            spec = TABLES[table]
            con.register(f"_delta_{table}", spec.empty())
            con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT * FROM _delta_{table}")
            continue
        con.register(f"_delta_{table}", ds)
        select = _derived_select(table, ds.schema.names, f"_delta_{table}", exclude="_part")
        con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS {select}")
    for view in VIEWS.values():
        con.execute(f"CREATE OR REPLACE TEMP VIEW {view.name} AS {view.sql}")


def flush_spooled_runs(lake: Lake) -> int:
    """Commit the run-log rows spooled for any round (a reader's flush: a lake it cannot write is read as
    committed); returns the rows committed. Nothing to do (a folder listing) on a lake that spools none."""
    from warehouse.runlog import SPOOL_DIR, flush_stage_runs, spools

    root = lake.root / SPOOL_DIR
    if not spools(lake) or not root.is_dir():
        return 0
    rounds = [p.name.split("=", 1)[1] for p in root.iterdir() if p.is_dir() and p.name.startswith("round=")]
    return sum(flush_stage_runs(lake, int(r), reading=True) for r in sorted(rounds) if r.isdigit())


def build_catalog(lake: Lake, con: duckdb.DuckDBPyConnection, as_of=None) -> None:
    if lake.format == "delta":
        _delta_catalog(cast("DeltaLake", lake), con, as_of)
        return
    if as_of is not None:
        raise LakeError(
            f"lake {lake.uri} is hive Parquet, which keeps no versions: `creditflow lake migrate --lake "
            f"{lake.uri}` converts it to Delta"
        )
    for table in TABLES:
        con.execute(table_view_sql(lake, table))
    for view in VIEWS.values():
        con.execute(f"CREATE OR REPLACE VIEW {view.name} AS {view.sql}")


def refresh(lake: Lake) -> Path | None:
    """(Re)build LAKE/catalog.duckdb atomically for outside tools (views only, the data stays in Parquet); a
    Delta lake has none (every connection registers the tables itself). `connect` does not use the file."""
    if lake.format != "parquet":
        return None
    lake.root.mkdir(parents=True, exist_ok=True)
    target = lake.root / CATALOG_FILE
    tmp = lake.root / f".tmp-{temp_token()}.duckdb"
    con = duckdb.connect(str(tmp))
    try:
        build_catalog(lake, con)
    finally:
        con.close()
    os.replace(tmp, target)
    return target


def allowed_directories(lake: Lake) -> list[str]:
    """The folders a read-only connection may read: each table's folder and the empty-table files."""
    if lake.format != "parquet":  # the tables are registered Arrow datasets: no file access at all
        return []
    dirs = [lake.table_dir(table) for table in TABLES] + [lake.root / "_empty"]
    return [str(d) + os.sep for d in dirs]


def lock_down(con: duckdb.DuckDBPyConnection, lake: Lake) -> None:
    """No file access outside the lake's tables, no extensions, and no SET that could undo it."""
    dirs = ", ".join(_quote(d) for d in allowed_directories(lake))
    if dirs:
        con.execute(f"SET allowed_directories = [{dirs}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def connect(
    lake: Lake | str,
    read_only: bool = True,
    as_of=None,
    temp_directory: str = "",
    memory_limit: str | None = None,
) -> duckdb.DuckDBPyConnection:
    """A connection with every table and view defined, built for this connection from the lake as it is now
    (or as of a lake version, Delta only): no catalog file, no stored path. Read-only (and locked down) by
    default; then DuckDB spills to `temp_directory` only (SQL may read the folder DuckDB spills to, so it is a
    private one or none: "" spills nothing, where DuckDB's default is `.tmp` under the working directory) and
    holds at most `memory_limit` (DuckDB's size syntax, e.g. "4GB"; None: DuckDB's default)."""
    lake = lake if isinstance(lake, Lake) else Lake(lake)
    if not read_only:
        con = duckdb.connect()
        build_catalog(lake, con, as_of)
        return con
    con = duckdb.connect(":memory:", config=dict(_SAFE_CONFIG))
    try:
        con.execute(f"SET temp_directory = {_quote(temp_directory)}")
        if memory_limit is not None:
            con.execute(f"SET memory_limit = {_quote(memory_limit)}")
        build_catalog(lake, con, as_of)
        lock_down(con, lake)
    except BaseException:
        con.close()
        raise
    return con


def _explains_a_select(text: str) -> bool:
    match = _EXPLAIN.match(text)
    if match is None or match.group(1):  # EXPLAIN ANALYZE executes its statement: SELECT it instead
        return False
    try:
        inner = duckdb.extract_statements(text[match.end() :])
    except duckdb.Error:
        return False
    return [s.type for s in inner] == [duckdb.StatementType.SELECT]


def check_read_only(sql: str) -> None:
    """Raise `QueryRefused` unless every statement in `sql` is a SELECT (or an EXPLAIN of one)."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise type(exc)(str(exc).splitlines()[0]) from None
    if not statements:
        raise QueryRefused("query is empty: give one SELECT statement")
    for statement in statements:
        kind = statement.type
        if kind == duckdb.StatementType.EXPLAIN:
            if _explains_a_select(statement.query):
                continue
        elif kind == duckdb.StatementType.SELECT:
            continue
        name = kind.name.replace("_", " ")
        if kind == duckdb.StatementType.LOAD:  # INSTALL, FORCE INSTALL and LOAD share one type
            name = "INSTALL" if "INSTALL" in statement.query[:40].upper() else "LOAD"
        raise QueryRefused(
            f"query is read-only: {name} statements are refused (only SELECT, or EXPLAIN of a SELECT, runs)"
        )


class QueryTimeout(duckdb.InterruptException):
    """A query stopped at its time limit (one line, naming the limit)."""


def query(
    lake: Lake | str,
    sql: str,
    as_of=None,
    timeout_s: float | None = None,
    memory_limit: str | None = None,
):
    """Run read-only SQL (SELECT only, on a locked-down connection); returns a pyarrow Table.
    Raises `QueryRefused` (a `duckdb.Error`) for any other statement, before anything runs.
    `as_of`: a lake version (`Lake.version()` token or ISO timestamp) to read instead of the latest (Delta).
    `timeout_s`: the query is interrupted after this long (`QueryTimeout`); `memory_limit`: DuckDB holds at most
    this much (e.g. "4GB"), spilling the rest to a private temporary folder removed afterwards, and a query that
    needs more raises `duckdb.OutOfMemoryException` with one line naming the limit."""
    check_read_only(sql)
    with tempfile.TemporaryDirectory(prefix="creditflow-query-") as spill:
        con = connect(lake, read_only=True, as_of=as_of, temp_directory=spill, memory_limit=memory_limit)
        timer = threading.Timer(timeout_s, con.interrupt) if timeout_s else None
        try:
            if timer is not None:
                timer.daemon = True
                timer.start()
            return con.sql(sql).to_arrow_table()
        except duckdb.InterruptException:
            if timer is not None and timer.finished.is_set():
                raise QueryTimeout(f"query stopped at its time limit ({timeout_s:g} s)") from None
            raise
        except duckdb.OutOfMemoryException as exc:
            first = str(exc).strip().splitlines()[0]
            limit = memory_limit or "DuckDB's default"
            raise duckdb.OutOfMemoryException(f"{first} (memory limit {limit})") from None
        finally:
            if timer is not None:
                timer.cancel()
            con.close()
