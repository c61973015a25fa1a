"""Tabular credit-assignment environments of the learning benchmark (issue 32), built like the papers' settings.

Each is a deterministic function of a task's hidden parameters, so the true values of any policy can be
computed exactly (memoised enumeration over the reachable states: `bench/learning_credit.py`'s oracle arm),
and a policy conditions on an abstract observation (`key`) that is the same across tasks, so it is evaluated on
held-out tasks it never trained on. None of them goes through the text loop: they are driven by the tabular
learner of bench/learning_credit.py, whose arms still take their credit from creditflow's estimators (the
rollouts are laid out as trajectories/steps tables, one token per action).

- `repair` (TCPO, code repair): the policy sees which categories pass and, for the failing ones, which edit is
  known to be right (a tried edit reveals it); 4 test categories, 3 of them failing at the start; each category has two
  candidate edits and one of them is right (hidden, drawn per task). The visible-test share is the per-turn
  verifier score. A wrong edit on a failing category fixes nothing and breaks another (hidden) category if it
  passes; a wrong edit on a passing category breaks it, including after success (edits after success can
  corrupt it). Fixed budget K = 5 turns (TCPO's code setting), every turn scored; reward = best-turn score, success = 1.0.
- `multihop` (C3, multi-hop search): a chain question -> e1 -> ... -> eH (H in 2..3, shown) whose entities come
  back one search at a time; `next` searches the newest entity, `repeat` re-issues the previous query (an exact
  query loop, detected by C3's detector), `related` searches a background page of the newest entity (a wasted
  turn no detector flags), `answer` answers with the newest entity. Budget = the optimum plus one (H + 2).
  The policy's prior likes repeating queries (logit +1.0 on `repeat`, +0.5 on `related`), so loops appear in successful episodes (one costs
  nothing) and cost success elsewhere (two fail).
- `toolchain` (IAPO): auth -> find_user -> get_order -> refund, each call needing the previous one's output;
  recoverable errors: a call without its input fails (`missing input`), the first call of some tools times
  out (hidden per task; a retry works), a `_guess` variant calls a tool with a guessed id (fails unless the
  task's id happens to be guessable). Budget 8 turns for a 4-call optimum. The true dependency graph
  (input edges, errors, recoveries) is what IAPO's annotator is meant to recover; the bench passes it as the
  nodes/edges tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

State = tuple
Key = tuple


@dataclass(frozen=True)
class Step:
    """One transition: next state, verifier score after the turn, done, and what annotators see."""

    state: State
    score: float
    done: bool
    text: str  # the action as the model would write it (C3's detector reads it)
    obs: str = ""
    error: bool = False  # the tool return is an error (IAPO e_i, steps.is_error)
    tool: int = -1  # IAPO: the tool this call used successfully (-1: none)
    binds: int = -1  # IAPO: the tool whose output the call consumed (-1: none)


@dataclass
class CreditEnv:
    """Base: `actions`, `max_turns(task)`, `init`, `key`, `step`, `outcome`, `prior`."""

    name: str = "base"
    actions: tuple[str, ...] = ()
    action_format: str = "chat"
    extra: dict[str, Any] = field(default_factory=dict)

    def tasks(self, n: int, seed: int) -> list[dict]:
        raise NotImplementedError

    def max_turns(self, task: dict) -> int:
        raise NotImplementedError

    def init(self, task: dict) -> State:
        raise NotImplementedError

    def key(self, task: dict, state: State) -> Key:
        raise NotImplementedError

    def step(self, task: dict, state: State, a: int) -> Step:
        raise NotImplementedError

    def outcome(self, task: dict, state: State) -> float:
        raise NotImplementedError

    def prior(self, key: Key) -> np.ndarray:
        return np.zeros(len(self.actions))

    def success(self, task: dict, state: State) -> bool:
        return self.outcome(task, state) >= 1.0 - 1e-9

    def tool_of(self, a: int) -> int:
        """The tool an action calls (-1: none); IAPO's recovery edges join an error to the next call of it."""
        return -1


# ---- TCPO: multi-turn code repair -----------------------------------------------------------------------
N_CAT = 4


