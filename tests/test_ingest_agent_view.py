"""Issue 34: only the agent's tokens are the agent's. tau2's user simulator calls its own tools (a user message
with calls, then their results, routed user -> environment -> user): the agent never saw them, so they are
`user_tool` steps, kept with no turn and no tokens; framework error messages are the harness's, not turns."""

from __future__ import annotations

import json

import polars as pl
import pytest
from test_ingest_chat_template import ChatML

import pipeline.ingest.tau2_bench  # noqa: F401  (registers the adapter)
from pipeline.detect import DetectSettings, detect_spans
from pipeline.ingest.core import ingest
from pipeline.tokenize import ByteTokenizer

TELECOM = "tau2_bench/gpt-4.1_telecom_default_1trial.json"


def _sim(messages, sim_id="s1"):
    return {"id": sim_id, "task_id": "7", "trial": 0, "reward_info": {"reward": 1.0}, "messages": messages}


def _ingest(sims, tokenizer=None):
    text = json.dumps({"info": {}, "tasks": [{"id": "7"}], "simulations": sims})
    return ingest("tau2-bench", [("r.json", text)], tokenizer=tokenizer or ByteTokenizer())


USAGE = {"prompt_tokens": 1, "completion_tokens": 1}
USER_TOOL = [
    {
        "role": "user",
        "content": "",
        "tool_calls": [{"id": "u1", "name": "check_status_bar", "arguments": {}, "requestor": "user"}],
    },
    {"role": "tool", "id": "u1", "content": "SECRET STATUS BAR", "requestor": "user", "error": False},
]


@pytest.fixture(scope="module")
def telecom(real_data):
    path = real_data / TELECOM
    if not path.exists():
        pytest.skip(f"{TELECOM} not shipped")
    raw = json.loads(path.read_text())
    res = ingest("tau2-bench", [(path.name, path.read_text())], tokenizer=ByteTokenizer())
    return raw, res


def test_telecom_user_simulator_steps_are_kept_without_turn_or_tokens(telecom):
    raw, res = telecom
    assert res.quarantine.num_rows == 0 and res.trajectories.num_rows == len(raw["simulations"]) == 40
    # counted from the raw JSON: user messages whose calls the user requested, and tool results for the user
    unseen = sum(
        (m["role"] == "user" and bool(m.get("tool_calls")))
        or (m["role"] == "tool" and m.get("requestor") == "user")
        for s in raw["simulations"]
        for m in s["messages"]
    )
    generated = sum(
        m["role"] == "assistant" and m.get("usage") is not None
        for s in raw["simulations"]
        for m in s["messages"]
    )
    steps = pl.from_arrow(
        res.steps.select(["traj_id", "step_idx", "role", "turn", "token_ids", "tool_call_id"])
    )
    hidden = steps.filter(pl.col("role") == "user_tool")
    assert hidden.height == unseen == 915
    assert hidden["turn"].null_count() == unseen and hidden["token_ids"].list.len().sum() == 0
    assert steps.filter(pl.col("role") == "assistant").height == generated == 620
    # every result the user got is a user_tool step linked to the user's call
    results = sum(
        m["role"] == "tool" and m.get("requestor") == "user"
        for s in raw["simulations"]
        for m in s["messages"]
    )
    assert hidden.filter(pl.col("tool_call_id").is_not_null()).height == results == 482
    metas = [json.loads(m) for m in res.trajectories.column("meta").to_pylist()]
    assert sum(m["unseen_steps"] for m in metas) == unseen


