"""`creditflow server start|stop|status`: a Prefect server kept running in the background (flows/server.py);
commands use it automatically when it is up, instead of starting Prefect's ephemeral API each time."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    server = typer.Typer(help="The managed Prefect server (used automatically by every command when up).")
    app.add_typer(server, name="server")

    @server.command("start")
    def start_cmd(port: int = typer.Option(0, "--port", help="port (0: a free one)")) -> None:
        """Start the Prefect server in the background (nothing to do when it runs already)."""
        from flows.display import print_kv
        from flows.server import start

        try:
            info, started = start(port or None)
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from None
        print_kv(
            "creditflow server",
            {"state": "started" if started else "running", "api": info.url, "pid": info.pid, "log": info.log},
        )

    @server.command("stop")
    def stop_cmd() -> None:
        """Stop the managed Prefect server."""
        from flows.server import stop

        info = stop()
        typer.echo(
            f"stopped the Prefect server at {info.url}" if info else "no managed Prefect server recorded"
        )

    @server.command("status")
    def status_cmd() -> None:
        """Whether the managed server runs, and its URL."""
        from flows.display import print_kv
        from flows.server import read_state, running

        info = running()
        if info is None:
            rec = read_state()
            print_kv("creditflow server", {"state": "not running", "recorded": rec.url if rec else "none"})
            raise typer.Exit(1)
        print_kv("creditflow server", {"state": "running", "api": info.url, "pid": info.pid, "log": info.log})
