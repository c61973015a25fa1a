"""`creditflow process` and `creditflow export`."""

from __future__ import annotations

from pathlib import Path

import typer


def _methods(raw: str | None) -> list[str] | None:
    if raw is None:
        return None
    return [m.strip() for m in raw.split(",") if m.strip()]


def register(app: typer.Typer) -> None:
    app.command("process")(process_cmd)
    app.command("export")(export_cmd)


def _flow_sets(no_cache: bool, allow_degraded: bool, wait: bool, wait_s: float | None) -> list[str]:
    """process's flags as the `flow.*` settings they stand for (after the user's own --set)."""
    sets = ["flow.cache=false"] if no_cache else []
    if allow_degraded:
        sets.append("flow.allow_degraded=true")
    if wait or wait_s is not None:
        sets.append(f"flow.lock_wait_s={'inf' if wait_s is None else wait_s}")
    return sets


def process_cmd(
    lake: str | None = typer.Option(None, "--lake", help="lake folder or file:// URL (config: lake)"),
    round_: int = typer.Option(..., "--round", help="round to process"),
    methods: str | None = typer.Option(
        None, "--methods", help="comma-separated method chains (config: methods)"
    ),
    config: Path | None = typer.Option(None, "--config", help="YAML config file (see config.example.yaml)"),
    sets: list[str] = typer.Option([], "--set", help="override: key=value or stage.key=value (repeatable)"),
    annotator: str | None = typer.Option(
        None, "--annotator", help="IAPO annotator: rules | llm (config: annotator)"
    ),
    task_runner: str | None = typer.Option(
        None, "--task-runner", help="threads | processes | ray | dask (config: task_runner)"
    ),
    max_workers: int | None = typer.Option(
        None, "--max-workers", help="parallel batches (config: max_workers)"
    ),
    address: str | None = typer.Option(
        None, "--address", help="Ray/Dask cluster address (config: task_runner_address)"
    ),
    no_cache: bool = typer.Option(
        False, "--no-cache", help="recompute every stage (config: flow.cache=false)"
    ),
    track: list[str] = typer.Option(
        [],
        "--track",
        help="send the round's credit statistics, summary and report to mlflow | wandb | tensorboard "
        "(repeatable or comma-separated; config: track, settings tracking.*)",
    ),
    wait: bool = typer.Option(
        False,
        "--wait",
        help="when another run is processing this round of this lake, wait for it (one line says for "
        "whom), then run: its work is found cached (config: flow.lock_wait_s); without it, stop at once",
    ),
    wait_s: float | None = typer.Option(
        None, "--wait-s", min=0, help="with --wait: give up after this many seconds (default: no limit)"
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="run the flow even when the round is up to date (same inputs, settings and code: without "
        "--force process prints its summary and starts nothing); its stages still come from the cache "
        "unless --no-cache",
    ),
    allow_degraded: bool = typer.Option(
        False,
        "--allow-degraded",
        help="finish with exit 0 even when more than flow.max_failed_share (10%) of an LLM stage's "
        "requests failed (its fallbacks: uniform weights, hindsight); without it such a run exits 1",
    ),
    skip_unmet: bool = typer.Option(
        False,
        "--skip-unmet",
        help="a method whose inputs the round lacks (verifier scores, critic values) is skipped and "
        "recorded in the summary; without it, process stops before any work naming the method",
    ),
) -> None:
    """Run the process-round flow: detect, annotate, counterfactuals, credit for every method, export."""
    from flows.config import load_config
    from flows.run import run_process

    cfg = load_config(
        config,
        [*sets, *_flow_sets(no_cache, allow_degraded, wait, wait_s)],
        lake=lake,
        methods=_methods(methods),
        annotator=annotator,
        task_runner=task_runner,
        max_workers=max_workers,
        task_runner_address=address,
        track=_methods(",".join(track)) if track else None,
    )
    if cfg.track:
        from flows.trackers import check_trackers

        check_trackers(cfg.track)  # a missing extra is one line before the round, not after it
    summary = run_process(cfg, round_, skip_unmet=skip_unmet, fast=not force)
    if cfg.track:
        from flows.display import print_kv
        from flows.trackers import track_round

        print_kv("experiment trackers", track_round(cfg, round_, summary))


def export_cmd(
    lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
    round_: int = typer.Option(..., "--round", help="round"),
    method: str = typer.Option(..., "--method", help="method chain to export"),
    out: Path = typer.Option(..., "--out", help="output Parquet file"),
    layout: str = typer.Option(
        "flat",
        "--layout",
        help="flat (Parquet, one row per trajectory) | verl | openrlhf | skyrl (padded NumPy .npz)",
    ),
    response_length: int | None = typer.Option(
        None,
        "--response-length",
        help="verl: pad/cut responses to the run's rollout.response_length; skyrl: cut them at its "
        "generator.sampling_params.max_generate_length",
    ),
    max_len: int | None = typer.Option(
        None, "--max-len", help="openrlhf: cut sequences at the run's --data.max_len"
    ),
    prompt_length: int | None = typer.Option(
        None, "--prompt-length", help="verl: left-pad prompts to the run's data.max_prompt_length"
    ),
    pad_token_id: int = typer.Option(0, "--pad-token-id", help="the token id padding uses"),
) -> None:
    """Write one method's advantages as a per-trajectory training batch."""
    from flows.run import run_export

    run_export(
        lake,
        round_,
        method,
        out,
        layout,
        response_length=response_length,
        prompt_length=prompt_length,
        pad_token_id=pad_token_id,
        max_len=max_len,
    )