def test_solo_telecom_rechecks_after_a_fix_are_not_loops(real_data):
    """tau2 telecom without a user (the agent runs the device tools itself): of its 16 exact repeats, 12 are
    re-checks after a toggle or a refuel; the 4 left are run_speed_test again after only check_status_bar,
    with the same "No Connection" result."""
    path = real_data / SOLO
    if not path.exists():
        pytest.skip(f"{SOLO} not shipped")
    res = ingest("tau2-bench", [(path.name, path.read_text())], tokenizer=ByteTokenizer())
    now = pl.from_arrow(detect_spans(res.trajectories, res.steps)[0])
    before = pl.from_arrow(
        detect_spans(res.trajectories, res.steps, DetectSettings(loop_needs_no_change=False))[0]
    )
    assert before.filter(pl.col("behavior") == "query_loop").height == 16
    loops = now.filter(pl.col("behavior") == "query_loop")
    assert loops.height == 4
    assert {json.loads(e)["query"] for e in loops["evidence"]} == {"run_speed_test {}"}
    steps = pl.from_arrow(res.steps.select(["traj_id", "step_idx", "role", "content", "tool_calls"]))
    for row in loops.iter_rows(named=True):
        t = steps.filter(pl.col("traj_id") == row["traj_id"])
        calls = [
            (r["step_idx"], c["name"])
            for r in t.iter_rows(named=True)
            if r["role"] == "assistant"
            for c in r["tool_calls"] or []
        ]
        k = [i for i, (idx, _) in enumerate(calls) if idx == row["step_idx"]][0]
        prev = max(i for i in range(k) if calls[i][1] == "run_speed_test")
        assert [n for _, n in calls[prev + 1 : k]] == ["check_status_bar"]  # only looked in between


SOLO = "tau2_bench/gpt-4.1_telecom_no-user_4trials_5tasks.json"


def test_unseen_steps_are_not_rendered_for_the_agent():
    sim = _sim(
        [
            {"role": "assistant", "content": "Hi! How can I help you today?"},
            {"role": "user", "content": "my data is slow"},
            *USER_TOOL,
            {"role": "user", "content": "it shows 2G"},
            {"role": "assistant", "content": "Let me check.", "usage": USAGE},
        ]
    )
    res = _ingest([sim], ChatML())
    steps = pl.from_arrow(res.steps)
    rendered = bytes(i for ids in steps["token_ids"] for i in ids).decode()
    assert "SECRET STATUS BAR" not in rendered and "check_status_bar" not in rendered
    assert (
        rendered + "\n"
        == ChatML().apply_chat_template(  # the newline after the last end-of-turn: unsampled
            [
                {"role": "assistant", "content": "Hi! How can I help you today?"},
                {"role": "user", "content": "my data is slow"},
                {"role": "user", "content": "it shows 2G"},
                {"role": "assistant", "content": "Let me check."},
            ]
        )
    )
    assert steps["role"].to_list() == [
        "assistant_context",
        "user",
        "user_tool",
        "user_tool",
        "user",
        "assistant",
    ]
    assert steps.filter(pl.col("role") == "user_tool")["token_ids"].to_list() == [[], []]
    assert json.loads(res.trajectories.column("meta")[0].as_py())["tokenization"].startswith("chat template")


@pytest.mark.parametrize(
    "text",
    [
        "Recursion limit of 25 reached without hitting a stop condition. You can increase the limit by setting "
        "the `recursion_limit` config key.",
        "GraphRecursionError: Recursion limit of 50 reached",
        "Traceback (most recent call last):\n  File ...",
    ],
)
def test_framework_error_messages_are_harness_messages(text):
    # a file that records no usage at all: only the opener and the framework's message are the harness's
    sim = _sim(
        [
            {"role": "assistant", "content": "Hi! How can I help you today?"},
            {"role": "user", "content": "change my flight"},
            {"role": "assistant", "content": "Sure, which one?"},
            {"role": "user", "content": "HAT001"},
            {"role": "assistant", "content": text},
        ]
    )
    res = _ingest([sim])
    steps = pl.from_arrow(res.steps)
    # the opener is the agent's context (its assistant turn, not generated here); the framework's message is
    # no turn of the agent's at all
    assert steps["role"].to_list() == ["assistant_context", "user", "assistant", "user", "system"]
    assert steps["turn"].to_list()[2] == 1 and steps.filter(pl.col("role") == "assistant").height == 1
    meta = json.loads(res.trajectories.column("meta")[0].as_py())
    assert [h["step_idx"] for h in meta["harness_messages"]] == [0, 4]
    assert meta["harness_messages"][1]["framework_error"] is True


