"""C3 detectors (spec 5, Table 5): hand-built trajectories per rule and action format, and the query-rule
properties of spec 7."""

from __future__ import annotations

import json

import polars as pl
import pytest
from c3_build import batch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import Config
from pipeline.detect import (
    DETECTORS,
    DetectSettings,
    Hit,
    detect_spans,
    detector,
    jaccard,
    ngrams,
    normalize_answer,
)
from pipeline.detect.text import content_words, identifiers, normalize_query
from pipeline.render import render_assistant
from pipeline.stages import stages_for


def spans_of(trajs, **kw) -> pl.DataFrame:
    t, s = batch(trajs)
    table, _ = detect_spans(t, s, DetectSettings(**kw))
    return pl.from_arrow(table)


def sr1(*turns, **traj):
    steps = []
    for text in turns:
        steps.append({"role": "assistant", "content": text})
        steps.append({"role": "user", "content": "<information> docs </information>"})
    return {"traj_id": traj.get("traj_id", "t0"), "action_format": "search_r1", "steps": steps}


# ---- Search-R1 -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,rule",
    [
        ("<think> hmm </think> I will look it up", "search_r1.no_action"),
        ("<think> x </think> <search> unclosed query", "search_r1.no_action"),
        ("<search> a b </search> <answer> c </answer>", "search_r1.both_tags"),
        ("<search> first query </search> <search> second query </search>", "search_r1.multiple"),
        ("<answer> one </answer> <answer> two </answer>", "search_r1.multiple"),
    ],
)
def test_search_r1_invalid(text, rule):
    df = spans_of([sr1(text)])
    assert df["rule"].to_list() == [rule]
    assert df["behavior"][0] == "invalid_action" and df["severity"][0] == 1.0


def test_search_r1_valid_and_span_is_the_tagged_action():
    text = "<think> need the capital </think> <search> capital of France </search>"
    assert spans_of([sr1(text)]).height == 0
    df = spans_of([sr1(text, text)])
    assert df["rule"].to_list() == ["query.exact"]
    row = df.row(0, named=True)
    assert text[row["char_start"] : row["char_end"]] == "<search> capital of France </search>"
    # word tokens: "<search>" is token 5 of the turn (after <think> need the capital </think>)
    assert (row["token_start"], row["token_end"]) == (5, 10)
    assert row["turn"] == 2 and row["step_idx"] == 2


def test_no_action_span_is_whole_turn_without_think():
    text = "<think> pondering </think> rambling on"
    row = spans_of([sr1(text)]).row(0, named=True)
    assert text[row["char_start"] : row["char_end"]] == "rambling on"
    row = spans_of([sr1(text)], exclude_think=False).row(0, named=True)
    assert (row["char_start"], row["char_end"]) == (0, len(text))


def test_search_inside_think_is_not_an_action():
    text = "<think> maybe <search> x </search> </think> <answer> Paris </answer>"
    assert spans_of([sr1(text)]).height == 0
    assert spans_of([sr1(text)], exclude_think=False)["rule"].to_list() == ["search_r1.both_tags"]


def test_span_mode_turn():
    text = "<think> a </think> <search> capital of France </search>"
    row = spans_of([sr1(text, text)], span_mode="turn").row(0, named=True)
    # the whole turn minus the leading <think> block
    assert (row["char_start"], row["char_end"]) == (text.index("<search>"), len(text))
    assert (row["token_start"], row["token_end"]) == (3, 8)


# ---- query rules ---------------------------------------------------------------------------------
def test_exact_loop_uses_search_r1_normalisation():
    df = spans_of([sr1("<search> The Eiffel Tower! </search>", "<search>eiffel   tower</search>")])
    assert df["behavior"].to_list() == ["query_loop"] and df["severity"].to_list() == [1.0]
    assert json.loads(df["evidence"][0]) == {"query": "eiffel tower", "earlier_turn": 1}


def test_near_repetition_char_trigrams():
    a, b = "who directed the film jaws in 1975", "who was director of the film jaws in 1975"
    a, b = "nancy soderberg senate seat", "nancy soderberg senate seats"
    assert jaccard(ngrams(normalize_answer(a)), ngrams(normalize_answer(b))) >= 0.9
    df = spans_of([sr1(f"<search>{a}</search>", f"<search>{b}</search>")])
    assert df["behavior"].to_list() == ["near_repetition"] and df["severity"].to_list() == [0.5]
    assert df["rule"][0] == "query.char_jaccard"
    # word trigrams: 0.9 is out of reach for a one-word change in 4 words
    assert spans_of([sr1(f"<search>{a}</search>", f"<search>{b}</search>")], ngram_unit="word").height == 0


