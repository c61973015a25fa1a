"""`creditflow report`: the self-contained HTML credit report."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd(
        lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
        round_: list[int] = typer.Option(
            [], "--round", help="round(s) to show trajectories of (default: all)"
        ),
        out: Path = typer.Option(Path("report.html"), "--out", help="HTML file to write"),
        trajectories: int = typer.Option(8, help="sample trajectories per round in the viewer"),
    ) -> None:
        """Write one HTML file: summary tables, plots and a token-level trajectory viewer."""
        from flows.run import run_report

        run_report(lake, out, rounds=list(round_) or None, n_traj=trajectories)
