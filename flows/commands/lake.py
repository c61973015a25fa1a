"""`creditflow lake`: the lake's format, version, migration (hive Parquet -> Delta) and upkeep (vacuum,
compact)."""

from __future__ import annotations

import typer

# warehouse.maintenance.DEFAULT_RETAIN_HOURS, not imported: the CLI starts light (a test keeps them equal)
DEFAULT_RETAIN_HOURS = 168


def register(app: typer.Typer) -> None:
    lake_app = typer.Typer(
        help="The lake itself: its format and version, migrating it to Delta, vacuum and compact.",
        no_args_is_help=True,
    )
    app.add_typer(lake_app, name="lake")

    lake_app.command("info")(info_cmd)
    lake_app.command("migrate")(migrate_cmd)
    lake_app.command("vacuum")(vacuum_cmd)
    lake_app.command("compact")(compact_cmd)


def info_cmd(
    lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
) -> None:
    """The lake's format, its tables and rounds, and (Delta) its version."""
    from flows.display import print_kv
    from flows.run import require_lake
    from schemas import TABLES
    from warehouse.lake import Lake

    require_lake(lake)
    store = Lake(lake)
    shown: dict = {"format": store.format, "uri": store.uri}
    for table in TABLES:
        rounds = store.rounds(table)
        if rounds:
            shown[table] = "rounds " + ",".join(map(str, rounds))
    if store.format == "delta":
        shown["version"] = store.version()
    print_kv("creditflow lake", shown)


def migrate_cmd(
    lake: str = typer.Option("lake", "--lake", help="a hive-Parquet lake folder (converted in place)"),
    to: str | None = typer.Option(
        None, "--to", help="write the Delta lake here instead (a folder, s3://..., gs://...)"
    ),
) -> None:
    """Convert a hive-Parquet lake to Delta without re-ingesting (table by table; each table is either
    the old or the new one at any time). Parts, rounds and rows are kept."""
    from flows.display import print_kv
    from flows.run import require_lake
    from warehouse.delta_migrate import migrate
    from warehouse.lake import LakeError

    require_lake(lake)
    try:
        counts = migrate(lake, to)
    except LakeError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(2) from exc
    print_kv("creditflow lake migrate", {"to": to or lake, **{t: f"{n} rows" for t, n in counts.items()}})


def vacuum_cmd(
    lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
    retain_hours: int = typer.Option(
        DEFAULT_RETAIN_HOURS,
        "--retain-hours",
        help="keep every file a lake version of the last H hours needs: `query --as-of` and an export's "
        "lake version can read back that far and no further (below the default needs --force)",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="list what would be removed; remove nothing"),
    force: bool = typer.Option(
        False,
        "--force",
        help="allow --retain-hours below the default: only when no run is writing to the lake (its "
        "uncommitted files could go) and no older version is needed",
    ),
) -> None:
    """Delete the files no recent lake version needs: per Delta table, the files older versions alone
    reference and the leftovers of killed writers, older than --retain-hours (delta-rs vacuum). Versions
    older than that can no longer be read by `query --as-of`. On a hive-Parquet lake (no versions) it
    removes dead writers' temporary files, which is all it can do there."""
    from warehouse.maintenance import cleanup_leftovers, vacuum

    store = _open(lake)
    shown: dict = {"uri": store.uri, "format": store.format}
    removed = []
    if store.format == "delta":
        removed = _or_exit(lambda: vacuum(store, retain_hours, dry_run=dry_run, force=force))
        shown["retention"] = f"{retain_hours:g} h"
    removed.append(cleanup_leftovers(store, dry_run=dry_run))
    _summary("creditflow lake vacuum" + (" (dry run)" if dry_run else ""), shown, removed, dry_run)
    if store.format != "delta":
        typer.echo(
            "a hive-Parquet lake keeps no old versions: removing dead writers' temporary files is all vacuum "
            "does here (`creditflow lake migrate` converts the lake to Delta)"
        )


def compact_cmd(
    lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="count the files in partitions that hold more than one; change nothing"
    ),
) -> None:
    """Merge the small files of each Delta partition (delta-rs optimize.compact; one commit per table that
    has any). A part the flow writes is one file, so there is usually little to merge; the replaced files
    stay for `query --as-of` until `lake vacuum`."""
    from warehouse.maintenance import compact

    store = _open(lake)
    removed = _or_exit(lambda: compact(store, dry_run=dry_run))
    _summary(
        "creditflow lake compact" + (" (dry run)" if dry_run else ""),
        {"uri": store.uri},
        removed,
        dry_run,
    )


def _open(lake: str):
    from flows.run import require_lake
    from warehouse.lake import Lake

    require_lake(lake)
    return Lake(lake)


def _or_exit(fn):
    from warehouse.lake import LakeError

    try:
        return fn()
    except LakeError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(2) from exc


def _summary(title: str, shown: dict, removed: list, dry_run: bool) -> None:
    from flows.display import print_kv
    from warehouse.maintenance import human_bytes

    verb = "would remove" if dry_run else "removed"
    for r in removed:
        if r.files:
            shown[r.table] = f"{verb} {r.files} files, {human_bytes(r.bytes)}"
    files, size = sum(r.files for r in removed), sum(r.bytes for r in removed)
    shown["total"] = f"{verb} {files} files, {human_bytes(size)}"
    print_kv(title, shown)
