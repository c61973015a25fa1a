"""Rollout environments for `creditflow collect`: small, real, no download (their data ships in data/).

    env = make_env("search_qa")                   # a fresh instance
    tasks = env.tasks()                           # list of task metas (JSON-able; the trajectory's meta)
    first = env.reset(task)                       # the user prompt text
    step = env.step(action_text)                  # EnvStep(observation, score, done)
    env.reward()                                  # the outcome reward of the episode so far
    snap = env.snapshot(); env.restore(snap)      # TCPO's fixed-history protocol

Every env is also registered in `pipeline.counterfactual.env.ENVS` under the same name, so the TCPO
counterfactual stage can replay a collected trajectory (meta["env"]) from its pre-turn snapshot.

Registered: `search_qa` (Search-R1 tags over a shipped corpus with BM25, exact-match reward) and
`code_repair` (fix a buggy Python function; per-turn score = fraction of tests passed in the sandbox), and the
learning benchmark's small credit-assignment tasks over a closed word vocabulary (trainer/envs/toy.py; one
word per action): `c3_search` (C3), `tcpo_refine` (TCPO), `iapo_service` (IAPO).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from trainer.envs.base import RolloutEnv

if TYPE_CHECKING:
    from trainer.envs.toy import ToyEnv

ENVS: dict[str, Callable[[], RolloutEnv]] = {}


def register(name: str):
    """Register an env factory under `name` here and in the counterfactual stage's registry."""

    def deco(factory):
        from pipeline.counterfactual.env import register_env

        ENVS[name] = factory
        register_env(name)(factory)
        return factory

    return deco


def make_env(name: str) -> RolloutEnv:
    _load()
    if name not in ENVS:
        raise KeyError(f"unknown environment {name!r}; registered: {sorted(ENVS)}")
    return ENVS[name]()


def make_toy_env(name: str) -> ToyEnv:
    """A fresh word env (trainer/envs/toy.py: a fixed set of one-word `actions`) by name; a ValueError naming
    them for any other env."""
    from trainer.envs.toy import ToyEnv

    env = make_env(name)
    if not isinstance(env, ToyEnv):
        toys = sorted(
            n for n, factory in ENVS.items() if isinstance(factory, type) and issubclass(factory, ToyEnv)
        )
        raise ValueError(f"environment {name!r} has no fixed set of action words; the word envs: {toys}")
    return env


def env_names() -> list[str]:
    _load()
    return sorted(ENVS)


def _load() -> None:
    from trainer.envs import c3_search, iapo_service, repair, search_qa, tcpo_refine  # noqa: F401


_load()
