"""The trainer's hooks for `flows.round_loop.round_loop_flow`: `collect(config, round_)` and
`train(config, round_)`, the same stage functions `creditflow loop` runs (trainer/loop.py). The flow runs
process_round_flow between them, so a Prefect deployment of round_loop_flow is the scheduled form of the loop.

A managed vLLM server (backend vllm without an endpoint) is kept per process across rounds and restarted on
each new policy; `stop_server()` ends it."""

from __future__ import annotations

from pipeline.config import Config
from trainer.loop import LoopState, ManagedServer, collect_round, train_round

_SERVER: ManagedServer | None = None


def _state(config: Config) -> LoopState:
    global _SERVER
    st = LoopState(config, server=_SERVER)
    _SERVER = st.server
    return st


def collect(config: Config, round_: int) -> dict:
    return collect_round(_state(config), round_)


def train(config: Config, round_: int) -> dict:
    return train_round(_state(config), round_)


def stop_server() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.stop()
        _SERVER = None