@pytest.mark.parametrize(
    "a,b",
    [
        ("who directed the film jaws in 1975", "who directed the film jaws in 1976"),  # numbers differ
        (
            "socialist conference during first world war 1915",
            "socialist conference during first world war 1916",
        ),
        (
            "list every direct flight leaving JFK airport for SEA on the twentieth of may 2024",
            "list every direct flight leaving JFK airport for SFO on the twentieth of may 2024",
        ),  # codes differ
        (
            "please show me the full details of reservation L1001 for this customer",
            "please show me the full details of reservation L1002 for this customer",
        ),
    ],
)
def test_near_repetition_never_matches_other_identifiers_or_numbers(a, b):
    assert jaccard(ngrams(normalize_query(a)), ngrams(normalize_query(b))) >= 0.85
    assert identifiers(a) != identifiers(b)
    assert spans_of([sr1(f"<search>{a}</search>", f"<search>{b}</search>")], jaccard=0.85).height == 0


def test_empty_normalised_query_is_never_a_loop():
    df = spans_of([sr1("<search>!!!</search>", "<search>???</search>", "<search> ... </search>")])
    assert df.height == 0
    df = spans_of([react("Thought: a\nAction: search[!!!]", "Thought: b\nAction: search[???]")])
    assert df.height == 0


def test_nfkc_before_comparing():
    nfc, nfd = "caf\u00e9 in montr\u00e9al", "cafe\u0301 in montre\u0301al"
    assert nfc != nfd
    df = spans_of([sr1(f"<search>{nfc}</search>", f"<search>{nfd}</search>")])
    assert df["behavior"].to_list() == ["query_loop"]
    # compatibility forms: full-width letters and digits are the same query
    df = spans_of(
        [
            sr1(
                "<search>Eiffel Tower 1889</search>",
                "<search>\uff25iffel Tower \uff11\uff18\uff18\uff19</search>",
            )
        ]
    )
    assert df["behavior"].to_list() == ["query_loop"]


def test_same_turn_queries_are_not_loops_and_answers_are_not_queries():
    df = spans_of([sr1("<answer> paris france </answer>", "<search> paris france </search>")])
    assert df.height == 0


query_text = st.text(alphabet="abcdef ", min_size=0, max_size=14)


@settings(max_examples=150, deadline=None)
@given(st.lists(query_text, min_size=1, max_size=6))
def test_query_properties(queries):
    df = spans_of([sr1(*[f"<search>{q}</search>" for q in queries])])
    norm = [normalize_answer(q) for q in queries]
    # the first query is never a loop (nor a near repeat)
    assert 1 not in df["turn"].to_list()
    for k, q in enumerate(norm, start=1):
        rows = df.filter(pl.col("turn") == k)
        earlier = [e for e in norm[: k - 1] if e]
        if not q:  # an empty normalised query is never a loop
            assert rows.height == 0
        elif q in earlier:  # exact beats near
            assert rows["behavior"].to_list() == ["query_loop"]
        elif len(q) < 8:  # < 8 chars: never near
            assert rows.height == 0
        else:  # (no digits or capitals in this alphabet: no identifiers)
            words = content_words(q)  # a query that adds a word refines an earlier one: never near
            best = max(
                (jaccard(ngrams(q), ngrams(e)) for e in earlier if words <= content_words(e)), default=0.0
            )
            assert rows["behavior"].to_list() == (["near_repetition"] if best >= 0.9 else [])


# ---- ReAct ---------------------------------------------------------------------------------------
def react(*turns):
    steps = [{"role": "user", "content": "Question: q"}]
    for text in turns:
        steps.append({"role": "assistant", "content": text})
        steps.append({"role": "tool", "content": "Observation: ..."})
    return {"traj_id": "r0", "action_format": "react", "steps": steps}


def test_react_rules():
    df = spans_of(
        [
            react(
                "Thought: look\nAction: search[Bob Marley]",
                "Thought: again\nAction: search[bob marley]",
                "Thought: hmm\nAction:  reflect[How can I improve?]",
                "Thought: x\nAction: search[what is Bob Marley known for?",
                "Thought: only thinking",
                "Thought: done\nAction: lookup[Bob Marley]",
                "Thought: done\nAction: finish[reggae]",
            )
        ]
    )
    assert df.sort("turn").select("turn", "rule").rows() == [
        (2, "query.exact"),
        (3, "react.unparseable"),
        (4, "react.unparseable"),
        (5, "react.no_action"),
    ]
    row = df.filter(pl.col("turn") == 2).row(0, named=True)
    content = "Thought: again\nAction: search[bob marley]"
    assert content[row["char_start"] : row["char_end"]] == "Action: search[bob marley]"


# ---- WebShop -------------------------------------------------------------------------------------
def webshop(
    *turns,
    obs="Your admissible actions of the current situation are: ['search[<your query>]', 'click[Back to Search]'].",
):
    steps = []
    for text in turns:
        steps.append({"role": "user", "content": obs})
        steps.append({"role": "assistant", "content": text})
    return {"traj_id": "w0", "action_format": "webshop", "steps": steps}


