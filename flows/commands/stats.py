"""`creditflow stats`: the round summary `creditflow process` prints, read back from the lake."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("stats")
    def stats_cmd(
        lake: str = typer.Option("lake", "--lake", help="lake folder (or file:// URL)"),
        round_: int = typer.Option(..., "--round", help="round to summarise"),
    ) -> None:
        """Trajectories, tokens, spans, edges, LLM calls and cache hits, time per stage, quarantine, outputs."""
        from flows.run import run_stats

        run_stats(Path(lake) if "://" not in lake else lake, round_)
