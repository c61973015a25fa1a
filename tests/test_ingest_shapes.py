"""Issue 24, ingest: every shape the real sources use. FireAct's chat-list `traj` (built here from the shipped
string-form file, converted record by record to the shape FireAct's generation.py writes with
`--chatgpt_format`), one Observation per ReAct Action, tau2's harness-injected messages, and sample indices
unique in groups that several sources share."""

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ingest import ingest
from pipeline.tokenize import ByteTokenizer

BYTES = ByteTokenizer()
TAU = "tau_bench_v1/gpt-4o-airline.json"
TAU2 = "tau2_bench/qwen2.5-7b_airline_1trial.json"
REACT = "fireact_hotpotqa/hotpotqa_dev_0_500_llama_models_lora_llama-2-7b-d_1000_0.7_2023-09-19-00-49-36.json"


def _path(real_data, rel):
    path = real_data / rel
    if not path.exists():
        pytest.skip(f"{path} not shipped")
    return path


def to_chat(traj: str) -> list[dict]:
    """FireAct's chat shape of one string-form trajectory: user = the question; per iteration an assistant
    message (its Thought and Action lines) and a user message "Observation: ..."."""
    head, body = traj.split("### Response:\n", 1)
    question = head.split("### Instruction:\n", 1)[1].strip()
    messages = [{"role": "user", "content": question}]
    for line in body.rstrip("\n").split("\n"):
        if line.startswith("Observation"):
            messages.append({"role": "user", "content": line})
        elif line.startswith("Thought") or (
            line.startswith("Action")
            and not (messages[-1]["role"] == "assistant" and "\nAction" not in "\n" + messages[-1]["content"])
        ):
            messages.append({"role": "assistant", "content": line})
        else:  # the Action of the Thought before it, or a continuation line
            messages[-1]["content"] += "\n" + line
    return messages


def _by_traj(res):
    out = {}
    for row in res.steps.to_pylist():
        out.setdefault(row["traj_id"], []).append(row)
    return {k: sorted(v, key=lambda r: r["step_idx"]) for k, v in out.items()}


KEYS = ("role", "turn", "tool_calls", "tool_call_id", "is_error")


def test_fireact_chat_list_gives_the_steps_of_the_string_form(real_data):
    path = _path(real_data, REACT)
    raw = json.loads(path.read_text())
    chat = {
        k: {**{f: v for f, v in r.items() if f != "traj_by_line"}, "prompt": [], "traj": to_chat(r["traj"])}
        for k, r in raw.items()
    }
    s_res = ingest("react", [(str(path), path.read_text())], tokenizer=BYTES)
    c_res = ingest("react", [(str(path), json.dumps(chat))], tokenizer=BYTES)
    assert s_res.quarantine.num_rows == c_res.quarantine.num_rows == 0  # was: 500 of 500 quarantined
    assert c_res.trajectories.num_rows == 500
    s_steps, c_steps = _by_traj(s_res), _by_traj(c_res)
    assert s_steps.keys() == c_steps.keys()
    for tid, s_rows in s_steps.items():
        c_rows = c_steps[tid]
        assert [{k: r[k] for k in KEYS} for r in c_rows] == [{k: r[k] for k in KEYS} for r in s_rows]
        # every step after the instruction has the same text; the user step is the bare question
        assert [r["content"] for r in c_rows[1:]] == [r["content"] for r in s_rows[1:]]
        assert c_rows[0]["content"] in s_rows[0]["content"]
    s_meta = {r["traj_id"]: json.loads(r["meta"]) for r in s_res.trajectories.to_pylist()}
    for r in c_res.trajectories.to_pylist():
        meta = json.loads(r["meta"])
        assert meta["question"] == s_meta[r["traj_id"]]["question"] and meta["traj_shape"] == "chat"
    assert s_res.trajectories["reward"].to_pylist() == c_res.trajectories["reward"].to_pylist()


