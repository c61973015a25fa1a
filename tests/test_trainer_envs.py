"""Trainer environments: BM25 retrieval, Search-R1 actions and rewards, code repair in the sandbox, and the
snapshot/restore protocol the TCPO counterfactual stage relies on."""

import math

import numpy as np
import pytest

from pipeline.counterfactual.env import ENVS as CF_ENVS
from pipeline.counterfactual.env import score_from_snapshot
from trainer.envs import env_names, make_env
from trainer.envs.bm25 import BM25, tokenize
from trainer.envs.search_qa import INVALID, corpus, questions


def test_registry_and_counterfactual_registration():
    assert {"search_qa", "code_repair"} <= set(env_names())
    assert {"search_qa", "code_repair"} <= set(CF_ENVS)  # TCPO's stage finds them by meta["env"]
    with pytest.raises(KeyError):
        make_env("nope")


def test_bm25_hand_computed():
    docs = ["red apple", "green apple pie", "blue sky"]
    bm = BM25(docs, k1=1.5, b=0.75)
    # 'sky' occurs in one doc of three: idf = ln(1 + (3 - 1 + 0.5) / (1 + 0.5)); doc 2 has length 2 = avgdl-ish
    idf = math.log(1 + 2.5 / 1.5)
    dl, avgdl = 2, 7 / 3
    expect = idf * 1 * 2.5 / (1 + 1.5 * (1 - 0.75 + 0.75 * dl / avgdl))
    s = bm.scores("sky")
    assert s[2] == pytest.approx(expect)
    assert s[0] == s[1] == 0
    assert bm.top("apple pie", 3)[0] == 1  # both terms
    assert bm.top("unknown words", 3) == []
    assert tokenize("What is THE capital?") == ["capital"]


def test_bm25_finds_the_gold_document():
    env = make_env("search_qa")
    top1 = 0
    for q in questions():
        hits = [d["id"] for d in env.search(q["question"], 3)]
        assert set(q["docs"]) & set(hits), (q["id"], hits)
        top1 += hits[0] in q["docs"]
    assert top1 == len(questions())
    docs, _ = corpus()
    assert len(docs) >= 50 and len(questions()) >= 30


def _task(env, task_id):
    return next(t for t in env.tasks() if t["task_id"] == task_id)


def test_search_qa_actions_and_rewards():
    env = make_env("search_qa")
    task = {**_task(env, "q14"), "max_turns": 4}  # Who wrote the poem The Salt Road? -> Orrin Vale
    first = env.reset(task)
    assert first == "Question: Who wrote the poem The Salt Road?\n"
    bad = env.step("I think I know it.")
    assert bad.observation == f"\n{INVALID}\n" and bad.score == 0.0 and not bad.done
    miss = env.step("<search> herring season auction </search>")
    assert miss.observation.startswith("\n\n<information>Doc 1(Title: ") and miss.observation.endswith(
        "</information>\n\n"
    )
    assert miss.score == 0.0  # gold document not retrieved
    # the first action counts: a search followed by an answer in the same text is a search
    hit = env.step("<think>poem</think><search> The Salt Road poem author </search><answer> x </answer>")
    assert "Orrin Vale" in hit.observation and hit.score == 0.5 and not hit.done
    assert env.reward() == 0.0
    ans = env.step("<answer> orrin vale. </answer>")  # EM after normalisation
    assert ans.done and ans.score == 1.0 and ans.observation == ""
    assert env.reward() == 1.0 and env.reward_components() == {"em": 1.0, "retrieval_hit": 1.0}
    # a wrong answer ends the episode with 0
    env.reset(task)
    wrong = env.step("<answer> Agna Rell </answer>")
    assert wrong.done and wrong.score == 0.0 and env.reward() == 0.0


def test_search_qa_turn_budget():
    env = make_env("search_qa")
    env.reset({**_task(env, "q01"), "max_turns": 2})
    assert not env.step("<search> capital </search>").done
    last = env.step("<search> capital </search>")
    assert last.done and last.observation == "" and env.reward() == 0.0
    assert env.cut_action("<search> a </search> more <answer> b </answer>") == len("<search> a </search>")
    assert env.cut_action("no stop here") == len("no stop here")


FIX_R01 = "```python\ndef total(xs):\n    return sum(xs)\n```\n"
HALF_R01 = "```python\ndef total(xs):\n    return 0\n```\n"  # passes [] and [-4, 4]


@pytest.mark.sandbox
def test_code_repair_scores_and_budget():
    env = make_env("code_repair")
    task = {**_task(env, "r01"), "max_turns": 3}
    first = env.reset(task)
    assert "Currently passing 0/4." in first and "def total(xs):" in first
    none = env.step("I would use sum.")
    assert "No ```python code block" in none.observation and none.score == 0.0 and not none.done
    half = env.step(HALF_R01)
    assert half.score == 0.5 and "Tests passed: 2/4." in half.observation and not half.done
    done = env.step(FIX_R01)
    assert done.done and done.score == 1.0 and env.reward() == 1.0
    cut = env.cut_action("Fix:\n" + FIX_R01 + "more")
    assert ("Fix:\n" + FIX_R01 + "more")[:cut].endswith("```")
    # the budget ends an unsolved episode
    env.reset({**task, "max_turns": 1})
    assert env.step(HALF_R01).done and env.reward() == 0.5


@pytest.mark.parametrize(
    "name,prior,alts",
    [
        (
            "search_qa",
            ["<search> Vessari flag stars </search>", "nonsense"],
            ["<answer> eleven </answer>", "<answer> twelve </answer>", "<search> flag </search>", "junk"],
        ),
        pytest.param("code_repair", [HALF_R01], [FIX_R01, HALF_R01, "no code"], marks=pytest.mark.sandbox),
    ],
)
def test_snapshot_restore_identical_continuations(name, prior, alts):
    env = make_env(name)
    task = {**(_task(env, "q19") if name == "search_qa" else _task(env, "r01")), "max_turns": 4}
    env.reset(task)
    for a in prior:
        env.step(a)
    snap = env.snapshot()
    first = [env.step(a) for a in alts]  # a whole continuation
    env.restore(snap)
    again = [env.step(a) for a in alts]
    assert first == again
    env.restore(snap)
    one_each = []
    for a in alts:  # each alternative from the same pre-turn state
        env.restore(snap)
        one_each.append(env.step(a).score)
    # the counterfactual stage's helper: reset(meta) + replay + snapshot gives the same scores
    scores = score_from_snapshot(CF_ENVS[name](), task, prior, alts)
    assert scores == one_each
    assert len(set(np.round(scores, 6))) > 1  # the alternatives are told apart
