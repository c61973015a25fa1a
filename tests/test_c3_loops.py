"""Issue 34: loops that mean waste. A repeat is a query loop only when nothing it depends on changed in between
(no state-changing call since the latest identical one, and the same result); ReAct turns run only their
first Action line; near repetition covers every tool's free text. Hand-built trajectories and an independent
simulated environment (hypothesis)."""

from __future__ import annotations

import json

import polars as pl
from c3_build import batch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.detect import DetectSettings, detect_spans
from pipeline.detect.builtin import changes_state
from pipeline.render import render_assistant


def spans_of(trajs, **kw) -> pl.DataFrame:
    t, s = batch(trajs)
    table, _ = detect_spans(t, s, DetectSettings(**kw))
    return pl.from_arrow(table)


def tool_run(events, traj_id="t0"):
    """events: ("agent", name, args, result[, is_error]) | ("user", name, result[, is_error]) (a user
    simulator's own call and its result, steps the agent never saw) | ("say", text) (a user message)."""
    steps = [{"role": "user", "content": "hi"}]
    for n, ev in enumerate(events):
        if ev[0] == "agent":
            call = {"id": f"c{n}", "name": ev[1], "arguments": json.dumps(ev[2])}
            content, _ = render_assistant("", [call])
            steps.append({"role": "assistant", "content": content, "tool_calls": [call]})
            err = len(ev) > 4 and ev[4]
            steps.append({"role": "tool", "content": ev[3], "tool_call_id": f"c{n}", "is_error": err})
        elif ev[0] == "user":
            call = {"id": f"u{n}", "name": ev[1], "arguments": "{}"}
            steps.append({"role": "user_tool", "content": "", "tool_calls": [call]})
            err = len(ev) > 3 and ev[3]
            steps.append({"role": "user_tool", "content": ev[2], "tool_call_id": f"u{n}", "is_error": err})
        else:
            steps.append({"role": "user", "content": ev[1]})
    return {"traj_id": traj_id, "action_format": "openai_tools", "steps": steps}


def loops(df: pl.DataFrame) -> list[tuple[int, str]]:
    return sorted(df.filter(pl.col("behavior") != "invalid_action").select("turn", "behavior").rows())


def test_changes_state_by_name_and_settings():
    s = DetectSettings()
    assert [changes_state(n, s) for n in ("get_bills", "check_status_bar", "canSendMms", "think")] == [
        False
    ] * 4
    assert [changes_state(n, s) for n in ("make_payment", "toggle_data", "transfer_to_human_agents")] == [
        True
    ] * 3
    assert changes_state("run_speed_test", s)  # not a read verb: assumed to change state
    assert not changes_state("run_speed_test", DetectSettings(read_only_tools=["run_speed_test"]))
    assert changes_state("get_and_reset", DetectSettings(state_changing_tools=["get_and_reset"]))


def test_recheck_after_a_change_is_not_a_loop():
    bills = ("agent", "get_bills", {"id": "C1"}, '{"due": 50}')
    df = spans_of(
        [
            tool_run(
                [
                    bills,
                    ("agent", "make_payment", {"id": "C1", "amount": 50}, "paid"),
                    ("agent", "get_bills", {"id": "C1"}, '{"due": 0}'),  # checks the payment: not a loop
                    ("agent", "get_bills", {"id": "C1"}, '{"due": 0}'),  # nothing changed since: a loop
                ]
            )
        ]
    )
    assert loops(df) == [(4, "query_loop")]
    row = df.row(0, named=True)
    assert json.loads(row["evidence"])["earlier_turn"] == 3  # the latest identical call
    assert "nothing changed in between" in row["reason"] and "turn 3" in row["reason"]
    # the rule before issue 34 flagged both
    assert loops(spans_of([tool_run([bills, bills[:3] + ("x",)])], loop_needs_no_change=False)) == [
        (2, "query_loop")
    ]


