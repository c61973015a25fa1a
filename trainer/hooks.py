"""The trainer's hooks for the round loop (`flows.round_loop.round_loop_flow`, what `creditflow loop` runs):
`setup`, `status`, `collect`, `train`, `teardown`, each the stage function of trainer/loop.py on one
`LoopState`. The flow runs process between collect and train, so a Prefect deployment of round_loop_flow is
the scheduled form of the loop.

The state (the base model, the loop's method, a managed vLLM server for backend vllm without an endpoint) is
kept per process across rounds; the server is restarted on each new policy, and `teardown` stops it."""

from __future__ import annotations

from pipeline.config import Config
from trainer.loop import Log, LoopState, collect_round, round_status, train_round

_STATE: LoopState | None = None


def setup(config: Config, log: Log = print) -> Config:
    """The loop's state for `config` (its server kept); returns the config the loop runs with (the loop's
    method added to `methods` when missing)."""
    global _STATE
    _STATE = LoopState(config, log, server=_STATE.server if _STATE is not None else None)
    return _STATE.cfg


def _state(config: Config) -> LoopState:
    """The state `setup` made for this config, or a new one (a hook called without setup)."""
    if _STATE is None or _STATE.cfg != config:
        setup(config, _STATE.log if _STATE is not None else print)
    assert _STATE is not None
    return _STATE


def status(config: Config, round_: int) -> dict:
    return round_status(_state(config), round_)


def collect(config: Config, round_: int) -> dict:
    return collect_round(_state(config), round_)


def train(config: Config, round_: int) -> dict:
    return train_round(_state(config), round_)


def teardown() -> None:
    """Stop the managed vLLM server (if one runs) and drop the state."""
    global _STATE
    if _STATE is not None and _STATE.server is not None:
        _STATE.server.stop()
    _STATE = None
