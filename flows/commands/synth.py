"""`creditflow synth`: write a round of synthetic rollouts (search-QA and/or tool-service) into a lake."""

from __future__ import annotations

import time
from enum import StrEnum

import typer


class Kind(StrEnum):
    search = "search"
    tool = "tool"
    mixed = "mixed"


def register(app: typer.Typer) -> None:
    @app.command("synth")
    def synth_cmd(
        groups: int = typer.Option(64, "--groups", min=1, help="prompts (groups) in the round"),
        samples: int = typer.Option(8, "--samples", min=1, help="samples (trajectories) per group"),
        turns: int = typer.Option(
            5, "--turns", min=1, help="assistant turns per trajectory (fixed budget K)"
        ),
        tokens: int = typer.Option(200, "--tokens", min=1, help="mean tokens (bytes) per assistant turn"),
        out: str = typer.Option(
            "lake", "--out", help="lake to write into: folder, file://, s3://BUCKET/PATH"
        ),
        round_: int = typer.Option(0, "--round", help="round number (its partitions are replaced)"),
        seed: int = typer.Option(0, "--seed", help="same seed, same settings -> bit-identical output"),
        kind: Kind = typer.Option(Kind.mixed, "--kind", help="search | tool | mixed (per group)"),
        invalid_rate: float = typer.Option(
            0.1,
            "--invalid-rate",
            min=0.0,
            max=1.0,
            help="fraction of assistant turns with a malformed action",
        ),
        repeat_rate: float = typer.Option(
            0.15,
            "--repeat-rate",
            min=0.0,
            max=1.0,
            help="fraction of later valid actions that repeat an earlier query/call",
        ),
        batch_groups: int = typer.Option(64, "--batch-groups", min=1, help="whole groups per lake part"),
    ) -> None:
        """Generate synthetic rollouts and write them as round ROUND of the lake (batch by batch)."""
        from pipeline.synth import SynthSettings, iter_batches
        from warehouse.lake import Lake
        from warehouse.rounds import prefetched, write_round_parts

        settings = SynthSettings(
            groups=groups,
            samples=samples,
            turns=turns,
            tokens=tokens,
            round=round_,
            seed=seed,
            kind=kind.value,
            invalid_rate=invalid_rate,
            repeat_rate=repeat_rate,
            batch_groups=batch_groups,
        )
        counts = {"trajectories": 0, "steps": 0, "tokens": 0}

        def counted():
            import pyarrow.compute as pc

            for traj, steps in prefetched(iter_batches(settings)):
                counts["trajectories"] += traj.num_rows
                counts["steps"] += steps.num_rows
                counts["tokens"] += int(pc.sum(pc.list_value_length(steps.column("token_ids"))).as_py() or 0)
                yield traj, steps

        start = time.perf_counter()
        parts = write_round_parts(Lake(out), round_, counted())
        took = time.perf_counter() - start
        typer.echo(
            f"wrote round {round_} to {out}: {counts['trajectories']} trajectories, {counts['steps']} steps, "
            f"{counts['tokens']} tokens in {len(parts)} part(s), {took:.1f} s"
        )