def test_user_simulator_actions_and_results_decide_too():
    status = ("agent", "check_data", {}, "data off")
    df = spans_of(
        [
            tool_run(
                [
                    status,
                    ("user", "toggle_data", "Mobile Data is now ON"),  # the user changed the device
                    ("agent", "check_data", {}, "data on"),  # not a loop
                    ("user", "check_status_bar", "5G"),  # the user only looked: no change
                    ("say", "anything else?"),  # a message changes nothing
                    ("agent", "check_data", {}, "data on"),  # a loop
                    ("agent", "check_data", {}, "data flaky"),  # another result: something changed
                    ("user", "toggle_wifi", "Error: no wifi hardware", True),  # the user's change failed
                    ("agent", "check_data", {}, "data flaky"),  # a loop
                ]
            )
        ]
    )
    assert loops(df) == [(3, "query_loop"), (5, "query_loop")]


def test_a_change_counts_only_for_calls_it_touches():
    """A state-changing call matters to a repeat when they share an argument value, or the repeat has no
    arguments (it reads device-wide state)."""
    search = (
        "agent",
        "search_direct_flight",
        {"origin": "JFK", "destination": "ATL", "date": "05-24"},
        "[HAT057]",
    )
    bills = ("agent", "get_bills", {"customer": "C1"}, "due 50")
    run = [
        search,
        bills,
        ("agent", "cancel_reservation", {"reservation_id": "S61CZX"}, "cancelled"),  # touches neither
        search,  # a loop: the same flights, and the cancellation is about something else
        ("agent", "make_payment", {"customer": "C1", "amount": 50}, "Error: card declined", True),
        bills,  # a loop: the payment failed, nothing changed
        ("agent", "make_payment", {"customer": "C1", "amount": 50}, "paid"),
        bills,  # the payment went through: checking the bill is not a loop, whatever it shows
    ]
    assert loops(spans_of([tool_run(run)])) == [(4, "query_loop"), (6, "query_loop")]
    # a change without arguments (the phone's airplane mode) touches device-wide reads only, not a named record
    line = ("agent", "get_details_by_id", {"id": "L1002"}, '{"status": "Active"}')
    status = ("agent", "check_status_bar", {}, "Airplane Mode")
    run = [line, status, ("user", "toggle_airplane_mode", "Airplane Mode is now OFF"), line, status]
    assert loops(spans_of([tool_run(run)])) == [(3, "query_loop")]


def test_a_failed_write_changes_nothing():
    get = ("agent", "get_line", {"id": "L1"}, "suspended")
    df = spans_of([tool_run([get, ("agent", "resume_line", {"id": "L1"}, "Error: not allowed", True), get])])
    assert loops(df) == [(3, "query_loop")]
    # the same write twice with the same result and nothing in between is a loop; a toggle back is not
    toggle = [
        ("agent", "toggle_roaming", {}, "Roaming is now ON"),
        ("agent", "toggle_roaming", {}, "Roaming is now OFF"),
        ("agent", "set_plan", {"plan": "p1"}, "ok"),
        ("agent", "set_plan", {"plan": "p1"}, "ok"),
    ]
    assert loops(spans_of([tool_run(toggle)])) == [(4, "query_loop")]


def test_reworded_repeats_of_any_free_text_tool():
    summaries = [
        "The user wants to cancel reservation ABC123 but basic economy cannot be cancelled",
        "User insists on cancelling basic economy reservation ABC123 which policy does not allow",
        "Customer wants reservation ABC123 cancelled; basic economy is not cancellable under policy",
        "The user wants to cancel reservation ABC123 but basic economy cannot be cancelled!",
        "User needs help with reservation XYZ999 baggage",  # other identifiers: another matter
    ]
    run = [("agent", "transfer_to_human_agents", {"summary": s}, "Transfer successful") for s in summaries]
    df = spans_of([tool_run(run)])
    got = sorted(df.select("turn", "behavior", "rule").rows())
    assert got == [
        (2, "near_repetition", "text.same_result"),
        (3, "near_repetition", "text.same_result"),
        (4, "near_repetition", "text.char_jaccard"),  # turn 1's text (the transfers between share no value)
    ]
    assert all("nothing changed in between" in r for r in df["reason"].to_list())
    # Table 5's rule on the free text alone: Jaccard >= 0.9 is a near repetition whatever the result
    df = spans_of([tool_run([run[0], (*run[3][:3], "queued")])])
    assert df.select("turn", "rule").rows() == [(2, "text.char_jaccard")]
    assert "Jaccard 1.00" in df["reason"][0]
    # a different result: the rewording changed what the tool did; only the near-identical text still counts
    run2 = [
        ("agent", "transfer_to_human_agents", {"summary": summaries[0]}, "queued"),
        ("agent", "transfer_to_human_agents", {"summary": summaries[1]}, "Transfer successful"),
    ]
    assert spans_of([tool_run(run2)]).height == 0
    # an empty result (a `think` tool) shows nothing: only Table 5's Jaccard rule applies to its free text
    thoughts = [("agent", "think", {"thought": t}, "") for t in summaries[:3]]
    assert spans_of([tool_run(thoughts)]).height == 0
    # other structured arguments: never a repeat of the free text
    notes = [
        (
            "agent",
            "add_note",
            {"id": "R1", "text": "customer asked about the refund status again today"},
            "ok",
        ),
        (
            "agent",
            "add_note",
            {"id": "R2", "text": "customer asked about the refund status again today"},
            "ok",
        ),
    ]
    assert spans_of([tool_run(notes)]).height == 0