def test_fireact_chat_record_as_published():
    """One record as FireAct's gpt-3.5 run publishes it (trajs/hotpotqa_dev_0_500_ft_gpt-3.5-turbo-...json)."""
    record = {
        "reward": True,
        "em": True,
        "f1": 1.0,
        "gt": "seth macfarlane",
        "pred": "seth macfarlane",
        "prompt": [],
        "traj": [
            {
                "role": "user",
                "content": "Who created the show with Wendy Schaal doing the voice of Francine?",
            },
            {
                "role": "assistant",
                "content": "Thought: I need to search Wendy Schaal.\nAction: search[Wendy Schaal]",
            },
            {"role": "user", "content": "Observation: Wendy Schaal voices Francine on American Dad!"},
            {
                "role": "assistant",
                "content": 'Thought: "American Dad!" was created by Seth MacFarlane.\nAction: finish[Seth MacFarlane]',
            },
            {"role": "user", "content": "Observation: Episode finished, reward = True"},
        ],
    }
    res = ingest("react", [("gpt.json", json.dumps({"6238": record}))], tokenizer=BYTES)
    steps = res.steps.to_pylist()
    assert [(s["role"], s["turn"]) for s in steps] == [
        ("user", None),
        ("assistant", 1),
        ("tool", 1),
        ("assistant", 2),
        ("tool", 2),
    ]
    assert steps[1]["tool_calls"] == [
        {"id": "react-1", "name": "search", "arguments": '{"query": "Wendy Schaal"}'}
    ]
    assert [s["tool_call_id"] for s in steps] == [None, None, "react-1", None, "react-2"]
    assert res.trajectories["reward"].to_pylist() == [1.0]


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"role": "tool", "content": "x"}, "traj[1]"),
        ({"role": "assistant", "content": 3}, "traj[1].content"),
        ("hi", "traj[1]"),
    ],
)
def test_fireact_chat_bad_message_is_quarantined_naming_it(bad, field):
    rec = {"em": False, "traj": [{"role": "user", "content": "q"}, bad]}
    res = ingest("react", [("f.json", json.dumps({"k": rec}))], tokenizer=BYTES)
    q = res.quarantine.to_pylist()
    assert len(q) == 1 and q[0]["field"] == field and q[0]["reason"].startswith("invalid_value")
    res = ingest("react", [("f.json", json.dumps({"k": {"em": False, "traj": 5}}))], tokenizer=BYTES)
    assert res.quarantine.to_pylist()[0]["field"] == "traj"


def _react(traj):
    res = ingest("react", [("f.json", json.dumps({"q": {"em": False, "traj": traj}}))], tokenizer=BYTES)
    assert res.quarantine.num_rows == 0
    return res.steps.to_pylist()


def test_react_one_observation_per_action():
    # a second Action line with no Observation of its own: the Observation answers the first (executed) one,
    # so its error is pinned on reflect[...], and search[y] gets no Observation
    steps = _react(
        "Q\n### Response:\nThought: a\nAction: reflect[x]\nAction: search[y]\n"
        "Observation: Invalid action: reflect[x]\nThought: b\nAction: finish[z]\nObservation: done\n"
    )
    assert [(s["role"], s["turn"]) for s in steps] == [
        ("user", None),
        ("assistant", 1),
        ("assistant", 2),
        ("tool", 1),  # issue 34: the Observation carries the turn of the action it answers (reflect's)
        ("assistant", 3),
        ("tool", 3),
    ]
    assert steps[1]["tool_calls"][0]["name"] == "reflect" and steps[2]["tool_calls"][0]["id"] == "react-2"
    assert steps[3]["tool_call_id"] == "react-1" and steps[3]["is_error"]  # reflect's error, not search's
    assert steps[5]["tool_call_id"] == "react-3"
    # numbered lines: Observation 2 answers Action 2
    steps = _react(
        "Q\n### Response:\nThought 1: a\nAction 1: search[x]\nAction 2: search[y]\nObservation 2: y found\n"
    )
    assert steps[-1]["tool_call_id"] == "react-2" and steps[1]["tool_calls"][0]["id"] == "react-1"
    # an Observation with no Action before it answers nothing
    steps = _react("Q\n### Response:\nThought: a\nObservation: stray\nThought: b\nAction: search[x]\n")
    assert steps[2]["tool_call_id"] is None and steps[3]["tool_calls"][0]["id"] == "react-2"
    # chat form: the message's first Action is its action; an Observation answers its own turn only
    steps = _react(
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "Thought: a\nAction: search[x]\nAction: search[w]"},
            {"role": "assistant", "content": "Thought: b\nAction: lookup[y]"},
            {"role": "user", "content": "Observation: (Result 1 / 1) y"},
        ]
    )
    assert [s["tool_call_id"] for s in steps] == [None, None, None, "react-2"]
    assert json.loads(steps[1]["tool_calls"][0]["arguments"]) == {"query": "x"}


