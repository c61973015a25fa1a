"""Entry points the CLI calls. They run the Prefect flows (ephemeral API unless PREFECT_API_URL is set)."""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, cast

from flows.display import console, print_kv, print_table
from pipeline.config import Config

if TYPE_CHECKING:
    from prefect.states import State

log = logging.getLogger(__name__)

# imported while Prefect's API starts rather than during the round: the flow's module; DuckDB, which the
# command's summary queries once the flow ends (flows.summary.credit_by_method: ~0.1 s of import that was
# the last thing a cold command waited for); and DuckDB's catalog where the round's stats task refreshes it (a
# hive lake's catalog.duckdb; a Delta lake has none)
ROUND_IMPORTS = ("flows.process_round", "duckdb")


def prepare(cfg: Config, lake=None, round_: int | None = None) -> threading.Thread:
    """What `creditflow process` starts before the round, to overlap the API's start-up: the worker processes
    (flow.processes; none for a round of one batch) and the imports the round needs. Returns the import thread
    (join it to wait for them).

    Prefect is imported whole here, in the calling thread, before any thread starts (issue 33): its package's
    first import runs its plugin set-up (`prefect._initialize_plugins`), which imports `prefect.settings` and
    `prefect.context`; two threads importing Prefect for the first time at once (the import thread below's
    `from prefect import flow` and the caller's `from prefect.settings import ...`) hand one of them a partially
    initialised module, and Prefect prints "Failed to initialize plugins: cannot import name ... from partially
    initialized module" (9 of 12 runs of the bare two-thread import; the red team's 1 `process` run in 6, when
    the command's first Prefect import came after this thread's start)."""
    import prefect  # noqa: F401  (the whole package, plugin set-up included, before the threads below)

    from flows.workers import warm_in_background

    batches = len(lake.parts("trajectories", round_)) if lake is not None and round_ is not None else None
    warm_in_background(cfg, batches)

    def _imports() -> None:
        # a warm-up only: the round imports these itself in its own thread, where an error is raised and shown
        try:
            for name in ROUND_IMPORTS + (
                ("warehouse.catalog",) if getattr(lake, "format", "") == "parquet" else ()
            ):
                importlib.import_module(name)
        except Exception:  # e.g. a submodule both threads import at once, handed partially initialised
            log.debug("creditflow-imports: warm-up import failed; the round imports it again", exc_info=True)

    thread = threading.Thread(target=_imports, name="creditflow-imports", daemon=True)
    thread.start()
    return thread


def require_lake(lake_dir: Path | str) -> None:
    """A command that reads a lake stops with one line when the folder holds none (a mistyped --lake must not
    create an empty lake and succeed)."""
    from warehouse.lake import Lake, LakeError

    try:
        present = Lake(lake_dir).exists()
    except LakeError as exc:
        raise SystemExit(str(exc)) from None
    if not present:
        raise SystemExit(f"no lake at {lake_dir} (no table folders there); check --lake")


def require_round(lake, round_: int) -> None:
    """A command on a round the lake does not hold stops with one line naming it and the rounds there."""
    if not lake.parts("trajectories", round_):
        present = ", ".join(str(r) for r in lake.rounds("trajectories")) or "none"
        raise SystemExit(
            f"round {round_} has no trajectories in {lake.root} (rounds there: {present}); "
            "`creditflow ingest` or `creditflow synth` writes one"
        )


class Skipped(list):
    """What `check_preconditions` dropped: one line per missing input (a list of str, as printed and kept in
    the summary) and `methods`, the methods it dropped (counted in the run log)."""

    def __init__(self, lines=(), methods=()) -> None:
        super().__init__(lines)
        self.methods: list[str] = list(methods)