def test_an_agent_that_writes_about_recursion_is_still_the_agent():
    said = "Recursion limit of 25 reached, so I will stop here."
    sim = _sim(
        [
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "The answer. " + said},  # not a message the framework wrote
        ]
    )
    steps = pl.from_arrow(_ingest([sim]).steps)  # no usage recorded anywhere
    assert steps["role"].to_list() == ["assistant_context", "user", "assistant"]
    sim["messages"][2] = {"role": "assistant", "content": said, "usage": USAGE}  # a generation: the agent's
    steps = pl.from_arrow(_ingest([sim]).steps)
    assert steps["role"].to_list() == ["assistant_context", "user", "assistant"]


def test_solo_runs_open_with_the_agents_system_prompt(real_data):
    """A solo (no-user) run starts with the agent's own message, which no template can cut (no step before it
    holds the generation prompt): it was tokenized plain. Its agent was told the policy and the ticket: they
    are a system step now, and the run renders through the chat template."""
    path = real_data / SOLO
    if not path.exists():
        pytest.skip(f"{SOLO} not shipped")
    raw = json.loads(path.read_text())
    res = ingest("tau2-bench", [(path.name, path.read_text())], tokenizer=ChatML())
    assert res.quarantine.num_rows == 0
    steps = pl.from_arrow(res.steps.select(["traj_id", "step_idx", "role", "turn", "content"]))
    first = steps.filter(pl.col("step_idx") == 0)
    assert set(first["role"]) == {"system"} and first["turn"].null_count() == first.height == 20
    tasks = {t["id"]: t for t in raw["tasks"]}
    sim = raw["simulations"][0]
    prompt = first.filter(pl.col("traj_id") == sim["id"])["content"][0]
    policy = raw["info"]["environment_info"]["policy"].strip()
    assert (
        prompt
        == f"<policy>\n{policy}\n</policy>\n<ticket>\n{tasks[sim['task_id']]['ticket'].strip()}\n</ticket>"
    )
    # the agent's messages keep their turns: the first is turn 1, right after the prompt
    second = steps.filter(pl.col("step_idx") == 1)
    assert set(second["role"]) == {"assistant"} and set(second["turn"]) == {1}
    made = {json.loads(m)["tokenization"] for m in res.trajectories.column("meta").to_pylist()}
    assert all(m.startswith("chat template chatml") for m in made), made


def _run_file(sims, policy="P", tasks=({"id": "7", "ticket": "T"},), tokenizer=None):
    info = {"environment_info": {"policy": policy}} if policy is not None else {}
    text = json.dumps({"info": info, "tasks": list(tasks), "simulations": sims})
    return ingest("tau2-bench", [("r.json", text)], tokenizer=tokenizer or ByteTokenizer())


def test_runs_with_a_user_open_with_the_policy_and_the_greeting_is_the_agents_turn_of_context():
    """The agent's context in a run with a user: its system prompt (the policy the run records), then the
    orchestrator's greeting as the agent's own assistant turn (tau2 puts it in the agent's state as its
    message), then the user. The greeting is rendered as an assistant turn but is context: no turn, no loss,
    no credit."""
    from pipeline.credit.process import process_batch
    from pipeline.export import build_train_batch

    greeting = "Hi! How can I help you today?"
    sim = _sim(
        [
            {"role": "assistant", "content": greeting},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Sure.", "usage": USAGE},
        ]
    )
    res = _run_file([sim], tokenizer=ChatML())
    steps = pl.from_arrow(res.steps)
    assert steps["role"].to_list() == ["system", "assistant_context", "user", "assistant"]
    assert steps["content"].to_list() == ["<policy>\nP\n</policy>", greeting, "hello", "Sure."]
    assert steps["turn"].to_list() == [None, None, None, 1]
    meta = json.loads(res.trajectories.column("meta")[0].as_py())
    assert (
        meta["system_prompt"] == "rendered from the policy" and meta["tokenization"] == "chat template chatml"
    )
    assert meta["harness_messages"] == [{"step_idx": 1, "role": "assistant", "turn_idx": None}]
    text = [bytes(ids).decode() for ids in steps["token_ids"]]
    expected = ChatML().apply_chat_template(
        [
            {"role": "system", "content": "<policy>\nP\n</policy>"},
            {"role": "assistant", "content": greeting},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Sure."},
        ]
    )
    assert "".join(text) + "\n" == expected  # the newline after the agent's last end-of-turn: unsampled
    # the header before the greeting is the generation prompt, held by the step before it (as before any
    # assistant turn); the greeting's end-of-turn and what follows are its own (nothing of it was sampled)
    assert text[0].endswith("</policy><|im_end|>\n<|im_start|>assistant\n")
    assert text[1] == greeting + "<|im_end|>\n"
    assert text[3] == "Sure.<|im_end|>"
    adv = process_batch(res.trajectories, res.steps, ["grpo"])[0]["grpo"]
    batch = build_train_batch(res.trajectories, res.steps, adv).to_pylist()[0]
    n0, n1 = len(steps["token_ids"][0]), len(steps["token_ids"][1])
    mask, tok_adv = batch["loss_mask"], batch["advantages"]
    assert set(mask[n0 : n0 + n1]) == {0} and set(tok_adv[n0 : n0 + n1]) == {0.0}
    assert sum(mask) == len(steps["token_ids"][3]) and all(mask[-len(steps["token_ids"][3]) :])


