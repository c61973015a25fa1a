"""`c3_search`: a search task under a turn budget where successful episodes often contain repeated or
malformed queries (C3's "misguided reinforcement"), in the Search-R1 action format.

Task (question i of 2, 4 variants each: 8 tasks; the prompt is `Question: q<i>`): the answer `a<f(i)>` comes
back only from the right search, `<search>k<i></search>`, as `<information> a<f(i)>`; a wrong key returns
`<information> nothing`. `<answer>a<x></answer>` ends the episode. Every action is one word of the vocabulary
(`trainer/envs/toy.py`), already in the Search-R1 tag format, so C3's detector (`action_format = search_r1`)
reads it as is: any other word (e.g. the unclosed `<search>`) is an invalid action (severity 1) and a second
search with the same key is a query loop (severity 1). Both waste one of the K = 4 turns.

Reward: exact match of a supported answer (1/0): the answer counts only once the right document was retrieved
(a guess scores 0, so the only way to succeed is search, then answer). Per-turn verifier score: 1 after the right answer, else 0.5 once the
right document was retrieved, else 0 (as in `search_qa`). The optimum (search the right key, then answer) always
succeeds, in 2 turns; a uniformly random choice among the 6 actions about 1 time in 14.
"""

from __future__ import annotations

from trainer.envs import register
from trainer.envs.toy import ToyEnv

N_Q = 2
N_A = 4
N_VARIANTS = 4
SEARCH = tuple(f"<search>k{i}</search>" for i in range(N_Q))
ANSWER = tuple(f"<answer>a{j}</answer>" for j in range(N_A))


def answer_of(question: int) -> int:
    """The answer to question i (fixed: learnable, but it only counts once retrieved)."""
    return (question + 1) % N_A


@register("c3_search")
class C3SearchEnv(ToyEnv):
    name = "c3_search"
    title = "search_qa_toy"
    action_format = "search_r1"
    stop = ("</search>", "</answer>")
    default_turns = 4
    actions = SEARCH + ANSWER
    words = (
        "search_qa_toy",
        "Question:",
        *(f"q{i}" for i in range(N_Q)),
        "<information>",
        "nothing",
        *(f"a{j}" for j in range(N_A)),
        "<search>",
        "<answer>",
    )

    def tasks(self) -> list[dict]:
        return [
            {"env": self.name, "task_id": f"q{i}v{v}", "question": i, "answer": answer_of(i)}
            for i in range(N_Q)
            for v in range(N_VARIANTS)
        ]

    def system_prompt(self, task: dict) -> str:
        return self.describe()

    def reset(self, meta: dict) -> str:
        self._state = {
            **self.start(meta),
            "question": int(meta["question"]),
            "gold": int(meta["answer"]),
            "hit": False,
            "answer": None,
            "searches": [],
        }
        return f" Question: q{int(meta['question'])}"

    def transition(self, word: str) -> str:
        st = self._state
        if word in ANSWER:
            st["answer"] = ANSWER.index(word)
            return ""
        key = SEARCH.index(word)
        st["searches"].append(key)
        if key == st["question"]:
            st["hit"] = True
            return f" <information> a{st['gold']}"
        return " <information> nothing"

    def finished(self) -> bool:
        return self._state["answer"] is not None

    def score(self) -> float:
        st = self._state
        if st.get("answer") is not None:
            return self.reward()
        return 0.5 if st.get("hit") else 0.0

    def reward(self) -> float:
        st = self._state
        return float(st.get("answer") is not None and st["answer"] == st["gold"] and st.get("hit", False))

    def reward_components(self) -> dict[str, float]:
        st = self._state
        searches = st.get("searches", [])
        return {
            "em": self.reward(),
            "retrieval_hit": float(st.get("hit", False)),
            "invalid": float(st.get("invalid", 0)),
            "repeats": float(len(searches) - len(set(searches))),
        }