def check_preconditions(cfg: Config, lake, round_: int, skip_unmet: bool = False) -> tuple[Config, Skipped]:
    """Every method's requirements (pipeline.credit.preconditions) against the round's steps, before any work.
    An unmet one stops with one line naming the method, the missing column and the trajectories that lack it;
    with `skip_unmet` those methods are dropped: returns (the config without them, what was skipped)."""
    from pipeline.credit.preconditions import grouped_lines, required_columns, unmet

    columns = required_columns(cfg.methods, cfg)
    if not columns:  # no method has a requirement: nothing to read
        return cfg, Skipped()
    problems = unmet(cfg.methods, round_step_flags(lake, round_, columns), cfg)
    if not problems:
        return cfg, Skipped()
    lines = [p.line() for p in problems]
    dropped = {p.method for p in problems}
    keep = [m for m in cfg.methods if m not in dropped]
    if not skip_unmet or not keep:
        hint = " (--skip-unmet computes the other methods)" if keep else " (no method left to compute)"
        raise SystemExit("; ".join(lines) + hint)
    skipped = Skipped(grouped_lines(problems), [m for m in cfg.methods if m in dropped])
    return cfg.model_copy(update={"methods": keep}), skipped


def round_step_flags(lake, round_: int, columns):
    """The round's step flags (pipeline.credit.preconditions): its steps columns read from the lake's parts
    in Arrow, no DuckDB catalog of every table. A required column no part holds (an older lake), which the
    parts' schemas tell (`Lake.columns`: footers or the Delta log, no column data), is left out of the read,
    and `step_flags` reads it as null on every step."""
    from pipeline.credit.preconditions import step_flags, steps_columns

    parts = lake.parts("steps", round_)
    held = set(lake.columns("steps", round_, parts))
    steps = lake.read("steps", round_, columns=steps_columns(set(columns) & held), parts=parts)
    return step_flags(steps, columns)


def run_process(
    cfg: Config, round_: int, quiet: bool = False, skip_unmet: bool = False, fast: bool = False
) -> dict:
    """Run `process_round_flow` on the configured task runner, with a progress bar per stage, and print the
    round summary and the credit statistics. `fast` (the CLI's default): a round already processed with the
    same inputs, settings and code is not run again: its summary comes from the lake, Prefect never starts
    (flows/uptodate.py)."""
    from warehouse.lake import Lake

    lake = Lake(cfg.lake)
    require_round(lake, round_)  # before any API or worker starts
    cfg, skipped = check_preconditions(cfg, lake, round_, skip_unmet)  # and each method's inputs
    if skipped and not quiet:
        console.print(f"[yellow]skipped {len(skipped.methods)} method(s), their inputs are missing:")
        for line in skipped:
            console.print(f"[yellow]  - {line}", soft_wrap=True)
    # the round's lock is held from the up-to-date check to the flow's end: another run stops with one line,
    # or (`--wait`) waits, saying so once on stderr
    summary = process_checked_round(
        cfg,
        lake,
        round_,
        skipped,
        progress=cfg.flow.progress and not quiet,
        on_wait=_say_on_stderr,
        served=(lambda: _up_to_date(cfg, lake, round_, skipped, quiet)) if fast else None,
        api=_command_api(cfg, lake, round_, quiet),
    )
    if quiet or summary.get("up_to_date"):
        return summary
    from flows.process_round import WARNING_STATE
    from flows.summary import print_round

    title = f"creditflow process: round {round_}" + (
        " [yellow](completed with warnings)" if summary["state"] == WARNING_STATE else ""
    )
    print_round(summary, lake, title=title)
    over = over_failure_share(summary, cfg.flow.max_failed_share)
    if over and not cfg.flow.allow_degraded:
        raise SystemExit("; ".join(over) + " (--allow-degraded accepts the run)")
    return summary


def _say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _command_api(cfg: Config, lake, round_: int, quiet: bool) -> Iterator[None]:
    """The API the command's flow reports to, entered only when the flow runs (an up-to-date round starts no
    Prefect): `creditflow server start`'s or the one an earlier command left running; else one started now
    for this command and the next ones (flows/server.py), coming up while the worker processes and imports
    start."""
    from flows.execution import command_api

    def say(line: str) -> None:
        if not quiet:
            console.print(line, soft_wrap=True, highlight=False)

    quiet_run_failures()
    with command_api(cfg, say, while_starting=lambda: prepare(cfg, lake, round_)):
        yield


def _up_to_date(cfg: Config, lake, round_: int, skipped: Skipped, quiet: bool) -> dict | None:
    """The round's summary when it is up to date (flows/uptodate.py), printed; None: the flow runs."""
    from flows.uptodate import UP_TO_DATE, up_to_date_summary

    summary = up_to_date_summary(cfg, lake, round_, skipped)
    if summary is not None and not quiet:
        from flows.summary import print_round

        print_round(summary, lake, title=f"creditflow process: round {round_}")
        console.print(UP_TO_DATE.format(round=round_), soft_wrap=True)
    return summary


