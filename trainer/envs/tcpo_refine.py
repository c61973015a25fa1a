"""`tcpo_refine`: iterative refinement with a per-turn verifier score in [0, 1] and a fixed turn budget K = 3
(TCPO), where a non-improving turn sets up the later success.

Task (8 drafts, the same dynamics; the prompt is `refine draft d<i>`): the draft's quality is a level 0..4,
its verifier score level / 4 (observation `score s<level>`). Actions (one word each): `edit` raises the level by
1; `plan` leaves the draft as it is (a non-improving turn: the score does not move) but makes the next `edit`
raise it by 3 (observation `planned score s<level>`); `undo` lowers it by 1. Any other word is an invalid turn
(no change). The episode always runs the K = 3 turns (turns after a success are scored, as TCPO's rollouts
require). Three plain edits reach 0.75 at best: 1.0 needs a plan before an edit (plan, edit, edit or edit, plan,
edit), so the turn that sets up the success is one whose own score shows no progress: what TCPO's hindsight
credit is for, and what a one-step counterfactual (an `edit` instead scores higher at once) misjudges.

Reward: the best-turn score max_k r_k (TCPO's best-turn metric); success = 1.0. A uniformly random choice
among the three actions succeeds 2 times in 27.
"""

from __future__ import annotations

from trainer.envs import register
from trainer.envs.toy import ToyEnv

N_DRAFTS = 8


@register("tcpo_refine")
class TCPORefineEnv(ToyEnv):
    name = "tcpo_refine"
    title = "refine_toy"
    action_format = "chat"
    default_turns = 3
    actions = ("plan", "edit", "undo")
    words = (
        "refine",
        "draft",
        *(f"d{i}" for i in range(N_DRAFTS)),
        "planned",
        "score",
        *(f"s{k}" for k in range(5)),
    )

    def tasks(self) -> list[dict]:
        return [{"env": self.name, "task_id": f"d{i}", "draft": i} for i in range(N_DRAFTS)]

    def system_prompt(self, task: dict) -> str:
        return self.describe()

    def reset(self, meta: dict) -> str:
        self._state = {**self.start(meta), "level": 0, "planned": False, "scores": [], "plans": 0}
        return f" refine draft d{int(meta['draft'])}"

    def transition(self, word: str) -> str:
        st = self._state
        if word == "plan":
            st["planned"] = True
            st["plans"] += 1
            return f" planned score s{st['level']}"
        if word == "edit":
            st["level"] = min(4, st["level"] + (3 if st["planned"] else 1))
            st["planned"] = False
        else:  # undo
            st["level"] = max(0, st["level"] - 1)
        return f" score s{st['level']}"

    def score(self) -> float:
        return self._state.get("level", 0) / 4

    def step(self, action: str):
        res = super().step(action)
        self._state["scores"].append(res.score)
        return res

    def reward(self) -> float:
        return float(max(self._state.get("scores") or [0.0]))

    def reward_components(self) -> dict[str, float]:
        st = self._state
        return {"best_turn": self.reward(), "final": self.score(), "plans": float(st.get("plans", 0))}
