"""Shared base of the three learning-benchmark environments (issue 27): `c3_search`, `tcpo_refine`,
`iapo_service`. Each is a small, fully observable credit-assignment problem a tiny policy learns in minutes.

Design (the same for all three):
- A closed word vocabulary (`vocabulary()`): every text the env emits (system prompt, task prompt,
  observations) is a sequence of these words separated by spaces, and every action is ONE word. The loop
  builds the tiny model's word-level tokenizer from it (`loop.tiny_tokenizer: env`), so an action is one
  token and `collect.max_new_tokens: 1` suffices; a word that is not an action is an invalid action.
- Each task is a small lookup the policy can learn (question -> search key -> answer; customer -> order),
  but only by acting: an answer counts once retrieved, a refund once looked up, a full score needs a plan.
- A group is the samples of one task, as GRPO requires (at least 8 tasks: a round's prompts are distinct).
- `snapshot()` / `restore()` deep-copy the whole state (TCPO's fixed-history counterfactuals replay from it).
"""

from __future__ import annotations

import copy
from typing import Any

from trainer.envs.base import EnvStep, RolloutEnv

EOS = "<|im_end|>"
UNK = "[UNK]"


class ToyEnv(RolloutEnv):
    """Single-token actions over a closed vocabulary; subclasses define the task and the transition."""

    default_turns = 3
    obs_role = "tool"
    actions: tuple[str, ...] = ()
    words: tuple[str, ...] = ()  # prompt and observation words (actions are added by vocabulary())
    invalid_text = "invalid action"

    def __init__(self) -> None:
        self._state: dict[str, Any] = {}

    # ---- vocabulary -------------------------------------------------------------------------------------
    def vocabulary(self) -> list[str]:
        """Every word the env can emit or accept, specials first (ids 0, 1), no duplicates."""
        out: list[str] = []
        extra = (self.title, "actions:", "answer_with_one_action", *self.invalid_text.split())
        for w in (EOS, UNK, *self.words, *extra, *self.actions):
            if w not in out:
                out.append(w)
        return out

    title = "toy"

    def describe(self) -> str:
        """The system prompt: the env's title and its action words (in the vocabulary, so the tiny model sees
        them as tokens; a real model reads which words it may answer with)."""
        return f"{self.title} actions: {' '.join(self.actions)} answer_with_one_action"

    def parse(self, action: str) -> str | None:
        """The action of a generated text: its first word when that is an action (None: an invalid turn). With
        the env's word tokenizer the text is one word; a subword model (SmolLM2) may write more after it."""
        words = action.split(maxsplit=1)
        return words[0] if words and words[0] in self.actions else None

    # ---- state ------------------------------------------------------------------------------------------
    def start(self, meta: dict) -> dict:
        return {
            "turn": 0,
            "done": False,
            "max_turns": int(meta.get("max_turns", self.default_turns)),
            "invalid": 0,
            "actions": [],
        }

    def transition(self, word: str) -> str:
        """Apply a valid action to self._state; return the observation text."""
        raise NotImplementedError

    def score(self) -> float:
        raise NotImplementedError

    def finished(self) -> bool:
        """The episode ends before the budget (e.g. an answer was given)."""
        return False

    def step(self, action: str) -> EnvStep:
        st = self._state
        if st["done"]:
            return EnvStep("", self.score(), True)
        st["turn"] += 1
        word = self.parse(action)
        st["actions"].append(word)
        if word is None:
            st["invalid"] += 1
            obs = f" {self.invalid_text}"
        else:
            obs = self.transition(word)
        if self.finished() or st["turn"] >= st["max_turns"]:
            st["done"] = True
        return EnvStep("" if st["done"] else obs, self.score(), st["done"])

    def snapshot(self) -> Any:
        return copy.deepcopy(self._state)

    def restore(self, snap: Any) -> None:
        self._state = copy.deepcopy(snap)
