"""`creditflow loop`: R rounds of collect -> process -> train (trainer/loop.py), resumable."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("loop")
    def loop_cmd(
        config: Path | None = typer.Option(
            None, "--config", help="YAML config (stages.loop, stages.collect, stages.train, methods, lake)"
        ),
        sets: list[str] = typer.Option([], "--set", help="stage.key=value overrides, e.g. loop.rounds=2"),
    ) -> None:
        """Run (or resume) the collect -> process -> train loop; prints per-round timings."""
        import pyarrow as pa

        from flows.config import load_config
        from flows.display import print_table

        cfg = load_config(config, sets)
        from flows.round_loop import run_loop

        rows = run_loop(cfg, log=typer.echo)
        keys = [
            "round",
            "policy",
            "episodes",
            "mean_reward",
            "collect_s",
            "process_s",
            "export_s",
            "train_s",
            "total_s",
            "skipped",
        ]
        if rows:
            print_table(
                pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), title="creditflow loop"
            )
