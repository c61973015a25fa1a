"""Stateful environments for fixed-history counterfactuals (TCPO section 3.2, the AppWorld case).

For a stateful task the history h_{i,k} includes the environment state E_{i,k} before turn k. To compare
alternatives under the same history, every alternative must start from that same state:

    env = make_env(meta)                      # registered by name: meta["env"]
    env.reset(meta)                           # the task's initial state
    for action in actions_before_turn_k:      # replay the recorded assistant actions (deterministic env)
        env.step(action)
    snap = env.snapshot()                     # E_{i,k}
    for alt in alternatives:
        env.restore(snap)                     # same state for every alternative
        q = env.step(alt).score               # one-step verifier comparison, in [0,1]
    env.restore(snap)                         # left as found

`StatefulEnv` is the interface (a typing Protocol: any class with these methods qualifies); the trainer's
rollout collection can use the same interface. `snapshot()` returns an opaque value that `restore()`
accepts any number of times; it must capture everything a later `step` reads (a deep copy for in-memory
state, a simulator checkpoint id for an external one such as AppWorld's). `step` returns the observation
and the verifier score of the state after the action; it never raises for a bad action (an invalid action
is an observation and, usually, no progress).

`KVBankEnv` ("kv_bank") is a small toy: accounts with balances, actions `deposit NAME AMT`,
`withdraw NAME AMT`, `transfer FROM TO AMT` (one per line), score = fraction of the goal balances met.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EnvStep:
    observation: str
    score: float  # verifier score of the state after the action, in [0,1]
    done: bool = False


@runtime_checkable
class StatefulEnv(Protocol):
    name: str

    def reset(self, meta: dict) -> str: ...

    def step(self, action: str) -> EnvStep: ...

    def snapshot(self) -> Any: ...

    def restore(self, snap: Any) -> None: ...


ENVS: dict[str, Callable[[], StatefulEnv]] = {}


def register_env(name: str):
    def deco(factory: Callable[[], StatefulEnv]) -> Callable[[], StatefulEnv]:
        ENVS[name] = factory
        return factory

    return deco


def make_env(meta: dict) -> StatefulEnv | None:
    """The registered environment named by meta["env"] (None when the task is stateless)."""
    name = meta.get("env")
    if not name:
        return None
    if isinstance(name, dict):
        name = name.get("name")
    if name not in ENVS:
        raise KeyError(f"unknown environment {name!r}; registered: {sorted(ENVS)}")
    return ENVS[name]()


def score_from_snapshot(
    env: StatefulEnv, meta: dict, prior_actions: list[str], alternatives: list[str]
) -> list[float]:
    """Scores of the alternatives, each applied to the same pre-turn state E_{i,k}."""
    env.reset(meta)
    for action in prior_actions:
        env.step(action)
    snap = env.snapshot()
    scores = []
    for alt in alternatives:
        env.restore(snap)
        scores.append(float(env.step(alt).score))
    env.restore(snap)
    return scores


_CMD = re.compile(r"^\s*(deposit|withdraw|transfer)\s+(\w+)(?:\s+(\w+))?\s+(-?\d+)\s*$", re.IGNORECASE)


@register_env("kv_bank")
class KVBankEnv:
    """A tiny key-value bank. meta: {"env": "kv_bank", "accounts": {name: balance}, "goal": {name: balance}}."""

    name = "kv_bank"

    def __init__(self) -> None:
        self.balances: dict[str, int] = {}
        self.goal: dict[str, int] = {}
        self.log: list[str] = []

    def reset(self, meta: dict) -> str:
        self.balances = {k: int(v) for k, v in (meta.get("accounts") or {}).items()}
        self.goal = {k: int(v) for k, v in (meta.get("goal") or {}).items()}
        self.log = []
        return f"balances: {self.balances}"

    def score(self) -> float:
        if not self.goal:
            return 0.0
        return sum(self.balances.get(k) == v for k, v in self.goal.items()) / len(self.goal)

    def _apply(self, line: str) -> str:
        m = _CMD.match(line)
        if not m:
            return f"invalid action: {line.strip()!r}"
        op, a, b, amt = m.group(1).lower(), m.group(2), m.group(3), int(m.group(4))
        if amt <= 0:
            return "amount must be positive"
        if op == "transfer":
            if b is None or a not in self.balances or b not in self.balances:
                return "unknown account"
            if self.balances[a] < amt:
                return "insufficient funds"
            self.balances[a] -= amt
            self.balances[b] += amt
        elif b is not None or a not in self.balances:
            return "unknown account"
        elif op == "deposit":
            self.balances[a] += amt
        else:
            if self.balances[a] < amt:
                return "insufficient funds"
            self.balances[a] -= amt
        return "ok"

    def step(self, action: str) -> EnvStep:
        results = [self._apply(line) for line in action.splitlines() if line.strip()]
        self.log.append(action)
        obs = "; ".join(results) or "no action"
        s = self.score()
        return EnvStep(f"{obs}; balances: {self.balances}", s, done=s == 1.0)

    def snapshot(self) -> Any:
        return copy.deepcopy((self.balances, self.goal, self.log))

    def restore(self, snap: Any) -> None:
        self.balances, self.goal, self.log = copy.deepcopy(snap)
