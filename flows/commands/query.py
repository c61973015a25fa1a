"""`creditflow query`: SQL over the lake on a read-only DuckDB connection (SELECT only; no file access outside
the lake's tables, no extensions: see `warehouse.catalog`), stopped after `--timeout` seconds and holding at
most `--memory-limit`."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path

import typer

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_MEMORY_LIMIT = "4GB"


class Format(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


def csv_ready(table):
    """CSV holds scalars only: list, struct and map columns are written as JSON text, and stderr names them."""
    import pyarrow as pa

    nested = [f.name for f in table.schema if pa.types.is_nested(f.type)]
    if not nested:
        return table
    for name in nested:
        i = table.column_names.index(name)
        as_json = pa.array(
            [None if v is None else json.dumps(v, default=str) for v in table.column(name).to_pylist()],
            pa.string(),
        )
        table = table.set_column(i, name, as_json)
    typer.secho(f"note: CSV has no nested types; written as JSON text: {', '.join(nested)}", err=True)
    return table


def register(app: typer.Typer) -> None:
    app.command("query")(query_cmd)


def query_cmd(
    sql: str = typer.Argument(..., help="SQL; every lake table and analysis view is a view"),
    lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
    fmt: Format = typer.Option(Format.table, "--format", help="table | csv | json | parquet"),
    out: Path | None = typer.Option(None, "--out", help="write the result here instead of stdout"),
    limit: int = typer.Option(50, help="rows shown in table format"),
    as_of: str | None = typer.Option(
        None,
        "--as-of",
        help="read the lake as of this version (the token `export` prints, table=v,...) or ISO time (Delta lakes)",
    ),
    timeout: float = typer.Option(
        DEFAULT_TIMEOUT_S, "--timeout", min=0, help="stop the query after this many seconds (0: no limit)"
    ),
    memory_limit: str = typer.Option(
        DEFAULT_MEMORY_LIMIT,
        "--memory-limit",
        help="memory DuckDB may hold (e.g. 512MB, 8GB); beyond it a query spills to a private temp folder",
    ),
) -> None:
    """Run SQL over the lake and print (or save) the result."""
    import duckdb

    from flows.run import require_lake
    from warehouse.catalog import QueryTimeout, query
    from warehouse.lake import LakeError

    if fmt is Format.table and out is not None:  # --out without --format: the file's suffix says which
        suffixes = {f".{f.value}": f for f in Format if f is not Format.table}
        if out.suffix.lower() not in suffixes:
            typer.secho(
                f"--out {out}: name a .csv, .json or .parquet file, or give --format", fg="red", err=True
            )
            raise typer.Exit(2)
        fmt = suffixes[out.suffix.lower()]
    require_lake(lake)  # a mistyped --lake is an error, not a new empty lake
    try:
        result = query(str(lake), sql, as_of=as_of, timeout_s=timeout or None, memory_limit=memory_limit)
    except LakeError as exc:
        typer.secho(f"query failed: {exc}", fg="red", err=True)
        raise typer.Exit(2) from exc
    except QueryTimeout as exc:
        typer.secho(f"query failed: {exc}; raise --timeout to let it run longer", fg="red", err=True)
        raise typer.Exit(2) from exc
    except OSError as exc:  # object storage (delta-rs's "Generic S3 error"): what failed, in one line
        from warehouse.delta_store import describe_store_error

        typer.secho(f"query failed: {describe_store_error(str(lake), exc)}", fg="red", err=True)
        raise typer.Exit(1) from None
    except duckdb.Error as exc:  # refused by the read-only guard, or a SQL error: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        typer.secho(f"query failed: {first}", fg="red", err=True)
        raise typer.Exit(2) from exc
    _write_result(result, fmt, out, limit)


def _write_result(result, fmt: Format, out: Path | None, limit: int) -> None:
    """The query's result as asked: a Parquet, CSV or JSON file (or CSV / JSON on stdout), else a table."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if fmt is Format.parquet:
        if out is None:
            typer.secho("--format parquet needs --out FILE", fg="red", err=True)
            raise typer.Exit(2)
        pq.write_table(result, out)
        typer.echo(f"wrote {result.num_rows} rows to {out}")
        return
    if fmt is Format.csv:
        result = csv_ready(result)
        if out:
            pacsv.write_csv(result, out)
            typer.echo(f"wrote {result.num_rows} rows to {out}")
        else:
            import io

            buf = io.BytesIO()
            pacsv.write_csv(result, buf)
            typer.echo(buf.getvalue().decode(), nl=False)
        return
    if fmt is Format.json:
        text = json.dumps(result.to_pylist(), default=str, indent=None)
        if out:
            out.write_text(text)
            typer.echo(f"wrote {result.num_rows} rows to {out}")
        else:
            typer.echo(text)
        return
    from flows.display import print_table

    print_table(result, limit=limit)