def test_a_greeting_renders_as_an_assistant_turn_even_with_no_system_prompt_before_it():
    """A run that records no policy opens with the greeting: it holds its own header (all context), and the
    conversation still renders through the template; an agent's own turn cannot open one (nothing before it
    holds the generation prompt)."""
    sim = _sim(
        [
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Sure.", "usage": USAGE},
        ]
    )
    res = _run_file([sim], policy=None, tokenizer=ChatML())
    steps = pl.from_arrow(res.steps)
    assert steps["role"].to_list() == ["assistant_context", "user", "assistant"]
    assert bytes(steps["token_ids"][0]).decode() == "<|im_start|>assistant\nHi!<|im_end|>\n"
    meta = json.loads(res.trajectories.column("meta")[0].as_py())
    assert meta["tokenization"] == "chat template chatml" and meta["system_prompt"] is None
    # earlier history in a task's initial state: assistant messages of context too, and a greeting right
    # before the agent's own turn (no user in between) is no reason to fall back to plain tokens
    sim = _sim(
        [
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "from history"},
            {"role": "assistant", "content": "Sure.", "usage": USAGE},
        ]
    )
    res = _run_file([sim], tokenizer=ChatML())
    steps = pl.from_arrow(res.steps)
    assert steps["role"].to_list() == [
        "system",
        "assistant_context",
        "user",
        "assistant_context",
        "assistant",
    ]
    text = [bytes(ids).decode() for ids in steps["token_ids"]]
    assert text[3] == "from history<|im_end|>\n<|im_start|>assistant\n" and text[4] == "Sure.<|im_end|>"


def test_solo_runs_get_the_ticket_too():
    sim = _sim([{"role": "assistant", "content": "Sure.", "usage": USAGE}])  # no user message: solo
    res = _run_file([sim])
    assert res.steps.column("role").to_pylist() == ["system", "assistant"]
    assert res.steps.column("content")[0].as_py() == "<policy>\nP\n</policy>\n<ticket>\nT\n</ticket>"
    meta = json.loads(res.trajectories.column("meta")[0].as_py())
    assert meta["system_prompt"] == "rendered from the policy and the ticket"
    # a solo agent that talks to nobody but whose run holds no ticket: the policy alone
    res = _run_file([sim], tasks=({"id": "7"},))
    assert res.steps.column("content")[0].as_py() == "<policy>\nP\n</policy>"


WITH_USER = {
    "tau2_bench/qwen2.5-7b_airline_1trial.json": 50,
    "tau2_bench/gpt-4.1_telecom_default_1trial.json": 40,
    "tau2_bench/gpt-4.1-sft_telecom_default_1trial.json.gz": 40,
}


