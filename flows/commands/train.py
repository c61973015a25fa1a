"""`creditflow train`: one policy update from an exported batch Parquet."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_cmd(
        batch: Path = typer.Option(..., "--batch", help="exported batch (creditflow export)"),
        model: Path = typer.Option(
            ..., "--model", help="Hugging Face model folder (policy before the update)"
        ),
        out: Path = typer.Option(..., "--out", help="folder for the updated checkpoint"),
        lake: Path | None = typer.Option(None, "--lake", help="write train_metrics into this lake"),
        config: Path | None = typer.Option(None, "--config", help="YAML config (stages.train)"),
        sets: list[str] = typer.Option([], "--set", help="train.key=value overrides"),
        ref_model: Path | None = typer.Option(None, "--ref-model", help="reference model for the KL term"),
    ) -> None:
        """Clipped-surrogate policy update with the batch's per-token advantages; saves a HF checkpoint."""
        from rich.progress import Progress

        from flows.config import load_config
        from flows.display import console, print_kv, print_table
        from trainer.train import TrainSettings, train

        cfg = load_config(config, sets)
        settings = cfg.settings(TrainSettings)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("train", total=None)
            metrics = train(
                batch,
                model,
                out,
                settings,
                ref_model_dir=ref_model,
                progress=lambda step: progress.update(task, completed=step),
            )
        if lake is not None:
            from warehouse.lake import Lake

            round_ = metrics.column("round")[0].as_py() if metrics.num_rows else 0
            Lake(lake).write_part("train_metrics", round_, metrics, part=f"{batch.stem}")
        print_table(
            metrics.select(
                ["step", "tokens", "loss", "pg_loss", "clip_frac", "approx_kl", "entropy", "grad_norm"]
            ),
            title="train_metrics",
        )
        print_kv("creditflow train", {"batch": str(batch), "steps": metrics.num_rows, "checkpoint": str(out)})
