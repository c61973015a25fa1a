"""The `creditflow` command. Each sub-command lives in flows/commands/<name>.py and registers itself
with `register(app)`, so adding a command never touches this file."""

from __future__ import annotations

import importlib
import os
import pkgutil

# Quiet defaults for an offline command line (each one a setting the user can override in the environment):
# no telemetry calls to the internet, and Prefect's per-task INFO lines off (our own summaries say more).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import typer

import flows.commands as _commands

app = typer.Typer(
    name="creditflow",
    help="Offline credit assignment for multi-turn LLM-agent RL (C3, TCPO, IAPO) over Parquet + DuckDB.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """creditflow: ingest rollouts, compute credit, query it in SQL, export it to a trainer."""
    from flows.runtime import tune_allocator

    tune_allocator()


for _mod in sorted(m.name for m in pkgutil.iter_modules(_commands.__path__)):
    module = importlib.import_module(f"flows.commands.{_mod}")
    if hasattr(module, "register"):
        module.register(app)


def main() -> None:  # pragma: no cover
    app()
