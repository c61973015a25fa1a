"""`code_repair`: verifier-guided repair of a small buggy Python function (data/repair_tasks.jsonl: 14 tasks,
each a description, a buggy implementation and 4 assert tests).

Each turn the model writes a whole corrected function in a ```python fenced block (generation stops at the
closing fence). The env runs the tests on it in trainer.sandbox (bubblewrap) and answers with the result
(`Tests passed: 2/4` and the first failures), until every test passes or the K-turn budget (meta
`max_turns`, default 3) is spent. A turn without a code block keeps the previous program (no progress).

Per-turn verifier score: fraction of tests passed by the current program. Reward: that fraction at the end
(1.0 = repaired).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

from trainer.envs import register
from trainer.envs.base import EnvStep, RolloutEnv

DATA = Path(__file__).with_name("data")
FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)
SYSTEM = (
    "Fix the Python function so that it passes its tests. Answer with the complete corrected function "
    "in one ```python code block. You will see the test results and may try again.\n\n"
)


@functools.lru_cache(maxsize=1)
def repair_tasks() -> list[dict]:
    path = DATA / "repair_tasks.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_program(program: str, tests: list[str], wall_s: float = 10.0) -> dict:
    from trainer.sandbox import current_settings, run_tests

    limits = current_settings().model_copy(update={"wall_s": wall_s, "cpu_s": int(max(wall_s, 1))})
    return run_tests(program, tests=tests, limits=limits)


@register("code_repair")
class CodeRepairEnv(RolloutEnv):
    name = "code_repair"
    action_format = "code"
    obs_role = "tool"
    stop = ("\n```\n", "```\n\n")
    default_turns = 3

    def __init__(self) -> None:
        self._state: dict[str, Any] = {}

    def tasks(self) -> list[dict]:
        return [
            {
                "env": self.name,
                "task_id": t["id"],
                "description": t["description"],
                "entry_point": t["entry_point"],
                "code": t["code"],
                "tests": t["tests"],
            }
            for t in repair_tasks()
        ]

    def system_prompt(self, task: dict) -> str:
        return SYSTEM

    def cut_action(self, text: str) -> int:
        m = FENCE.search(text)
        return m.end() if m else len(text)

    def _run(self, program: str) -> tuple[int, int, list[str], str | None]:
        res = run_program(program, self._state["tests"])
        total = len(self._state["tests"])
        if res["timeout"]:
            return 0, total, [], "timeout"
        if res["crash"]:
            return 0, total, [], res["crash"].splitlines()[0][:200]
        return int(res["passed"]), total, list(res["errors"]), None

    def reset(self, meta: dict) -> str:
        self._state = {
            "tests": list(meta["tests"]),
            "program": meta["code"],
            "turn": 0,
            "done": False,
            "max_turns": int(meta.get("max_turns", self.default_turns)),
        }
        passed, total, _, _ = self._run(meta["code"])
        self._state.update(passed=passed, total=total)
        tests = "\n".join(meta["tests"])
        return (
            f"Task: {meta['description']}\n\n```python\n{meta['code']}```\n\nTests:\n{tests}\n\n"
            f"Currently passing {passed}/{total}.\n"
        )

    def score(self) -> float:
        st = self._state
        return st["passed"] / st["total"] if st.get("total") else 0.0

    def step(self, action: str) -> EnvStep:
        st = self._state
        if st["done"]:
            return EnvStep("", self.score(), True)
        st["turn"] += 1
        blocks = FENCE.findall(action)
        if not blocks:
            obs = "\nNo ```python code block found; the program is unchanged. Try again.\n"
        else:
            st["program"] = blocks[-1]
            passed, total, errors, crash = self._run(st["program"])
            st.update(passed=passed, total=total)
            obs = f"\nTests passed: {passed}/{total}."
            if crash:
                obs += f" Error: {crash}."
            elif errors:
                obs += " Failures: " + "; ".join(e[:120] for e in errors[:2]) + "."
            obs += "\n"
        if st["passed"] == st["total"] or st["turn"] >= st["max_turns"]:
            st["done"] = True
        return EnvStep("" if st["done"] else obs, self.score(), st["done"])

    def reward(self) -> float:
        return self.score()

    def snapshot(self) -> Any:
        return copy.deepcopy(self._state)

    def restore(self, snap: Any) -> None:
        self._state = copy.deepcopy(snap)
