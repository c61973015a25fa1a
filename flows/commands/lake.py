"""`creditflow lake`: the lake's format, version and migration (hive Parquet -> Delta)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    lake_app = typer.Typer(
        help="The lake itself: its format and version, and migrating it to Delta.", no_args_is_help=True
    )
    app.add_typer(lake_app, name="lake")

    @lake_app.command("info")
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

    @lake_app.command("migrate")
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
        from warehouse.delta_lake import migrate
        from warehouse.lake import LakeError

        require_lake(lake)
        try:
            counts = migrate(lake, to)
        except LakeError as exc:
            typer.secho(str(exc), fg="red", err=True)
            raise typer.Exit(2) from exc
        print_kv("creditflow lake migrate", {"to": to or lake, **{t: f"{n} rows" for t, n in counts.items()}})