@pytest.mark.parametrize(
    "text,rule",
    [
        ("<action>search[red shoes]</action>", "webshop.malformed"),
        ("<think>a</think><action>search[x]</action><action>click[y]</action>", "webshop.malformed"),
        ("<think>a</think> trailing <action>search[x]</action> more", "webshop.malformed"),
        ("<think>买鞋</think><action>search[red shoes]</action>", "webshop.cjk"),
        ("<think>a</think><action>buy now</action>", "webshop.unparseable"),
        ("<think>a</think><action>click[Buy Now]</action>", "webshop.impermissible"),
    ],
)
def test_webshop_invalid(text, rule):
    df = spans_of([webshop(text)])
    assert df["rule"].to_list() == [rule]


def test_webshop_permissible_and_available_actions_from_meta():
    ok = "<think>go</think>\n<action>click[back to search]</action>"
    assert spans_of([webshop(ok)]).height == 0
    t = webshop(
        "<think>a</think><action>search[red shoes]</action>",
        "<think>b</think><action>click[B07]</action>",
        obs="no list here",
    )
    t["meta"] = {
        "available_actions": [
            {"has_search_bar": False, "clickables": []},
            {"has_search_bar": False, "clickables": ["b07"]},
        ]
    }
    df = spans_of([t])
    assert df.select("turn", "rule").rows() == [(1, "webshop.impermissible")]
    row = df.row(0, named=True)
    text = "<think>a</think><action>search[red shoes]</action>"
    assert text[row["char_start"] : row["char_end"]] == "<action>search[red shoes]</action>"  # tags included


# ---- OpenAI tool calls ---------------------------------------------------------------------------
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_user",
            "parameters": {
                "type": "object",
                "properties": {"user_id": {"type": "string"}},
                "required": ["user_id"],
            },
        },
    }
]


def tool_traj(calls_per_turn, errors=()):
    steps = [{"role": "user", "content": "hi"}]
    n = 0
    for calls in calls_per_turn:
        tc = [{"id": f"c{n + i}", "name": c[0], "arguments": c[1]} for i, c in enumerate(calls)]
        content, _ = render_assistant("", tc)
        steps.append({"role": "assistant", "content": content, "tool_calls": tc})
        for c in tc:
            steps.append(
                {
                    "role": "tool",
                    "content": "Error: boom" if c["id"] in errors else "ok",
                    "tool_call_id": c["id"],
                    "is_error": c["id"] in errors,
                }
            )
        n += len(tc)
    return {"traj_id": "o0", "action_format": "openai_tools", "meta": {"tools": TOOLS}, "steps": steps}


def test_tool_call_rules():
    df = spans_of(
        [
            tool_traj(
                [
                    [("get_user", '{"user_id": "u1"}')],
                    [("get_user", '{ "user_id":"u1" }'), ("delete_all", "{}")],
                    [("get_user", '{"user_id": 7}')],
                    [("get_user", '{"user_id": "u1"')],
                ],
                errors={"c4"},
            )
        ]
    )
    got = sorted(df.select("turn", "rule").rows())
    assert got == [
        (2, "query.exact"),
        (2, "tool.unknown_name"),
        (3, "tool.schema"),
        (4, "tool.error_return"),
        (4, "tool.invalid_json"),
    ]
    steps = batch(
        [
            tool_traj(
                [
                    [("get_user", '{"user_id": "u1"}')],
                    [("get_user", '{ "user_id":"u1" }'), ("delete_all", "{}")],
                ]
            )
        ]
    )[1]
    content = steps.column("content")[3].as_py()
    row = df.filter(pl.col("rule") == "tool.unknown_name").row(0, named=True)
    assert content[row["char_start"] : row["char_end"]].startswith('<tool_call>\n{"name": "delete_all"')
    assert content[row["char_start"] : row["char_end"]].endswith("</tool_call>")


