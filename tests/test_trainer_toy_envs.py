"""The learning benchmark's environments (issue 27): c3_search, tcpo_refine, iapo_service. Hand-played
episodes, a closed vocabulary (every emitted word tokenizes without [UNK]), snapshot/restore under any action
sequence, and that each paper's machinery reads them (C3's Search-R1 parser, IAPO's rules annotator, TCPO's
fixed-history replay)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.annotate.rules import annotate_trajectory
from pipeline.annotate.settings import RulesAnnotatorSettings
from pipeline.counterfactual.env import ENVS as CF_ENVS
from pipeline.counterfactual.env import make_env as cf_make_env
from pipeline.counterfactual.env import score_from_snapshot
from pipeline.detect.parse import parse_search_r1
from trainer.envs import env_names, make_env

TOYS = ("c3_search", "tcpo_refine", "iapo_service")


def play(name: str, meta: dict, actions: list[str]):
    env = make_env(name)
    env.reset({**meta, "env": name})
    steps = [env.step(a) for a in actions]
    return env, steps


def test_registered_for_collect_and_counterfactuals():
    assert set(TOYS) <= set(env_names())
    assert set(TOYS) <= set(CF_ENVS)


def test_c3_search_hand_played():
    meta = {"question": 1, "answer": 2}
    env, s = play("c3_search", meta, ["<search>k1</search>", "<answer>a2</answer>"])
    assert [x.score for x in s] == [0.5, 1.0] and s[0].observation == " <information> a2"
    assert s[-1].done and env.reward() == 1.0
    # wasted turns: an invalid word, then a repeated query; the budget K = 4 ends the episode unanswered
    env, s = play("c3_search", meta, ["<search>", "<search>k1</search>", "<search>k1</search>", "bogus"])
    assert s[0].observation == " invalid action" and s[-1].done and env.reward() == 0.0
    assert env.reward_components() == {"em": 0.0, "retrieval_hit": 1.0, "invalid": 2.0, "repeats": 1.0}
    env, s = play("c3_search", meta, ["<search>k0</search>", "<answer>a2</answer>"])
    assert s[0].observation == " <information> nothing" and env.reward() == 0.0  # right answer, unsupported
    env, s = play("c3_search", meta, ["<answer>a2</answer>"])  # a guess scores 0 even when it is right
    assert s[0].done and s[0].score == 0.0 and env.reward() == 0.0
    assert {t["answer"] for t in make_env("c3_search").tasks() if t["question"] == 1} == {2}


def test_c3_actions_are_search_r1_for_the_detector():
    p = parse_search_r1("<search>k1</search>")
    assert not p.invalid and p.actions[0].query == "k1"
    assert not parse_search_r1("<answer>a0</answer>").invalid
    for bad in ("<search>", "<|im_end|>", "a2"):
        assert parse_search_r1(bad).invalid  # invalid action, severity 1 in C3's Table 5


def test_tcpo_refine_hand_played():
    meta = {"draft": 3}
    env, s = play("tcpo_refine", meta, ["plan", "edit", "edit"])
    assert s[0].observation == " planned score s0" and [x.score for x in s] == [0.0, 0.75, 1.0]
    assert [x.done for x in s] == [False, False, True] and env.reward() == 1.0
    env, s = play("tcpo_refine", meta, ["edit", "plan", "edit"])
    assert [x.score for x in s] == [0.25, 0.25, 1.0] and env.reward() == 1.0
    env, s = play("tcpo_refine", meta, ["edit", "edit", "edit"])  # no plan: 0.75 at best
    assert [x.score for x in s] == [0.25, 0.5, 0.75] and env.reward() == 0.75
    env, s = play("tcpo_refine", {**meta, "max_turns": 4}, ["plan", "edit", "edit", "undo"])
    assert [x.score for x in s] == [0.0, 0.75, 1.0, 0.75]  # turns after the success still scored
    assert env.reward() == 1.0 and env.reward_components() == {"best_turn": 1.0, "final": 0.75, "plans": 1.0}
    env, s = play("tcpo_refine", meta, ["undo", "bogus", "edit"])
    assert [x.score for x in s] == [0.0, 0.0, 0.25] and s[1].observation == " invalid action"


def test_iapo_service_hand_played():
    meta = {"order": 2, "customer": 5}
    env, s = play("iapo_service", meta, ["lookup", "refund(O12)"])
    assert s[0].observation == " order refund(O12)" and s[-1].done and env.reward() == 1.0
    env, s = play("iapo_service", meta, ["refund(O12)", "lookup", "refund(O12)"])  # one error is recoverable
    assert s[0].observation == " Error: order not verified" and env.reward() == 1.0
    env, s = play("iapo_service", meta, ["lookup", "refund(O10)", "refund(O12)"])
    assert s[1].observation == " Error: unknown order" and env.reward() == 1.0
    env, s = play("iapo_service", meta, ["lookup", "refund(O10)", "refund(O11)"])  # the second error ends it
    assert s[-1].done and env.reward() == 0.0 and env.reward_components()["errors"] == 2.0


def test_iapo_rules_annotator_reads_the_dependency_and_the_error():
    rows = [
        {"role": "system", "content": "refund_service_toy", "turn": None},
        {"role": "user", "content": " refund_request cust1", "turn": None},
        {"role": "assistant", "content": "refund(O10)", "turn": 1},
        {"role": "tool", "content": " Error: order not verified", "turn": 1, "is_error": False},
        {"role": "assistant", "content": "lookup", "turn": 2},
        {"role": "tool", "content": " order refund(O12)", "turn": 2},
        {"role": "assistant", "content": "refund(O12)", "turn": 3},
    ]
    nodes, edges = annotate_trajectory(rows, RulesAnnotatorSettings())
    assert nodes[1][0] == "tool" and nodes[2][0] == "none" and nodes[3][0] == "none"
    kinds = {(i, j, t) for i, j, t, *_ in edges}
    assert (2, 3, "success_utilization") in kinds  # the refund binds the lookup's order id
    assert (1, 2, "failed_utilization") in kinds  # the action after the error recovers from it


def test_tcpo_counterfactual_replay_from_the_pre_turn_state():
    env = cf_make_env({"env": "tcpo_refine"})
    meta = {"env": "tcpo_refine", "draft": 1, "max_turns": 3}
    # turn 2 after `plan`: alternatives scored one step from the same state (the planned edit jumps to 0.75)
    assert score_from_snapshot(env, meta, ["plan"], ["edit", "undo", "plan", "zzz"]) == [0.75, 0.0, 0.0, 0.0]
    # turn 1: the setup turn scores 0 where an edit scores 0.25 at once
    assert score_from_snapshot(env, meta, [], ["plan", "edit"]) == [0.0, 0.25]


@pytest.mark.parametrize("name", TOYS)
def test_vocabulary_is_closed_and_tokenizes(name, tmp_path):
    from trainer.generation import Codec
    from trainer.tiny import word_tokenizer_json

    env = make_env(name)
    words = env.vocabulary()
    assert words[:2] == ["<|im_end|>", "[UNK]"] and len(set(words)) == len(words)
    word_tokenizer_json(words, tmp_path / "tokenizer.json")
    codec = Codec(tmp_path)
    assert codec.eos_ids == [0] and codec.vocab_size == len(words)
    for a in env.actions:
        ids, _ = codec.encode(a)
        assert len(ids) == 1 and codec.decode(ids) == a  # one token per action
    unk = words.index("[UNK]")
    for task in env.tasks():
        texts = [env.system_prompt(task), env.reset({**task, "max_turns": 4})]
        for a in env.actions:
            e = make_env(name)
            e.reset({**task, "max_turns": 4})
            texts.append(e.step(a).observation)
        for t in texts:
            assert unk not in codec.encode(t)[0], (name, t)


def test_word_tokenizer_rejects_bad_vocabularies(tmp_path):
    from trainer.tiny import word_tokenizer_json

    with pytest.raises(ValueError):
        word_tokenizer_json(["<|im_end|>", "[UNK]", "a", "a"], tmp_path / "t.json")
    with pytest.raises(ValueError):
        word_tokenizer_json(["<|im_end|>", "[UNK]", "a b"], tmp_path / "t.json")
    with pytest.raises(ValueError):
        word_tokenizer_json(["a", "b"], tmp_path / "t.json")


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(TOYS),
    task_i=st.integers(0, 40),
    picks=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    cut=st.integers(0, 5),
)
def test_any_play_stays_in_bounds_and_restores(name, task_i, picks, cut):
    env = make_env(name)
    words = env.vocabulary()
    tasks = env.tasks()
    meta = {**tasks[task_i % len(tasks)], "max_turns": 4}
    actions = [words[p % len(words)] for p in picks]
    env.reset(meta)
    snap = None
    results = []
    for k, a in enumerate(actions):
        if k == min(cut, len(actions) - 1):
            snap = env.snapshot()
        res = env.step(a)
        results.append(res)
        assert 0.0 <= res.score <= 1.0 and 0.0 <= env.reward() <= 1.0
        assert res.done or res.observation  # an episode that goes on always answers
    assert sum(r.done for r in results) <= len(results)
    # replay from the snapshot: the same actions give the same observations and scores
    k0 = min(cut, len(actions) - 1)
    env.restore(snap)
    again = [env.step(a) for a in actions[k0:]]
    assert again == results[k0:]


def test_iapo_system_prompt_keeps_the_order_ids_specific():
    from pipeline.annotate.rules import text_values

    env = make_env("iapo_service")
    task = env.tasks()[0]
    assert not text_values(env.system_prompt(task), RulesAnnotatorSettings())  # else no edge could bind them


def test_format_prior_puts_the_mass_on_action_words(tmp_path):
    from trainer.tiny import build_tiny_model, format_prior, word_tokenizer_json

    words = make_env("iapo_service").vocabulary()
    tok = word_tokenizer_json(words, tmp_path / "tok" / "tokenizer.json")
    build_tiny_model(tmp_path / "m", vocab_size=len(words), hidden=16, layers=1, heads=2, tokenizer_json=tok)
    fp = format_prior(tmp_path / "m", "iapo_service", steps=60, episodes=64)
    assert fp["action_mass_before"] < 0.5 < 0.9 < fp["action_mass_after"]  # 4 of ~25 words at first
