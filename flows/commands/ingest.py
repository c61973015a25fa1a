"""`creditflow ingest`: read rollout logs of one format, write a round's trajectories, steps and quarantine."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("ingest")(ingest_cmd)


def ingest_cmd(
    sources: list[Path] = typer.Argument(..., help="input file(s) or folder(s)"),
    fmt: str = typer.Option(
        ...,
        "--format",
        "-f",
        help="chat-jsonl | tau-bench | tau2-bench | react | ldb | parquet | rllm | areal | roll | trl | verl-batch"
        " | verl-rollout",
    ),
    lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
    round_: int = typer.Option(..., "--round", help="round to write (replaces the round's ingest tables)"),
    tokenizer: str | None = typer.Option(
        None,
        "--tokenizer",
        help="a tokenizer/model directory (text sources rendered with its chat template), a tokenizer.json "
        "(no template), 'smollm2-plain', 'bytes'; default SmolLM2 with its chat template",
    ),
    batch_groups: int = typer.Option(64, "--batch-groups", help="groups per part (unit of processing)"),
    strict: bool = typer.Option(False, "--strict", help="exit non-zero when any record was quarantined"),
    allow_pickle: bool = typer.Option(
        False,
        "--allow-pickle",
        help="read pickled verl DataProto dumps (DataProto.save_to_disk, RolloutSkip). Off by default: "
        "unpickling can run any code the file names, so pass it only for files you trust (.npz object "
        "arrays such as verl's uid need no pickle: a loader that only rebuilds arrays reads them)",
    ),
    max_record_bytes: int = typer.Option(
        64 << 20,
        "--max-record-bytes",
        help="a record (a JSONL line, a JSON document) larger than this is quarantined unread "
        "(record_too_large, its first 64 KiB kept): ingest's memory is bounded by it; 0: no limit",
    ),
) -> None:
    """Ingest rollouts: validate, quarantine bad records with a reason, tokenize, write the round."""
    from flows.display import console, print_kv
    from pipeline.ingest import get_adapter
    from warehouse.ingest_run import NothingIngested, ingest_sources
    from warehouse.interop_sources import MissingPackage, PickleRefused
    from warehouse.lake import LakeError

    try:
        get_adapter(fmt)
    except KeyError as exc:  # an unknown format, naming the known ones
        typer.secho(str(exc.args[0]), fg="red", err=True)
        raise typer.Exit(2) from None
    if batch_groups < 1:
        typer.secho("--batch-groups must be >= 1", fg="red", err=True)
        raise typer.Exit(2)
    try:
        run = ingest_sources(
            [str(s) for s in sources],
            fmt,
            round_,
            lake,
            tokenizer,
            batch_groups,
            allow_pickle=allow_pickle,
            max_record_bytes=max_record_bytes or None,
        )
    except MissingPackage as exc:  # one line naming what to install
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(1) from None
    except NothingIngested as exc:
        typer.secho(f"ingest {fmt}: {exc}", fg="red", err=True)
        raise typer.Exit(1) from None
    except LakeError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(2) from None
    except (FileNotFoundError, PickleRefused) as exc:
        typer.secho(f"cannot read sources: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    print_kv(f"ingest {fmt}", _ingest_summary(fmt, run))
    console.print(f"written: {run.lake} (trajectories, steps, quarantine; round={round_})", soft_wrap=True)
    quarantined = run.result.quarantine.num_rows
    if strict and quarantined:
        console.print(f"[red]--strict: {quarantined} record(s) quarantined[/red]")
        raise typer.Exit(1)


def _ingest_summary(fmt: str, run) -> dict:
    """What one ingest read and wrote, as the command prints it: records, trajectories, groups, steps, tool
    errors, tokens, quarantined records by reason, parts written."""
    result, parts = run.result, run.parts
    steps = result.steps
    roles = steps.column("role").to_pylist()
    errors = steps.column("is_error").to_pylist()
    groups = len(set(result.trajectories.column("group_id").to_pylist()))
    summary = {
        "format": fmt,
        "sources": run.inputs,
        "records read": result.stats.get("records_read"),
        "trajectories": result.trajectories.num_rows,
        "groups": groups,
        "steps": steps.num_rows,
        "assistant turns": roles.count("assistant"),
        "tool steps": roles.count("tool"),
        "tool errors": sum(1 for r, e in zip(roles, errors, strict=True) if e and r == "tool"),
        "tokens": result.stats.get("tokens"),
        "tokenizer": result.stats.get("tokenizer"),
        "quarantined": result.quarantine.num_rows,
    }
    for reason, n in result.quarantined_by_reason().items():
        summary[f"  quarantined: {reason}"] = n
    if result.stats.get("offsets_approximate"):
        summary["approximate token offsets"] = result.stats["offsets_approximate"]
    summary["parts written"] = len(parts)
    return summary