def test_tool_calls_exact_repeats_loop_for_every_tool_near_for_free_text():
    calls = [
        [("get_details_by_id", '{"id": "L1001"}')],
        [("get_details_by_id", '{"id": "L1002"}')],  # another id: not a repetition
        [("book_reservation", '{"flight": "HAT001", "note": "retry after Not enough seats"}')],
        [
            ("book_reservation", '{"flight": "HAT002", "note": "retry after Not enough seats"}')
        ],  # a correction
        [("transfer_to_human_agents", '{"summary": "help"}')],
        [("transfer_to_human_agents", '{ "summary" : "help" }')],  # the same call again: a loop
        [("search", '{"query": "cheap flights to boston in may for a family of four adults"}')],
        [
            ("search", '{"query": "Cheap flights to Boston in May for a family of four adults!"}')
        ],  # a query tool: same normalised query
        [("search", '{"query": "cheap flights to boston in may for a family of four adult"}')],
    ]
    tools = {"type": "object"}
    traj = tool_traj(calls)
    traj["meta"] = {"tools": [{"name": n, "parameters": tools} for n in sorted({c[0][0] for c in calls})]}
    df = spans_of([traj])
    got = sorted(df.select("turn", "behavior").rows())
    assert got == [(6, "query_loop"), (8, "query_loop"), (9, "near_repetition")]
    assert json.loads(df.filter(pl.col("turn") == 6)["evidence"][0])["earlier_turn"] == 5
    # the tool name is not part of the compared text: a near repeat is a query's text alone
    assert (
        json.loads(df.filter(pl.col("turn") == 9)["evidence"][0])["earlier"]
        == "cheap flights to boston in may for family of four adults"
    )
    # a declared query tool: its free text is compared, its other calls too
    kb = tool_traj(
        [
            [("kb_lookup", '{"text": "refund policy for basic economy fares on all domestic routes"}')],
            [("kb_lookup", '{"text": "refund policy for the basic economy fare on all domestic routes"}')],
        ]
    )
    kb["meta"] = {"tools": [{"name": "kb_lookup", "parameters": tools}]}
    # any tool's free text (issue 34): a near repetition by the text rule; declared a query tool: the query rule
    assert spans_of([kb]).select("behavior", "rule").rows() == [("near_repetition", "text.char_jaccard")]
    got = spans_of([kb], query_tools=["kb_lookup"]).select("behavior", "rule").rows()
    assert got == [("near_repetition", "query.char_jaccard")]


def test_a_query_that_adds_a_word_refines_it():
    a = "american professional poker player in extraction 2015"
    b = "american professional poker player in extraction 2015 cast"  # FireAct 4997: found the cast
    c = "professional american poker players in extraction 2015"  # reordered, inflected: a repeat
    assert jaccard(ngrams(normalize_query(a)), ngrams(normalize_query(b))) >= 0.9
    assert spans_of([sr1(f"<search>{a}</search>", f"<search>{b}</search>")]).height == 0
    assert (
        spans_of([sr1(f"<search>{a}</search>", f"<search>{b}</search>")], near_refinements=True).height == 1
    )
    df = spans_of([sr1(f"<search>{a}</search>", f"<search>{c}</search>")], jaccard=0.8)
    assert df["behavior"].to_list() == ["near_repetition"]


def test_error_return_spans_the_call_that_produced_it():
    t = tool_traj([[("get_user", '{"user_id": "a"}'), ("get_user", '{"user_id": "b"}')]], errors={"c1"})
    df = spans_of([t], enabled=["tool_error"])
    content = batch([t])[1].column("content")[1].as_py()
    row = df.row(0, named=True)
    assert row["step_idx"] == 1 and '"b"' in content[row["char_start"] : row["char_end"]]
    assert '"a"' not in content[row["char_start"] : row["char_end"]]


def test_no_tool_list_means_no_name_check():
    t = tool_traj([[("anything", "{}")]])
    t["meta"] = {}
    assert spans_of([t]).height == 0


# ---- registry, settings, stage -------------------------------------------------------------------
def test_user_detector_and_severities():
    @detector("shouting", default_severity=0.3)
    def shouting(traj, settings):
        for s in traj.assistant_steps():
            if s.content.isupper():
                yield Hit(s.step_idx, None, None, "shouting", "shouting.caps", "")

    try:
        t = sr1("<search> SAME QUERY HERE </search>".upper(), "<SEARCH> SAME QUERY HERE </SEARCH>")
        df = spans_of([t], enabled=["shouting", "invalid_action"])
        # upper-case tags are not Search-R1 tags: both turns are also invalid actions
        assert sorted(df.select("behavior", "severity").rows()) == [
            ("invalid_action", 1.0),
            ("invalid_action", 1.0),
            ("shouting", 0.3),
            ("shouting", 0.3),
        ]
        df = spans_of([t], enabled=["shouting"], severities={"shouting": 0.9})
        assert df["severity"].to_list() == [0.9, 0.9]
        with pytest.raises(KeyError):
            spans_of([t], enabled=["nope"])
    finally:
        DETECTORS.pop("shouting")


def test_detect_stage_registered_and_configured():
    (stage,) = stages_for({"spans"})
    assert stage.name == "detect" and stage.order == 10
    t, s = batch([sr1("<search>q</search>", "<search>q</search>")])
    out = stage.fn(t, s, Config(stages={"detect": {"severities": {"query_loop": 0.7}}}), {})
    assert out.tables["spans"]["severity"].to_pylist() == [0.7]
    assert out.notes["spans.query_loop"] == 1.0
    assert DetectSettings().severities == {"invalid_action": 1.0, "query_loop": 1.0, "near_repetition": 0.5}
