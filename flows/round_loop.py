"""The round loop: collect -> process -> train, round after round, resumable. One flow, `round_loop_flow`;
`creditflow loop` (`run_loop`) runs it.

The trainer provides the policy side as hooks: `trainer/hooks.py` (used when the config sets the trainer up:
`loop`, `collect` or `train` settings), or functions registered with `register_round_hook`:

- `setup(config, log) -> Config | None`: once before the rounds (the config the loop runs with, or None: as is);
- `status(config, round_) -> dict`: columns of the round's row, plus `done` (why the round is complete:
  skipped) and `processed` (why its advantages need no processing: process skipped), None when not;
- `collect(config, round_) -> dict` and `train(config, round_) -> dict`: the round's stages, as Prefect
  tasks; what they return joins the round's row;
- `teardown() -> None`: once after the rounds, also after an error (the trainer stops its vLLM server).

Without hooks the loop runs process only. The flow processes each round (`flows.run.process_checked_round`:
preconditions, the round's lock, process_round_flow as a subflow) and sends it to `config.track`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.config import as_config
from pipeline.config import Config

RoundHook = Callable[..., Any]
HOOKS: dict[str, RoundHook] = {}
HOOK_NAMES = ("setup", "status", "collect", "train", "teardown")
Log = Callable[[str], None]


def register_round_hook(name: str, fn: RoundHook) -> RoundHook:
    if name not in HOOK_NAMES:
        raise ValueError(f"round hook {name!r}: choose one of {HOOK_NAMES}")
    HOOKS[name] = fn
    return fn


TRAINER_SETTINGS = ("loop", "collect", "train")


def trainer_configured(config: Config) -> bool:
    """The config sets up the trainer: it has `loop`, `collect` or `train` settings."""
    return any(name in config.stages for name in TRAINER_SETTINGS)


def round_hooks(config: Config | None = None) -> dict[str, RoundHook]:
    """Registered hooks, plus those trainer.hooks provides (and, given a config, only when it configures the
    trainer: otherwise the loop is process-only)."""
    import importlib

    hooks = dict(HOOKS)
    if config is not None and not trainer_configured(config):
        return hooks
    try:
        module = importlib.import_module("trainer.hooks")
    except ModuleNotFoundError as exc:
        if exc.name not in ("trainer.hooks", "trainer"):
            raise
        module = None
    for name in HOOK_NAMES:
        if name not in hooks and module is not None and callable(getattr(module, name, None)):
            hooks[name] = getattr(module, name)
    return hooks


@task(task_run_name="{name}-round-{round_}", cache_policy=NO_CACHE, persist_result=False)
def round_hook_task(name: str, config: Config, round_: int) -> dict:
    return round_hooks()[name](config, round_) or {}


def loop_rounds(config: Config, start_round: int | None, rounds: int | None) -> range:
    """The rounds to run: the arguments, else the config's `loop` settings."""
    if start_round is None or rounds is None:
        from trainer.loop import LoopSettings

        s = config.settings(LoopSettings)
        start_round = s.start_round if start_round is None else start_round
        rounds = s.rounds if rounds is None else rounds
    return range(start_round, start_round + rounds)


def process_step(config: Config, round_: int, log: Log) -> dict:
    """The round's process: its preconditions (a method that lacks its inputs stops the loop with one line),
    then process_round_flow under the round's lock."""
    from flows.run import check_preconditions, process_checked_round, quiet_run_failures, require_round
    from warehouse.lake import Lake

    lake = Lake(config.lake)
    require_round(lake, round_)
    config, skipped = check_preconditions(config, lake, round_)
    quiet_run_failures()
    summary = process_checked_round(config, lake, round_, skipped)
    log(f"[loop] round {round_}: processed ({summary['state']}) in {summary['seconds']}s")
    return summary


@flow(name="round-loop", validate_parameters=False)
def round_loop_flow(
    config: Config | dict, start_round: int | None = None, rounds: int | None = None, log: Log | None = None
) -> list[dict]:
    """`rounds` rounds from `start_round` (default: the config's `loop` settings): collect (the trainer's hook)
    -> process -> train (likewise). Resumable: a round the trainer reports `done` is skipped, and process is
    skipped when it reports the round `processed`. Returns one row per round (the `creditflow loop` table)."""
    config = as_config(config)
    log = log or print
    hooks = round_hooks(config)
    rows = []
    try:
        if "setup" in hooks:
            config = hooks["setup"](config, log) or config
        for r in loop_rounds(config, start_round, rounds):
            status = dict(hooks["status"](config, r)) if "status" in hooks else {}
            done, processed = status.pop("done", None), status.pop("processed", None)
            row: dict = {"round": r, **status}
            if done:
                log(f"[loop] round {r}: {done}, skipped")
                rows.append({**row, "skipped": True})
                continue
            t0 = time.perf_counter()
            if "collect" in hooks:
                row.update(round_hook_task("collect", config, r))
            summary: dict = {"round": r}
            if processed:
                log(f"[loop] round {r}: {processed}, process skipped")
                row["process_s"] = 0.0
            else:
                t1 = time.perf_counter()
                summary = process_step(config, r, log)
                row.update(process_s=round(time.perf_counter() - t1, 2), process_state=summary["state"])
                row["process"] = summary
            if "train" in hooks:
                row.update(round_hook_task("train", config, r))
            if config.track:  # after training, so the round's train_metrics go too
                from flows.trackers import track_round

                row["tracked"] = ", ".join(track_round(config, r, summary))
            row["total_s"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
    finally:
        if "teardown" in hooks:
            hooks["teardown"]()
    return rows


def run_loop(cfg: Config, log: Log = print) -> list[dict]:
    """Run (or resume) the loop the config describes (`creditflow loop`): `round_loop_flow` on the managed
    Prefect server when one runs, else on the API shared by the machine's commands (flows/server.py), started
    now when none runs; one row per round."""
    from flows.execution import command_api

    with command_api(cfg, log):
        return round_loop_flow(cfg, log=log)