@pytest.mark.parametrize("rel", sorted(WITH_USER))
def test_shipped_runs_with_a_user_render_the_policy_and_the_greeting_as_the_agent_had_them(real_data, rel):
    """Every simulation of the shipped runs with a user: a system step of the run's policy, then the greeting
    as an assistant turn of context, rendered by SmolLM2's own chat template (its `apply_chat_template` of the
    two messages is the start of the trajectory's tokens); the greeting gets no loss and no credit, while
    every successful simulation's credit sits on the agent's own turns."""
    import numpy as np
    from c3_sample import read_source
    from test_ingest_chat_template import _smollm2

    from pipeline.credit.process import process_batch
    from pipeline.export import build_train_batch

    if not (real_data / rel).exists():
        pytest.skip(f"{rel} not shipped")
    tok = _smollm2()
    name, text = read_source(rel, real_data)
    raw = json.loads(text)
    policy = raw["info"]["environment_info"]["policy"].strip()
    res = ingest("tau2-bench", [(name, text)], tokenizer=tok)
    assert res.quarantine.num_rows == 0 and res.trajectories.num_rows == WITH_USER[rel]
    steps = pl.from_arrow(res.steps.select(["traj_id", "step_idx", "role", "turn", "content", "token_ids"]))
    head = steps.filter(pl.col("step_idx") < 2).sort(["traj_id", "step_idx"])
    assert head["role"].to_list() == ["system", "assistant_context"] * WITH_USER[rel]
    assert set(head["content"].to_list()[0::2]) == {f"<policy>\n{policy}\n</policy>"}
    greetings = {m["content"] for s in raw["simulations"] for m in s["messages"][:1]}
    assert set(head["content"].to_list()[1::2]) == greetings == {"Hi! How can I help you today?"}
    assert head["turn"].null_count() == head.height
    want = tok._hf.apply_chat_template(
        [
            {"role": "system", "content": f"<policy>\n{policy}\n</policy>"},
            {"role": "assistant", "content": "Hi! How can I help you today?"},
        ],
        tokenize=False,
    )
    metas = [json.loads(m) for m in res.trajectories.column("meta").to_pylist()]
    assert all(m["tokenization"].startswith("chat template smollm2") for m in metas)
    assert {m["system_prompt"] for m in metas} == {"rendered from the policy"}
    ids = head["token_ids"].to_list()
    for k in range(0, len(ids), 2):
        assert tok._tok.decode(ids[k] + ids[k + 1], skip_special_tokens=False) == want
        assert (
            tok._tok.decode(ids[k + 1], skip_special_tokens=False)
            == "Hi! How can I help you today?<|im_end|>\n"
        )
    adv = process_batch(res.trajectories, res.steps, ["grpo"])[0]["grpo"]
    batch = build_train_batch(res.trajectories, res.steps, adv).to_pylist()
    lengths = {
        (t, i): len(x)
        for t, i, x in zip(steps["traj_id"], steps["step_idx"], steps["token_ids"], strict=True)
    }
    positive = 0
    for row in batch:
        n = lengths[(row["traj_id"], 0)] + lengths[(row["traj_id"], 1)]
        assert not any(row["loss_mask"][:n]) and not np.any(row["advantages"][:n])
        positive += row["reward"] > 0 and bool(np.any(np.asarray(row["advantages"]) > 0))
    assert positive == sum(s["reward_info"]["reward"] > 0 for s in raw["simulations"]) > 0


def test_the_history_a_counterfactual_is_asked_from_is_what_the_agent_saw():
    """TCPO's counterfactual stage asks an LLM to redo a turn from its history: the user simulator's own calls
    (never seen) are not in it, and the greeting is an assistant message (no `user_tool` or `assistant_context`
    role, which no chat API knows)."""
    from pipeline.counterfactual import history_messages

    sim = _sim(
        [
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "my data is slow"},
            *USER_TOOL,
            {"role": "user", "content": "it shows 2G"},
            {"role": "assistant", "content": "Let me check.", "usage": USAGE},
        ]
    )
    steps = _run_file([sim]).steps.to_pylist()
    assert history_messages(steps[:-1]) == [
        {"role": "system", "content": "<policy>\nP\n</policy>"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "my data is slow"},
        {"role": "user", "content": "it shows 2G"},
    ]