def test_tau2_harness_greeting_is_context_without_a_turn(real_data):
    path = _path(real_data, TAU2)
    raw = json.loads(path.read_text())["simulations"]
    res = ingest("tau2-bench", [(str(path), path.read_text())], tokenizer=BYTES)
    assert res.quarantine.num_rows == 0
    by = _by_traj(res)
    for sim in raw:
        rows = by[sim["id"]]
        first = rows[1]  # after the system prompt (the run's policy)
        assert (rows[0]["role"], first["role"], first["turn"], first["content"]) == (
            "system",
            "assistant_context",
            None,
            "Hi! How can I help you today?",
        )
        # turn 1 is the agent's first generated message; one turn per generated assistant message
        generated = [m for m in sim["messages"] if m["role"] == "assistant" and m["usage"] is not None]
        asst = [r for r in rows if r["role"] == "assistant"]
        assert [r["turn"] for r in asst] == list(range(1, len(generated) + 1))
        assert asst[0]["content"].startswith((generated[0]["content"] or "")[:20])
    metas = [json.loads(t["meta"]) for t in res.trajectories.to_pylist()]
    assert all(m["harness_messages"] == [{"step_idx": 1, "role": "assistant", "turn_idx": 0}] for m in metas)


def test_tau2_harness_rule_keeps_generated_messages():
    def sim(messages):
        return {"id": "s", "task_id": "1", "trial": 0, "reward_info": {"reward": 1.0}, "messages": messages}

    usage = {"completion_tokens": 3, "prompt_tokens": 9}
    msgs = [
        {"role": "assistant", "content": "Bonjour !", "usage": None, "raw_data": None, "turn_idx": 0},
        {"role": "user", "content": "hi", "usage": usage, "turn_idx": 1},
        {"role": "assistant", "content": "from history", "usage": None, "raw_data": None, "turn_idx": 2},
        {"role": "assistant", "content": "mine", "usage": usage, "turn_idx": 3},
    ]
    text = json.dumps({"simulations": [sim(msgs)]})
    steps = ingest("tau2-bench", [("r.json", text)], tokenizer=BYTES).steps.to_pylist()
    assert [(s["role"], s["turn"]) for s in steps] == [
        ("assistant_context", None),
        ("user", None),
        ("assistant_context", None),
        ("assistant", 1),
    ]
    # a log that records no generation at all: only the opener before the first user message is the harness's
    bare = [{k: v for k, v in m.items() if k not in ("usage", "raw_data")} for m in msgs]
    steps = ingest("tau2-bench", [("r.json", json.dumps({"simulations": [sim(bare)]}))], tokenizer=BYTES)
    assert [(s["role"], s["turn"]) for s in steps.steps.to_pylist()] == [
        ("assistant_context", None),
        ("user", None),
        ("assistant", 1),
        ("assistant", 2),
    ]