def react_chat(*assistant, observations=None):
    steps = [{"role": "user", "content": "Question: q"}]
    for k, text in enumerate(assistant):
        calls = []
        first = next((x for x in text.split("\n") if x.startswith("Action")), None)
        if first and "search[" in first:
            arg = first.split("search[", 1)[1].rstrip("]")
            calls = [{"id": f"react-{k + 1}", "name": "search", "arguments": json.dumps({"query": arg})}]
        steps.append({"role": "assistant", "content": text, "tool_calls": calls})
        obs = observations[k] if observations else f"Observation: page {k}"
        steps.append({"role": "tool", "content": obs, "tool_call_id": calls[0]["id"] if calls else None})
    return {"traj_id": "r0", "action_format": "react", "steps": steps}


def test_react_runs_only_the_first_action_line():
    first = (
        "Thought: try\nAction: search[bronx journal]\n"
        "Thought: again\nAction: search[bronx journal history]\n"
        "Thought: more\nAction: search[bronx journal timeline]"
    )
    df = spans_of([react_chat(first, "Thought: now\nAction: search[bronx journal history]")])
    rows = df.select("turn", "rule").rows()
    # turn 2's search of a query that turn 1 only wrote (never ran) is not a loop
    assert rows == [(1, "react.unexecuted_actions")]
    row = df.row(0, named=True)
    assert first[row["char_start"] : row["char_end"]] == (
        "Action: search[bronx journal history]\nThought: more\nAction: search[bronx journal timeline]"
    )
    assert row["behavior"] == "invalid_action" and "only the first" in row["reason"]
    assert json.loads(row["evidence"]) == ["search[bronx journal history]", "search[bronx journal timeline]"]
    # the executed first line still counts: repeating it with the same page is a loop
    df = spans_of(
        [
            react_chat(
                "Thought: a\nAction: search[X]",
                "Thought: b\nAction: search[x]",
                observations=["Observation 1: page X", "Observation 2: page X"],
            )
        ]
    )
    assert df.select("turn", "rule").rows() == [(2, "query.exact")]
    # another page for the same lookup (it depends on the page searched last): not a loop
    df = spans_of(
        [
            react_chat(
                "Thought: a\nAction: lookup[born]",
                "Thought: b\nAction: lookup[born]",
                observations=[
                    "Observation 1: (Result 1/1) born 1900",
                    "Observation 2: (Result 1/1) born 1950",
                ],
            )
        ]
    )
    assert df.height == 0


# ---- an independent simulated environment -------------------------------------------------------------
op = st.tuples(st.sampled_from(["get", "set", "user_set", "say"]), st.sampled_from(["a", "b"]))