class RepairEnv(CreditEnv):
    """state = (turn, passing mask, known-right variant per category (-1 unknown), best level so far)."""

    def __init__(self, turns: int = 5) -> None:
        super().__init__("repair", tuple(f"edit_c{c}_v{v}" for c in range(N_CAT) for v in (0, 1)))
        self.turns = turns

    def tasks(self, n: int, seed: int) -> list[dict]:
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            ok = int(rng.integers(N_CAT))  # the one category passing at the start
            fix = [int(x) for x in rng.integers(0, 2, N_CAT)]
            brk = [int((c + 1 + rng.integers(N_CAT - 1)) % N_CAT) for c in range(N_CAT)]  # never itself
            out.append({"id": f"repair-{seed}-{i}", "ok": ok, "fix": fix, "brk": brk})
        return out

    def max_turns(self, task: dict) -> int:
        return self.turns

    def init(self, task: dict) -> State:
        return (0, 1 << task["ok"], (-1,) * N_CAT, 1)

    def key(self, task: dict, state: State) -> Key:
        mask, know = state[1], state[2]  # what is known about a passing category matters once it breaks
        return (mask, tuple(-1 if mask >> c & 1 else k for c, k in enumerate(know)))

    def step(self, task: dict, state: State, a: int) -> Step:
        turn, mask, know, best = state
        c, v = divmod(a, 2)
        right = task["fix"][c]
        know = know[:c] + (right,) + know[c + 1 :]  # one try reveals which of the two edits is right
        if v == right:
            mask |= 1 << c
        elif mask >> c & 1:
            mask &= ~(1 << c)  # a wrong edit on a passing part breaks it (also after success)
        else:
            b = task["brk"][c]
            mask &= ~(1 << b)  # a wrong edit on a failing part breaks another part (if it passed)
        level = bin(mask).count("1")
        best = max(best, level)
        turn += 1
        return Step(
            (turn, mask, know, best), level / N_CAT, turn >= self.turns, self.actions[a], f"tests {level}/4"
        )

    def outcome(self, task: dict, state: State) -> float:
        return state[3] / N_CAT  # best-turn visible-test share (TCPO's trajectory reward)

    def success(self, task: dict, state: State) -> bool:
        return state[3] == N_CAT


# ---- C3: multi-hop search with a loop-liking prior -------------------------------------------------------
NEXT, REPEAT, RELATED, ANSWER = range(4)


class MultiHopEnv(CreditEnv):
    """state = (turn, hops found, kind of the last query: -1 none, 0 entity, 1 related; its entity, answered)."""

    def __init__(self, repeat_prior: float = 1.0, related_prior: float = 0.5) -> None:
        super().__init__("multihop", ("next", "repeat", "related", "answer"), "search_r1")
        self.repeat_prior = repeat_prior
        self.related_prior = related_prior

    def tasks(self, n: int, seed: int) -> list[dict]:
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            hops = int(rng.integers(2, 4))
            names = [f"e{int(x)}" for x in rng.choice(900, hops + 1, replace=False) + 100]
            out.append({"id": f"multihop-{seed}-{i}", "hops": hops, "names": names})
        return out

    def max_turns(self, task: dict) -> int:
        return task["hops"] + 2  # the optimum (H searches + answer) plus one

    def init(self, task: dict) -> State:
        return (0, 0, -1, -1, 0)

    def key(self, task: dict, state: State) -> Key:
        turn, hops, kind, _, _ = state
        return (task["hops"], hops, self.max_turns(task) - turn, kind)

    def prior(self, key: Key) -> np.ndarray:
        return np.array([0.0, self.repeat_prior, self.related_prior, 0.0])

    def step(self, task: dict, state: State, a: int) -> Step:
        turn, hops, kind, ent, answered = state
        names, H = task["names"], task["hops"]
        turn += 1
        if a == REPEAT and kind >= 0:  # re-issue the previous query exactly: the same results, nothing new
            q = names[ent] + (" background" if kind == 1 else "")
            text = f"<search>{q}</search>"
            if kind == 1:
                obs = "<information> (background) </information>"
            else:
                obs = (
                    f"<information> {names[ent + 1]} </information>"
                    if ent < H
                    else "<information> (nothing new) </information>"
                )
        elif a in (NEXT, REPEAT):  # a repeat before any query searches the question, like next
            kind, ent = 0, hops
            text = f"<search>{names[hops]}</search>"
            if hops < H:
                hops += 1
                obs = f"<information> {names[hops]} </information>"
            else:
                obs = "<information> (nothing new) </information>"
        elif a == RELATED:
            kind, ent = 1, hops
            text, obs = (
                f"<search>{names[hops]} background</search>",
                "<information> (background) </information>",
            )
        else:
            answered = 1 if hops == H else -1
            text, obs = f"<answer>{names[hops]}</answer>", ""
        done = answered != 0 or turn >= self.max_turns(task)
        score = 1.0 if answered == 1 else 0.5 * hops / H
        return Step((turn, hops, kind, ent, answered), score, done, text, obs)

    @staticmethod
    def is_repeat(state: State, a: int) -> bool:
        """The action re-issues the previous query (C3's exact query loop)."""
        return a == REPEAT and state[2] >= 0

    def outcome(self, task: dict, state: State) -> float:
        return float(state[4] == 1)


# ---- IAPO: a dependency chain of tool calls with recoverable errors --------------------------------------
TOOLS = ("auth", "find_user", "get_order", "refund")


