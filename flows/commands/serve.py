"""`creditflow serve`: long-running Prefect deployments for a lake: a cron schedule that processes every
round whose credit is incomplete, and an incoming-folder trigger that ingests + processes each new round
dropped into a folder. `--once` polls the folder one time and exits (for cron jobs and tests)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import typer

log = logging.getLogger(__name__)


def build_deployments(cfg) -> list:
    """The deployments `serve` starts for a config (none without `serve.cron` / `serve.incoming`)."""
    from flows.config import config_parameter
    from flows.incoming import incoming_flow, process_pending_flow

    params = {"config": config_parameter(cfg)}
    out = []
    if cfg.serve.cron:
        out.append(
            process_pending_flow.to_deployment(
                name="process-pending",
                cron=cfg.serve.cron,
                parameters=params,
                description="process every round of the lake whose credit is incomplete",
            )
        )
    if cfg.serve.incoming:  # no schedule: `serve` watches the folder and starts a run only for new entries
        out.append(
            incoming_flow.to_deployment(
                name="incoming",
                parameters=params,
                tags=[f"method:{m}" for m in cfg.methods] + [f"runner:{cfg.task_runner}"],
                description=f"ingest + process each new round dropped into {cfg.serve.incoming} "
                f"(started by `creditflow serve` when one appears; polled every {cfg.serve.poll_interval_s} s)",
            )
        )
    return out


def watch_incoming(cfg) -> threading.Thread:
    """A thread polling the incoming folder; a new settled entry starts the served `incoming` deployment (one
    run at a time)."""
    from flows.incoming import poll_incoming

    def trigger():
        from prefect.deployments import run_deployment

        return run_deployment("incoming/incoming", timeout=0)

    def finished(flow_run) -> bool:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run.id).state
        return state is not None and state.is_final()

    def loop() -> None:
        stop = threading.Event()
        stop.wait(5)  # let prefect.serve register the deployment first
        while True:
            try:
                poll_incoming(cfg, trigger, finished, stop)
            except Exception as exc:  # an API hiccup: say it, poll again
                log.warning("incoming watch: %s; polling again", exc)
                stop.wait(cfg.serve.poll_interval_s)

    thread = threading.Thread(target=loop, name="creditflow-incoming-watch", daemon=True)
    thread.start()
    return thread


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve_cmd(
        config: Path | None = typer.Option(None, "--config", help="YAML config file"),
        lake: str | None = typer.Option(None, "--lake", help="lake folder (config: lake)"),
        methods: str | None = typer.Option(
            None, "--methods", help="comma-separated method chains (config: methods)"
        ),
        incoming: Path | None = typer.Option(
            None, "--incoming", help="folder to watch for new rounds (serve.incoming)"
        ),
        fmt: str | None = typer.Option(
            None, "--format", help="ingest format of incoming files (serve.incoming_format)"
        ),
        interval: int | None = typer.Option(
            None, "--interval", help="poll interval, seconds (serve.poll_interval_s)"
        ),
        cron: str | None = typer.Option(
            None, "--cron", help="cron of process-pending, e.g. '*/30 * * * *' (serve.cron)"
        ),
        sets: list[str] = typer.Option(
            [], "--set", help="override: key=value or stage.key=value (repeatable)"
        ),
        once: bool = typer.Option(False, "--once", help="poll the incoming folder once, then exit"),
    ) -> None:
        """Serve the process-pending (cron) and incoming (interval) deployments until interrupted."""
        from flows.config import load_config

        methods_list = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
        cfg = load_config(config, sets, lake=lake, methods=methods_list)
        flags = {
            "incoming": str(incoming) if incoming else None,
            "incoming_format": fmt,
            "poll_interval_s": interval,
            "cron": cron,
        }
        serve = cfg.serve.model_validate(
            {**cfg.serve.model_dump(), **{k: v for k, v in flags.items() if v is not None}}
        )
        cfg = cfg.model_copy(update={"serve": serve})
        if once:
            from flows.display import print_kv
            from flows.incoming import incoming_flow

            done = incoming_flow(cfg)
            print_kv(
                "creditflow serve --once",
                {k: f"round {v['round']}: {v['status']}" for k, v in done.items()}
                or {"incoming": "nothing new"},
            )
            return
        deployments = build_deployments(cfg)
        if not deployments:
            typer.secho(
                "nothing to serve: give --cron and/or --incoming (or serve.cron / serve.incoming)",
                fg="red",
                err=True,
            )
            raise typer.Exit(2)
        import prefect

        if cfg.serve.incoming:
            watch_incoming(cfg)
        # one flow run at a time: the cron and the incoming deployments write the same lake
        prefect.serve(*deployments, limit=1)
