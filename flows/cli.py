"""The `creditflow` command. Each sub-command lives in flows/commands/<name>.py and registers itself
with `register(app)`, so adding a command never touches this file.

A user's mistake (a bad setting, an unknown method or lake, a format a column cannot take) is one line on
stderr and exit status 1; `--debug` shows the traceback instead. Logging: the library logs with Python's
`logging` (loggers `pipeline.*`, `warehouse.*`, `flows.*`, `trainer.*`); inside a flow run Prefect sends those
records and its own at INFO to the API (the Prefect UI); the terminal shows WARNING and above unless
`--log-level info` (or PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL) says otherwise."""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import sys

# Quiet defaults for an offline command line (each one a setting the user can override in the environment):
# no telemetry calls to the internet; the library's loggers reach the Prefect UI inside runs.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "pipeline,warehouse,flows,trainer")
# outside a run those loggers' records stay in the terminal (Prefect would warn that it has no run to send them to)
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")

import typer

import flows.commands as _commands

PACKAGES = ("pipeline", "warehouse", "flows", "trainer")
STAGE_NOTE = "creditflow stage: "  # flows.batch.STAGE_NOTE (not imported: the CLI starts light)
LOG_LEVELS = ("debug", "info", "warning", "error")
_state = {"debug": bool(os.environ.get("CREDITFLOW_DEBUG"))}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


# exception types whose message is the whole story for a user (the rest also get their type name)
_USER_ERRORS = (ValueError, KeyError, FileNotFoundError, PermissionError, NotADirectoryError, ImportError)


def error_line(exc: BaseException) -> str:
    """The one stderr line of a failed command."""
    if isinstance(exc, KeyError) and exc.args:
        msg = str(exc.args[0])
    else:
        msg = _one_line(exc)
    if type(exc).__module__.startswith("duckdb"):
        msg = f"query failed: {msg}"
    elif not isinstance(exc, _USER_ERRORS):
        msg = f"{type(exc).__name__}: {msg}"
    stage = next((n for n in getattr(exc, "__notes__", ()) if n.startswith(STAGE_NOTE)), None)
    if stage is not None:  # a batch stage's error (flows.batch.stage_note: its task, a statistics pass)
        msg = f"stage {stage.removeprefix(STAGE_NOTE)} failed: {msg}"
    return f"error: {msg} (--debug shows the traceback)"


def debugging() -> bool:
    """Whether this invocation shows tracebacks (--debug or CREDITFLOW_DEBUG=1)."""
    return _state["debug"]


class _App(typer.Typer):
    """Typer whose uncaught errors are one line on stderr (the traceback with --debug / CREDITFLOW_DEBUG=1)."""

    def __call__(self, *args, **kwargs):
        if args or kwargs:  # called by a program (tests' CliRunner, a library): the command only
            return self._run(*args, **kwargs)
        # the command line itself: the warm runner runs it when it may (flows/warm.py)
        from flows.warm import run_via_runner
        from flows.warm_wire import SERVING

        code = run_via_runner(sys.argv)
        if code is not None:
            raise SystemExit(code)
        from flows.api_launch import prelaunch

        prelaunch(sys.argv)  # no API up: it starts now, beside this command's imports (flows/api_launch.py)
        if SERVING["on"]:  # a command the warm runner forked ends as flows/warm_command.py says
            return self._run()
        try:
            self._run()
        except SystemExit as exc:  # the interpreter's exit less its teardown of ~2,000 modules
            from flows.exiting import exit_now

            exit_now(exc.code)
        return None

    def _run(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:
            if _state["debug"]:
                raise
            typer.secho(error_line(exc), fg="red", err=True)
            raise SystemExit(1) from None


app = _App(
    name="creditflow",
    help="Offline credit assignment for multi-turn LLM-agent RL (C3, TCPO, IAPO) over Parquet + DuckDB.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("creditflow")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"creditflow {version()}")
        raise typer.Exit()


CONSOLE_LEVEL_ENV = "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"
_CONSOLE_LEVEL_SET: dict[str, str] = {}  # the value setup_logging last put there itself


def setup_logging(level: str) -> None:
    """The library's loggers at INFO (Prefect's API handler forwards them inside runs) with one terminal
    handler at `level`; Prefect's own terminal handler at `level` unless the environment set it."""
    numeric = getattr(logging, level.upper())
    # the user's own setting wins; one this function made for an earlier command of the same process (tests,
    # a library caller) does not stick: it is what a subprocess started from here would otherwise inherit
    current = os.environ.get(CONSOLE_LEVEL_ENV)
    if current is None or current == _CONSOLE_LEVEL_SET.get(CONSOLE_LEVEL_ENV):
        os.environ[CONSOLE_LEVEL_ENV] = _CONSOLE_LEVEL_SET[CONSOLE_LEVEL_ENV] = level.upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(numeric)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    handler.set_name("creditflow-console")
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(min(numeric, logging.INFO))
        logger.propagate = False
        for old in [h for h in logger.handlers if h.get_name() == "creditflow-console"]:
            logger.removeHandler(old)
        logger.addHandler(handler)


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="print the version and exit"
    ),
    debug: bool = typer.Option(False, "--debug", help="show the full traceback of an error"),
    log_level: str = typer.Option(
        os.environ.get("CREDITFLOW_LOG_LEVEL", "warning"),
        "--log-level",
        help="terminal log level: debug | info | warning | error (the Prefect UI gets INFO regardless)",
    ),
) -> None:
    """creditflow: ingest rollouts, compute credit, query it in SQL, export it to a trainer."""
    from flows.runtime import tune_allocator

    if log_level.lower() not in LOG_LEVELS:
        raise typer.BadParameter(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    _state["debug"] = debug or bool(os.environ.get("CREDITFLOW_DEBUG"))  # per invocation, not sticky
    setup_logging(log_level.lower())
    tune_allocator()
    from flows.warm import log_fallback
    from flows.warm_command import refresh_prefect

    log_fallback()
    refresh_prefect()  # a command the warm runner forked: Prefect's settings and logging from its caller's


for _mod in sorted(m.name for m in pkgutil.iter_modules(_commands.__path__)):
    module = importlib.import_module(f"flows.commands.{_mod}")
    if hasattr(module, "register"):
        module.register(app)


def main() -> None:  # pragma: no cover
    app()
