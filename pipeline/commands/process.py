"""`creditflow process` and `creditflow export`."""

from __future__ import annotations

from pathlib import Path

import typer


def _methods(raw: str | None) -> list[str] | None:
    if raw is None:
        return None
    return [m.strip() for m in raw.split(",") if m.strip()]


def register(app: typer.Typer) -> None:
    @app.command("process")
    def process_cmd(
        lake: Path | None = typer.Option(None, "--lake", help="lake folder (config: lake)"),
        round_: int = typer.Option(..., "--round", help="round to process"),
        methods: str | None = typer.Option(None, "--methods", help="comma-separated method chains"),
        config: Path | None = typer.Option(None, "--config", help="YAML config file"),
        sets: list[str] = typer.Option([], "--set", help="override: stage.key=value (repeatable)"),
        annotator: str | None = typer.Option(None, "--annotator", help="IAPO annotator: rules | llm"),
    ) -> None:
        """Compute every requested credit method on a round and write the advantages table."""
        from flows.run import run_process
        from pipeline.config import load_config

        cfg = load_config(config, sets, lake=str(lake) if lake else None, methods=_methods(methods),
                          annotator=annotator)
        run_process(cfg, round_)

    @app.command("export")
    def export_cmd(
        lake: Path = typer.Option(Path("lake"), "--lake", help="lake folder"),
        round_: int = typer.Option(..., "--round", help="round"),
        method: str = typer.Option(..., "--method", help="method chain to export"),
        out: Path = typer.Option(..., "--out", help="output Parquet file"),
        layout: str = typer.Option("flat", "--layout", help="flat (Parquet, one row per trajectory) | verl | openrlhf | skyrl (padded NumPy .npz)"),
    ) -> None:
        """Write one method's advantages as a per-trajectory training batch."""
        from flows.run import run_export

        run_export(Path(lake), round_, method, out, layout)