def over_failure_share(summary: dict, share: float) -> list[str]:
    """One line per LLM stage of this run whose failed requests exceed `share` of its requests: the stage, the
    count and the main cause."""
    out = []
    for stage, r in (summary.get("this_run") or {}).items():
        failed, total = int(r.get("llm_failed", 0)), int(r.get("llm_requests", 0))
        if total and failed / total > share:
            causes = sorted((r.get("failures") or {}).items(), key=lambda kv: -kv[1])
            cause = causes[0][0] if causes else "unknown"
            out.append(
                f"stage {stage} degraded: {failed} of {total} LLM requests failed ({cause}), over "
                f"flow.max_failed_share {share:.0%}"
            )
    return out


class _RunFailuresOnce(logging.Filter):
    """Keeps a failed task run's or flow run's ERROR records (each with its traceback, 161 lines for one failed
    stage) off the terminal: the command's one error line names the stage and its error (flows.cli.error_line);
    the Prefect UI still gets them (its API handler is not filtered), and `--debug` shows them. Also Prefect's
    queue services' "Still processing items" warnings (`flows.exiting.DRAIN_LOGGERS`) wherever they drain, not
    only at exit: the clean-clone CI of c35df6b, loaded, printed one after a failing stage's error line. Kept
    where that logger is at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        from flows.cli import debugging
        from flows.exiting import DRAIN_LOGGERS

        if record.name in DRAIN_LOGGERS and record.getMessage().startswith("Still processing items"):
            return logging.getLogger(record.name).getEffectiveLevel() <= logging.DEBUG
        if record.levelno < logging.ERROR or debugging():
            return True
        return not record.name.startswith(("prefect.task_runs", "prefect.flow_runs"))


def quiet_run_failures() -> None:
    """Filter Prefect's terminal handlers (`_RunFailuresOnce`, a no-op under --debug); call after Prefect
    configured its logging (importing `prefect.flow` does)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, _RunFailuresOnce) for f in handler.filters
        ):
            handler.addFilter(_RunFailuresOnce())


def round_parameters(parameters: dict) -> dict:
    """The flow run's parameters as its API record holds them (round, config as JSON): what Prefect's
    `Flow.serialize_parameters` makes of them, without its FastAPI import (`jsonable_encoder`: ~0.1 s of CPU
    per command, the only FastAPI import of a command with an API up)."""
    out = {}
    for key, value in parameters.items():
        dump = getattr(value, "model_dump", None)
        out[key] = dump(mode="json") if dump is not None else value
    return out


def process_checked_round(
    cfg: Config,
    lake,
    round_: int,
    skipped: Skipped | None = None,
    progress: bool = False,
    *,
    on_wait: Callable[[str], None] | None = None,
    served: Callable[[], dict | None] | None = None,
    api: AbstractContextManager | None = None,
) -> dict:
    """`process_round_flow` on the configured task runner for a round `check_preconditions` passed (`skipped`:
    its lines for the methods it dropped); returns the flow's summary with its state, methods and seconds.
    Every way creditflow processes a round comes here: `creditflow process`, the round loop, serve's incoming
    and process-pending flows.

    This is where the round's lock is taken (warehouse/locks.py; one run per (lake, round)): a second run stops
    with RoundBusy naming the holder, or waits `flow.lock_wait_s`, `on_wait` getting one line (default: the
    flow run's log). Held for `served` (the command's up-to-date check: a summary served from the lake, and
    no flow runs) and `api` (the context the flow reports to, entered only when the flow runs), so no other
    run takes the round between the check and the flow."""
    from warehouse.locks import round_lock

    with round_lock(lake, round_, wait_s=cfg.flow.lock_wait_s, on_wait=on_wait or _flow_log_warning):
        summary = served() if served is not None else None
        if summary is not None:
            return summary
        with api if api is not None else nullcontext():
            return _flow_summary(cfg, lake, round_, skipped, progress)


