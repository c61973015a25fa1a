"""`search_qa`: Search-R1-style question answering over a small shipped corpus (data/search_qa_*.jsonl: 62
short documents about the fictional Vessari Isles and 32 questions, each with gold answers and the id of the
documents that answer it; the model cannot know the answers without searching).

Actions (spec section 6): the first `<(search|answer)>(.*?)</\\1>` match of the generated text. Generation
stops at `</search>` / `</answer>`.
- `<search> q </search>`: BM25 top-k over the corpus; observation `\\n\\n<information>{docs}</information>\\n\\n`;
- `<answer> a </answer>`: the episode ends;
- anything else: the invalid-action message, no progress.
The turn budget (meta `max_turns`, default 4) ends the episode too.

Reward: strict exact match (pipeline.verifiers.qa normalisation) of the last answer, else 0.
Per-turn verifier score (TCPO's r_{i,k}, the state after the action): the EM of the answer when one was
given; otherwise 0.5 when a gold document has been retrieved so far (a retrieval hit), else 0.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

from pipeline.verifiers.qa import normalize_answer
from trainer.envs import register
from trainer.envs.base import EnvStep, RolloutEnv
from trainer.envs.bm25 import BM25

DATA = Path(__file__).with_name("data")
ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
INVALID = (
    "My previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and "
    "</answer>. Let me try again."
)
SYSTEM = (
    "Answer the question about the Vessari Isles. Think inside <think> and </think> when you get new "
    "information. To look something up, write a query as <search> query </search>; the top results "
    "come back between <information> and </information>. You may search several times. When you know "
    "the answer, give it briefly as <answer> answer </answer>, for example <answer> Maribel </answer>.\n\n"
)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[list[dict], BM25]:
    docs = _read_jsonl(DATA / "search_qa_corpus.jsonl")
    return docs, BM25([f"{d['title']} {d['text']}" for d in docs])


@functools.lru_cache(maxsize=1)
def questions() -> list[dict]:
    return _read_jsonl(DATA / "search_qa_questions.jsonl")


def format_docs(hits: list[dict]) -> str:
    return "\n".join(f"Doc {i}(Title: {d['title']}) {d['text']}" for i, d in enumerate(hits, start=1))


def exact_match(answer: str, golds: list[str]) -> float:
    pred = normalize_answer(answer)
    return 1.0 if any(normalize_answer(g) == pred for g in golds) else 0.0


@register("search_qa")
class SearchQAEnv(RolloutEnv):
    name = "search_qa"
    action_format = "search_r1"
    obs_role = "tool"
    stop = ("</search>", "</answer>")
    default_turns = 4

    def __init__(self, topk: int = 3):
        self.topk = topk
        self._state: dict[str, Any] = {}

    def tasks(self) -> list[dict]:
        return [
            {
                "env": self.name,
                "task_id": q["id"],
                "question": q["question"],
                "golden_answers": q["answers"],
                "gold_docs": q["docs"],
            }
            for q in questions()
        ]

    def system_prompt(self, task: dict) -> str:
        return SYSTEM

    def reset(self, meta: dict) -> str:
        self._state = {
            "question": meta["question"],
            "golds": list(meta["golden_answers"]),
            "gold_docs": list(meta.get("gold_docs") or []),
            "max_turns": int(meta.get("max_turns", self.default_turns)),
            "topk": int(meta.get("topk", self.topk)),
            "turn": 0,
            "answer": None,
            "hit": False,
            "done": False,
            "searches": [],
            "invalid": 0,
        }
        return f"Question: {meta['question']}\n"

    def search(self, query: str, k: int | None = None) -> list[dict]:
        docs, index = corpus()
        return [docs[i] for i in index.top(query, k or self._state.get("topk", self.topk))]

    def score(self) -> float:
        st = self._state
        if st["answer"] is not None:
            return exact_match(st["answer"], st["golds"])
        return 0.5 if st["hit"] else 0.0

    def step(self, action: str) -> EnvStep:
        st = self._state
        if st["done"]:
            return EnvStep("", self.score(), True)
        st["turn"] += 1
        m = ACTION.search(action)
        obs = ""
        if m is None:
            st["invalid"] += 1
            obs = f"\n{INVALID}\n"
        elif m.group(1) == "answer":
            st["answer"] = m.group(2).strip()
            st["done"] = True
        else:
            query = m.group(2).strip()
            hits = self.search(query)
            st["searches"].append(query)
            st["hit"] = st["hit"] or any(d["id"] in st["gold_docs"] for d in hits)
            obs = f"\n\n<information>{format_docs(hits)}</information>\n\n"
        if st["turn"] >= st["max_turns"]:
            st["done"] = True
        return EnvStep("" if st["done"] else obs, self.score(), st["done"])

    def reward(self) -> float:
        st = self._state
        return exact_match(st["answer"], st["golds"]) if st.get("answer") is not None else 0.0

    def reward_components(self) -> dict[str, float]:
        st = self._state
        return {"em": self.reward(), "retrieval_hit": float(st.get("hit", False))}

    def snapshot(self) -> Any:
        return copy.deepcopy(self._state)

    def restore(self, snap: Any) -> None:
        self._state = copy.deepcopy(snap)