@settings(max_examples=120, deadline=None)
@given(st.lists(op, min_size=1, max_size=10))
def test_loop_iff_same_call_and_nothing_changed(ops):
    """get_k returns the state of k, set_k bumps it; a user's set bumps it too. Oracle: a call is a loop when an
    identical earlier agent call exists, no successful state change happened since the latest one, and both
    returned the same result."""
    state = {"a": 0, "b": 0}
    events, expected, last, version, turn = [], [], {}, 0, 0
    for kind, key in ops:
        if kind == "say":
            events.append(("say", "ok"))
            continue
        if kind == "user_set":
            state[key] += 1
            version += 1
            events.append(("user", f"set_{key}", f"{key} is {state[key]}"))
            continue
        turn += 1
        if kind == "get":
            name, result = f"get_{key}", f"{key} is {state[key]}"
        else:
            state[key] += 1
            name, result = f"set_{key}", "done"
        call = (name, "{}")
        prev = last.get(call)
        if prev is not None and prev[0] == version and prev[1] == result:
            expected.append((turn, "query_loop"))
        if kind == "set":
            version += 1
        last[call] = (version, result)
        events.append(("agent", name, {}, result))
    assert loops(spans_of([tool_run(events)])) == expected


def _re_ask(
    second_obs: str, next_turn: str, first_obs: str = "Observation: Talking about the appeal of bluegrass"
):
    """A ReAct run re-asking turn 1's query reworded (char Jaccard >= 0.9), then `next_turn`."""
    return react_chat(
        "Thought: find the singer.\nAction: search[bluegrass singer on the album true]",
        "Thought: not given, search again.\nAction: search[bluegrass singer on album true]",
        next_turn,
        observations=[first_obs, second_obs, "Observation: done"],
    )


def test_near_repetition_needs_nothing_learned():
    # the re-ask returned another passage the agent did not take up: it learned nothing, a near repetition
    off_point = _re_ask(
        "Observation: First comes Shame On Me, funky bass riffs",
        "Thought: still not given.\nAction: search[vocalist of avicii album true]",
    )
    df = spans_of([off_point])
    assert df.select("turn", "behavior").rows() == [(2, "near_repetition")]
    assert "it learned nothing" in df["reason"][0]
    # the re-ask returned the answer, which the next turn uses (a word new to the run): not waste
    answered = _re_ask(
        "Observation: Avicii wrote it with the vocalist Dan Tyminski",
        "Thought: the singer is Dan Tyminski.\nAction: finish[Dan Tyminski]",
    )
    assert spans_of([answered]).height == 0
    assert spans_of([answered], near_needs_nothing_new=False).select("turn", "behavior").rows() == [
        (2, "near_repetition")
    ]
    # new words the next turn does not use, or words the run already had (the question, turn 1's result): nothing
    known = _re_ask(
        "Observation: bluegrass appeal, said Avicii",
        "Thought: the appeal of bluegrass again.\nAction: finish[appeal]",
    )
    assert spans_of([known]).height == 1
    # the earlier call returned nothing (an empty page) and this one a passage: it learned something
    empty_first = _re_ask(
        "Observation: Talking about the appeal of bluegrass",
        "Thought: not given.\nAction: search[vocalist of avicii album true]",
        first_obs="",
    )
    assert spans_of([empty_first]).height == 0
    assert spans_of([empty_first], near_needs_nothing_new=False).height == 1


_POOL = ["alder", "birch", "cedar", "dogwood", "elm", "fir", "ginkgo", "hazel", "juniper", "larch"]


@settings(max_examples=60, deadline=None)
@given(
    first=st.lists(st.sampled_from(_POOL), max_size=5),
    second=st.lists(st.sampled_from(_POOL), min_size=1, max_size=5),
    used=st.lists(st.sampled_from(_POOL), max_size=4),
)
def test_near_repetition_iff_no_new_word_taken_up(first, second, used):
    """Property: the reworded re-ask is a near repetition iff no word of its result that the run had not seen
    (not in turn 1's result, the question or the calls) is in the next turn; with the setting off, always."""
    run = _re_ask(
        "Observation: " + " ".join(second),
        "Thought: " + " ".join(used) + ".\nAction: finish[x]",
        first_obs="Observation: " + " ".join(first) + " page",
    )
    learned = bool((set(second) - set(first)) & set(used))
    assert spans_of([run]).height == (0 if learned else 1)
    assert spans_of([run], near_needs_nothing_new=False).height == 1
