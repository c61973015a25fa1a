"""`round_loop_flow`: collect -> process -> train, round after round.

Collect (rollout generation into the lake) and train (the policy update) are hooks the trainer provides:
a module `trainer/hooks.py` defining `collect(config, round_) -> dict` and/or `train(config, round_) -> dict`,
or hooks registered with `register_round_hook`. Without a trainer (no hooks, or a config without `loop`,
`collect` or `train` settings) the loop runs process only."""

from __future__ import annotations

import time
from collections.abc import Callable

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.config import as_config
from pipeline.config import Config

RoundHook = Callable[[Config, int], dict]
HOOKS: dict[str, RoundHook] = {}
HOOK_NAMES = ("collect", "train")


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
    """Registered hooks, plus `collect` / `train` from trainer.hooks when the trainer provides them (and, given
    a config, only when it configures the trainer: otherwise the loop is process-only)."""
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


@flow(name="round-loop", validate_parameters=False)
def round_loop_flow(config: Config | dict, start_round: int, rounds: int = 1) -> list[dict]:
    """`rounds` rounds from `start_round`: collect (if a trainer provides it) -> process -> train (likewise)."""
    from flows.process_round import process_round_flow
    from flows.runners import make_task_runner

    config = as_config(config)
    hooks = round_hooks(config)
    out = []
    for round_ in range(start_round, start_round + rounds):
        entry: dict = {"round": round_}
        if "collect" in hooks:
            entry["collect"] = round_hook_task("collect", config, round_)
        state = process_round_flow.with_options(task_runner=make_task_runner(config))(
            round_=round_, config=config, return_state=True
        )
        entry["process"] = state.result()
        entry["state"] = state.name
        if "train" in hooks:
            entry["train"] = round_hook_task("train", config, round_)
        out.append(entry)
    return out


def run_loop(cfg: Config, log: Callable[[str], None] = print) -> list[dict]:
    """Run (or resume) the loop; returns one row of timings and outcomes per round."""
    from flows.run import run_process
    from trainer.loop import (
        LoopState,
        checkpoint,
        checkpoint_done,
        collect_round,
        has_advantages,
        train_round,
    )

    st = LoopState(cfg, log)
    rows = []
    try:
        for r in range(st.s.start_round, st.s.start_round + st.s.rounds):
            row: dict = {"round": r, "policy": st.policy(r).name, "method": st.method, "backend": st.backend}
            if checkpoint_done(checkpoint(st.work, r)):
                log(f"[loop] round {r}: checkpoint {checkpoint(st.work, r)} exists, skipped")
                rows.append({**row, "skipped": True})
                continue
            t0 = time.perf_counter()
            row.update(collect_round(st, r))
            t1 = time.perf_counter()
            summary: dict = {"round": r}
            if has_advantages(st.lake, r, st.method):
                log(f"[loop] round {r}: advantages exist, process skipped")
                row["process_s"] = 0.0
            else:
                summary = run_process(st.cfg, r, quiet=True)
                row["process_s"] = round(time.perf_counter() - t1, 2)
                row["process_state"] = summary.get("state")
                log(f"[loop] round {r}: processed ({summary.get('state')}) in {row['process_s']}s")
            row.update(train_round(st, r))
            if st.cfg.track:  # after training, so the round's train_metrics go too
                from flows.trackers import track_round

                row["tracked"] = ", ".join(track_round(st.cfg, r, summary))
            row["total_s"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
    finally:
        if st.server is not None:
            st.server.stop()
    return rows