class ToolChainEnv(CreditEnv):
    """state = (turn, progress (tools done in order), timeouts already hit (bit mask), last error kind, done)."""

    def __init__(self, turns: int = 8, p_timeout: float = 0.35, p_guess: float = 0.2) -> None:
        acts = (*TOOLS, *(f"{t}_guess" for t in TOOLS[1:]), "ask_user")
        super().__init__("toolchain", acts)
        self.turns, self.p_timeout, self.p_guess = turns, p_timeout, p_guess

    def tasks(self, n: int, seed: int) -> list[dict]:
        rng = np.random.default_rng(seed)
        return [
            {
                "id": f"toolchain-{seed}-{i}",
                "timeout": [int(x) for x in rng.random(len(TOOLS)) < self.p_timeout],
                "guessable": [int(x) for x in rng.random(len(TOOLS)) < self.p_guess],
            }
            for i in range(n)
        ]

    def max_turns(self, task: dict) -> int:
        return self.turns

    def init(self, task: dict) -> State:
        return (0, 0, 0, 0, 0)

    def key(self, task: dict, state: State) -> Key:
        return (state[1], state[3])

    def step(self, task: dict, state: State, a: int) -> Step:
        turn, progress, hit, last_err, finished = state
        turn += 1
        tool, binds, err, kind = -1, -1, False, 0
        if a == len(self.actions) - 1:  # ask_user: a wasted turn, no error
            text, obs = "ask_user", "user: please go ahead"
        else:
            guess = a >= len(TOOLS)
            k = a - len(TOOLS) + 1 if guess else a
            text = f"{self.actions[a]}()"
            if k < progress:  # a tool already done: a duplicate call, wasted
                obs = f"{TOOLS[k]}: already done"
            elif guess:  # a guessed id instead of the previous call's output: skips that call when it works
                if k == progress + 1 and task["guessable"][k]:
                    tool, progress = k, k + 1
                    obs = f"{TOOLS[k]}: ok"
                else:
                    err, kind = True, 2
                    obs = f"Error: {TOOLS[k]}: unknown id"
            elif k > progress:
                err, kind = True, 2  # its input is missing
                obs = f"Error: {TOOLS[k]}: missing input"
            elif task["timeout"][k] and not hit >> k & 1:
                err, kind = True, 1  # a transient failure: the same call again works
                hit |= 1 << k
                obs = f"Error: {TOOLS[k]}: timeout, retry"
            else:
                tool, binds = k, k - 1
                progress = k + 1
                obs = f"{TOOLS[k]}: ok"
        finished = int(progress == len(TOOLS))
        done = bool(finished) or turn >= self.turns
        score = progress / len(TOOLS)
        return Step((turn, progress, hit, kind, finished), score, done, text, obs, err, tool, binds)

    def outcome(self, task: dict, state: State) -> float:
        return float(state[4])

    def tool_of(self, a: int) -> int:
        if a == len(self.actions) - 1:
            return -1
        return a - len(TOOLS) + 1 if a >= len(TOOLS) else a


# ---- issue 27's environments as probes: the text envs, replayed from snapshots -----------------------------
class ToyProbe(CreditEnv):
    """One of issue 27's word envs (`c3_search`, `tcpo_refine`, `iapo_service`) as a tabular env: state = the
    actions so far (replayed from cached snapshots), key = (task, state) (what the tiny model saw: the prompt
    and the whole history). They have 8 tasks and no held-out split: every seed trains and evaluates on them."""

    def __init__(self, toy_name: str) -> None:
        from trainer.envs import make_toy_env

        self.toy = make_toy_env(toy_name)
        super().__init__(f"probe_{toy_name}", tuple(self.toy.actions), self.toy.action_format)
        self.cache: dict = {}

    def tasks(self, n: int, seed: int) -> list[dict]:
        return [{**t, "id": t["task_id"]} for t in self.toy.tasks()]

    def max_turns(self, task: dict) -> int:
        return int(self.toy.default_turns)

    def init(self, task: dict) -> State:
        return ()

    def key(self, task: dict, state: State) -> Key:
        return (task["id"], state)

    def _at(self, task: dict, state: State) -> tuple:
        """(snapshot, score, done, reward) after the actions `state`."""
        got = self.cache.get((task["id"], state))
        if got is None:
            if state:
                snap = self._at(task, state[:-1])[0]
                self.toy.restore(snap)
                res = self.toy.step(self.actions[state[-1]])
                got = (self.toy.snapshot(), res.score, res.done, self.toy.reward(), res.observation)
            else:
                self.toy.reset(task)
                got = (self.toy.snapshot(), 0.0, False, 0.0, "")
            self.cache[(task["id"], state)] = got
        return got

    def step(self, task: dict, state: State, a: int) -> Step:
        nxt = (*state, a)
        _, score, done, _, obs = self._at(task, nxt)
        return Step(
            nxt, float(score), bool(done), self.actions[a], obs, error=obs.strip().startswith("Error")
        )

    def outcome(self, task: dict, state: State) -> float:
        return float(self._at(task, state)[3])


CREDIT_ENVS = {"repair": RepairEnv, "multihop": MultiHopEnv, "toolchain": ToolChainEnv}
PROBES = ("c3_search", "tcpo_refine", "iapo_service")


def make_credit_env(name: str, **kwargs) -> CreditEnv:
    if name.startswith("probe_"):
        return ToyProbe(name.removeprefix("probe_"))
    return CREDIT_ENVS[name](**kwargs)
