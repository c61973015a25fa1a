"""The rollout environment interface (a superset of pipeline.counterfactual.env.StatefulEnv)."""

from __future__ import annotations

from typing import Any

from pipeline.counterfactual.env import EnvStep

__all__ = ["EnvStep", "RolloutEnv"]


class RolloutEnv:
    """Base class. Subclasses set `name`, `action_format`, `stop` and implement the methods below.

    Text layout of an episode (what the model sees, token for token, and what the steps table stores):
    system step `system_prompt(task)`, user step `reset(task)`, then per turn k an assistant step (the
    generated action, cut after the first stop string) and, unless the episode ended, an observation step
    (role `obs_role`) with `step(action).observation`."""

    name = "base"
    action_format = "chat"
    obs_role = "tool"
    stop: tuple[str, ...] = ()
    default_turns = 4

    def tasks(self) -> list[dict]:
        raise NotImplementedError

    def system_prompt(self, task: dict) -> str:
        raise NotImplementedError

    def reset(self, meta: dict) -> str:
        raise NotImplementedError

    def step(self, action: str) -> EnvStep:
        raise NotImplementedError

    def reward(self) -> float:
        raise NotImplementedError

    def reward_components(self) -> dict[str, float] | None:
        return None

    def cut_action(self, text: str) -> int:
        """Length of the action in a generated text: up to and including the first stop string (the whole
        text when none occurs). Generation stops there; anything after is discarded."""
        ends = [text.find(s) + len(s) for s in self.stop if s in text]
        return min(ends) if ends else len(text)

    def snapshot(self) -> Any:
        raise NotImplementedError

    def restore(self, snap: Any) -> None:
        raise NotImplementedError