def _flow_log_warning(line: str) -> None:
    """A line in the current flow run's log (the loop's, serve's), else this module's logger."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        get_run_logger().warning(line)
    except MissingContextError:
        log.warning(line)


def _flow_summary(cfg: Config, lake, round_: int, skipped: Skipped | None, progress: bool) -> dict:
    """The flow's run (its progress bars on the terminal) and its summary, the preconditions' skips recorded."""
    from flows.process_round import process_round_flow
    from flows.progress import rich_progress
    from flows.runners import make_task_runner

    t0 = time.perf_counter()
    flow_ = process_round_flow.with_options(task_runner=make_task_runner(cfg))
    setattr(flow_, "serialize_parameters", round_parameters)  # noqa: B010  (this run's flow object only)
    with rich_progress(console) if progress else nullcontext():
        state = cast(
            "State", flow_(round_=round_, config=cfg, return_state=True)
        )  # a sync flow: no awaitable
    summary = state.result()  # raises the flow's error if it failed
    if skipped:  # kept in the round's run log, so `creditflow stats` shows it too
        from warehouse.runlog import record_stage_run

        record_stage_run(
            lake,
            round_,
            "preconditions",
            "round",
            seconds=0.0,
            notes={"skipped_methods": len(skipped.methods)},
            warnings=list(skipped),
        )
    summary.update(
        {
            "state": state.name,
            "methods": ", ".join(cfg.methods),
            **({"skipped (unmet preconditions)": " | ".join(skipped)} if skipped else {}),
            "seconds": round(time.perf_counter() - t0, 2),
            "advantages": str(lake.partition_dir("advantages", round_)),
        }
    )
    return summary


def run_stats(lake_dir: Path | str, round_: int) -> dict:
    """The round summary from the lake alone (what `creditflow process` printed at the end)."""
    from flows.summary import print_summary, round_summary
    from warehouse.lake import Lake

    lake = Lake(lake_dir)
    require_round(lake, round_)
    summary = round_summary(lake, round_)
    print_summary(summary, title=f"creditflow stats: round {round_}")
    if lake.parts("advantages", round_):
        from warehouse.catalog import query

        print_table(
            query(lake, f"SELECT * FROM credit_summary WHERE round = {int(round_)}"), title="credit by method"
        )
    return summary


def run_export(
    lake_dir: Path | str, round_: int, method: str, out: Path, layout: str = "flat", **padding
) -> Path:
    """`padding`: response_length / prompt_length / pad_token_id of `pipeline.layouts.to_padded`."""
    from warehouse.exports import ExportError, write_export

    require_lake(lake_dir)
    try:
        rows, version = cast(
            "tuple[int, str]",
            write_export(lake_dir, round_, method, out, layout, with_version=True, **padding),
        )
    except ExportError as exc:
        raise SystemExit(str(exc)) from None
    shown = {"method": method, "round": round_, "layout": layout, "trajectories": rows, "out": str(out)}
    if version:  # a Delta lake: the exact advantages this batch holds (`creditflow query --as-of`)
        shown["lake version"] = version
    print_kv("creditflow export", shown)
    return out


def run_report(
    lake_dir: Path | str, out: Path, rounds: list[int] | None = None, n_traj: int = 8, quiet: bool = False
) -> Path:
    from warehouse.lake import Lake
    from warehouse.report_file import write_report

    require_lake(lake_dir)
    lake = Lake(lake_dir)
    missing = [r for r in rounds or [] if not lake.parts("trajectories", r)]
    if missing:
        present = ", ".join(str(r) for r in lake.rounds("trajectories")) or "none"
        raise SystemExit(f"round {', '.join(map(str, missing))} not in {lake_dir} (rounds there: {present})")
    out, data, timing = write_report(lake, out, rounds, n_traj=n_traj)
    seconds, t_gather = timing["seconds"], timing["queries"]
    log.info(
        "report %s: rounds %s, %d trajectories, %.2f MB, %.2f s (queries %.2f s)",
        out,
        data["rounds"],
        len(data["trajectories"]),
        out.stat().st_size / 1e6,
        seconds,
        t_gather,
    )
    if not quiet:
        print_kv(
            "creditflow report",
            {
                "rounds": data["rounds"],
                "trajectories shown": len(data["trajectories"]),
                "viewer opens on": data.get("default_method"),
                "size": f"{out.stat().st_size / 1e6:.2f} MB",
                "seconds": f"{seconds:.2f} (queries {t_gather:.2f})",
                "out": str(out.resolve()),
            },
        )
    return out
