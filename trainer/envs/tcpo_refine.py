"""`tcpo_refine`: iterative refinement with a per-turn verifier score in [0, 1] and a fixed turn budget K = 3
(TCPO), where a non-improving turn sets up the later success.

Task (hidden best candidate b of 6, and a quality pattern for the others; 6 x 4 = 24 tasks): the prompt is
`refine draft`. Actions (one word each): `use_c<x>` makes candidate x the draft (score = its quality: 1.0 for
the best, 0 / 0.25 / 0.5 / 0.75 for the others; observation `score s<4q>`); `inspect` leaves the draft as it is
(score unchanged: a non-improving turn) and answers `hint use_c<b>` (the action's own word: copy it), after which `use_c<b>` reaches 1.0. Any other
word is an invalid turn (no change). The episode always runs the K turns (turns after a success are scored,
as TCPO's rollouts require).

Per-turn verifier score r_k: the quality of the current draft (0 before any). Reward: the best-turn score
max_k r_k (TCPO's best-turn metric); success = 1.0. Blind guessing reaches the best candidate at most 3 times
in 6; inspect-then-use always does.
"""

from __future__ import annotations

from trainer.envs import register
from trainer.envs.toy import ToyEnv

N_C = 6
USE = tuple(f"use_c{x}" for x in range(N_C))
PATTERNS = (
    (0.0, 0.25, 0.5, 0.75, 0.5),
    (0.75, 0.5, 0.25, 0.0, 0.25),
    (0.25, 0.0, 0.75, 0.5, 0.0),
    (0.5, 0.75, 0.0, 0.25, 0.75),
)


def qualities(best: int, pattern: int) -> list[float]:
    others = iter(PATTERNS[pattern])
    return [1.0 if x == best else next(others) for x in range(N_C)]


@register("tcpo_refine")
class TCPORefineEnv(ToyEnv):
    name = "tcpo_refine"
    title = "refine_toy"
    action_format = "chat"
    default_turns = 3
    actions = ("inspect", *USE)
    words = (
        "refine_toy",
        "refine",
        "draft",
        "hint",
        *(f"c{x}" for x in range(N_C)),
        "score",
        *(f"s{k}" for k in range(5)),
    )

    def tasks(self) -> list[dict]:
        return [
            {"env": self.name, "task_id": f"b{b}p{p}", "best": b, "pattern": p}
            for b in range(N_C)
            for p in range(len(PATTERNS))
        ]

    def system_prompt(self, task: dict) -> str:
        return self.describe()

    def reset(self, meta: dict) -> str:
        self._state = {
            **self.start(meta),
            "best": int(meta["best"]),
            "quality": qualities(int(meta["best"]), int(meta["pattern"])),
            "draft": None,
            "scores": [],
            "inspected": False,
        }
        return " refine draft"

    def transition(self, word: str) -> str:
        st = self._state
        if word == "inspect":
            st["inspected"] = True
            return f" hint {USE[st['best']]}"
        st["draft"] = USE.index(word)
        return f" score s{round(4 * st['quality'][st['draft']])}"

    def score(self) -> float:
        st = self._state
        return float(st["quality"][st["draft"]]) if st.get("draft") is not None else 0.0

    def step(self, action: str):
        res = super().step(action)
        self._state["scores"].append(res.score)
        return res

    def reward(self) -> float:
        return float(max(self._state.get("scores") or [0.0]))

    def reward_components(self) -> dict[str, float]:
        st = self._state
        return {
            "best_turn": self.reward(),
            "final": self.score(),
            "inspected": float(st.get("inspected", False)),
        }