def test_cross_policy_groups_get_unique_sample_idx(real_data):
    """Two agents' tau-bench runs of the same 50 tasks, ingested together: each has trials 0-3 of every task."""
    path = _path(real_data, TAU)
    text = path.read_text()
    res = ingest("tau-bench", [("agent-a.json", text), ("agent-b.json", text)], tokenizer=BYTES)
    rows = res.trajectories.to_pylist()
    assert len(rows) == 400
    by_group = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r)
    for group in by_group.values():
        assert sorted(r["sample_idx"] for r in group) == list(range(len(group)))
        # the first source keeps its trials; the source's own trial stays in meta
        for r in group:
            if r["traj_id"].startswith("agent-a:"):
                assert r["sample_idx"] == json.loads(r["meta"])["trial"]
    assert Counter(len(g) for g in by_group.values()) == {8: 50}


def test_tau2_greeting_gets_no_credit(real_data):
    """Before: the greeting was the agent's turn 1 and took the trajectory's GRPO advantage (A = R in these
    one-trial groups); now it is context, like the user's messages."""
    import numpy as np

    from pipeline.credit.process import process_batch

    path = _path(real_data, TAU2)
    res = ingest("tau2-bench", [(str(path), path.read_text())], tokenizer=BYTES)
    tables, _ = process_batch(res.trajectories, res.steps, ["grpo"])
    adv = tables["grpo"].to_pylist()
    first = [r for r in adv if r["step_idx"] == 1]  # after the system prompt
    assert len(first) == 50
    assert all(r["role"] == "assistant_context" and not np.any(r["token_adv"]) for r in first)
    # the successful simulations' credit sits on the agent's own first turn
    turn1 = [r for r in adv if r["turn"] == 1 and r["role"] == "assistant"]
    assert sum(1 for r in turn1 if np.any(np.asarray(r["token_adv"]) > 0)) == 9


# ---- properties ------------------------------------------------------------------------------------------
_LINE = st.sampled_from(
    [
        "Thought: think",
        "Action: search[q]",
        "Action: lookup[k]",
        "Action: finish[a]",
        "Action: reflect[x]",
        "Observation: seen",
        "Observation: Invalid action",
        "more text",
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_LINE, min_size=1, max_size=14))
def test_react_text_properties(body):
    from pipeline.ingest.react import split_react

    traj = "Q\n### Response:\n" + "\n".join(body) + "\n"
    steps = split_react(traj)
    # contents are verbatim: they join back to the trajectory
    assert "\n".join(s.content for s in steps) + "\n" == traj
    # one Observation per Action: no call is answered twice, and an answer follows its call
    made, answered = {}, set()
    for i, s in enumerate(steps):
        for c in s.tool_calls or ():
            made[c["id"]] = i
        if s.role == "tool" and s.tool_call_id is not None:
            assert s.tool_call_id not in answered and made[s.tool_call_id] < i
            answered.add(s.tool_call_id)
    # an Observation answers the first Action since the previous Observation
    pending = []
    for s in steps:
        if s.role == "assistant":
            pending += [("Action" in line, s) for line in s.content.split("\n") if line.startswith("Action")]
        elif s.role == "tool":
            if pending:
                first = pending[0][1]
                assert s.tool_call_id == (first.tool_calls[0]["id"] if first.tool_calls else None)
            else:
                assert s.tool_call_id is None
            pending = []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.none() | st.integers(0, 3)), max_size=20))
def test_sample_idx_unique_in_every_group(rows):
    from pipeline.ingest.core import StepDraft, TrajectoryDraft, _assign_sample_idx

    drafts = [
        TrajectoryDraft(f"t{i}", g, 0.0, [StepDraft("user", "x")], sample_idx=idx)
        for i, (g, idx) in enumerate(rows)
    ]
    _assign_sample_idx(drafts)
    for g in "abc":
        got = [d.sample_idx for d in drafts if d.group_id == g]
        assert len(set(got)) == len(got) and all(x is not None and x >= 0 for x in got)
    # a given index is kept where it is the first of its group
    seen = set()
    for d, (g, idx) in zip(drafts, rows, strict=True):
        if idx is not None and (g, idx) not in seen:
            assert d.sample_idx == idx
        if idx is not None:
            seen.add((g, idx))
