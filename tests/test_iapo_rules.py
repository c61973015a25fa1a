"""The rules IAPO annotator: unit rules on a small trajectory, then the real tau-bench / tau2-bench logs with
every support edge checked independently against the raw JSON."""

from __future__ import annotations

import functools
import json

import polars as pl
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.annotate.rules import _has_digit, annotate_rules, annotate_trajectory, text_values
from pipeline.annotate.settings import RulesAnnotatorSettings


def call(cid, name, args):
    return [{"id": cid, "name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}]


def rows(*msgs):
    out = []
    for k, (role, turn, content, calls, call_id, err) in enumerate(msgs):
        out.append(
            {
                "traj_id": "t",
                "step_idx": k,
                "role": role,
                "turn": turn,
                "content": content,
                "tool_calls": calls,
                "tool_call_id": call_id,
                "is_error": err,
            }
        )
    return out


S = RulesAnnotatorSettings()


def test_support_edges_priority_and_trivial_values():
    r = rows(
        ("system", None, "Policy: hotline 800-555-0199, code SYS123.", None, None, False),
        ("user", None, "Hi, I'm user jane_doe_42, I need help.", None, None, False),
        ("assistant", 1, "What is the order id?", None, None, False),
        ("user", 1, "It is #W7654321.", None, None, False),
        (
            "assistant",
            2,
            "",
            call("a", "get_order", {"order_id": "#W7654321", "verbose": True, "n": 1}),
            None,
            False,
        ),
        (
            "tool",
            2,
            json.dumps(
                {
                    "order_id": "#W7654321",
                    "user_id": "jane_doe_42",
                    "item": "ITEM998877",
                    "qty": 1,
                    "price": 1299.5,
                }
            ),
            None,
            "a",
            False,
        ),
        (
            "assistant",
            3,
            "",
            call(
                "b",
                "refund",
                {"order_id": "#W7654321", "item_id": "ITEM998877", "qty": 1, "hotline": "SYS123"},
            ),
            None,
            False,
        ),
        ("assistant", 4, "Done: refunded 1299.5 for jane_doe_42.", None, None, False),
    )
    nodes, edges = annotate_trajectory(r, S)
    e = {(i, j): (t, info) for i, j, t, info, _ in edges}
    # action 2 binds #W7654321 from the user reply that action 1 elicited
    assert e[(1, 2)] == ("input", "w7654321")
    # action 3: the tool return of 2 covers both order and item (most comprehensive), not the user reply;
    # qty 1 is trivial, SYS123 is in the system prompt
    assert e[(2, 3)] == ("success_utilization", "item998877, w7654321")
    assert (1, 3) not in e
    # action 4 states 1299.5 and jane_doe_42: both in 2's return (the earlier user message only has one)
    assert e[(2, 4)][0] == "success_utilization"
    assert nodes[4][1] == 0
    assert all(k == "none" for k, _ in nodes.values())


def test_unelicited_user_values_count_in_u_dir():
    r = rows(
        ("user", None, "My id is jane_doe_42.", None, None, False),
        ("assistant", 1, "", call("a", "get_user", {"user_id": "jane_doe_42"}), None, False),
    )
    nodes, edges = annotate_trajectory(r, S)
    assert edges == [] and nodes[1] == ("none", 1)


def test_errors_repeats_recovery_and_rejection():
    r = rows(
        ("user", None, "Cancel reservation ABC123.", None, None, False),
        ("assistant", 1, "", call("a", "cancel", {"reservation_id": "ABC123"}), None, False),
        ("tool", 1, "Error: reservation not found", None, "a", True),
        ("assistant", 2, "", call("b", "cancel", {"reservation_id": "ABC123"}), None, False),  # repeat
        ("tool", 2, "Error: reservation not found", None, "b", False),  # error by text
        ("assistant", 3, "", call("c", "cancel", '{"reservation_id": ABC123'), None, False),  # broken JSON
        ("assistant", 4, "I cancelled reservation XYZ789.", None, None, False),
        ("user", 4, "That's not what I asked for.", None, None, False),
        ("assistant", 5, "Sorry.", None, None, False),
    )
    nodes, edges = annotate_trajectory(r, S)
    assert {t: k for t, (k, _) in nodes.items()} == {
        1: "tool",
        2: "tool",
        3: "schema",
        4: "rejection",
        5: "none",
    }
    failed = {(i, j): b for i, j, t, _, b in edges if t == "failed_utilization"}
    assert failed == {(1, 2): "recovery", (2, 3): "recovery", (3, 4): "recovery", (4, 5): "recovery"}
    # the repeat 1 -> 2 is the same edge as the recovery (counted once); error returns supply no support
    assert not [x for x in edges if x[2] != "failed_utilization"]
    r2 = rows(
        *[
            (m["role"], m["turn"], m["content"], m["tool_calls"], m["tool_call_id"], m["is_error"])
            for m in r[:4]
        ],
        ("assistant", 3, "", call("z", "cancel", {"reservation_id": "ABC123"}), None, False),
    )
    _, edges2 = annotate_trajectory(r2, S)
    assert (1, 3, "failed_utilization") in {(i, j, t) for i, j, t, _, _ in edges2}  # a later identical call


# ---- real data ----------------------------------------------------------------------------------------
@functools.cache
def _ingest(fmt: str, path):
    import importlib
    import pkgutil

    import pipeline.ingest as pi
    from pipeline.ingest.core import ingest
    from pipeline.tokenize import ByteTokenizer

    for m in pkgutil.iter_modules(pi.__path__):
        importlib.import_module(f"pipeline.ingest.{m.name}")
    return ingest(fmt, [(str(path), path.read_text())], tokenizer=ByteTokenizer())


def _raw_actions_tau1(path):
    """traj key -> list per assistant message (turn order): (call args text, own text, answers text)."""
    out = {}
    for rec in json.loads(path.read_text()):
        key = f"{rec['task_id']}:{rec['trial']}"
        out[key] = _actions(
            rec["traj"], lambda c: c["function"]["arguments"], lambda m: m.get("tool_call_id")
        )
    return out


def _raw_actions_tau2(path):
    out = {}
    for sim in json.loads(path.read_text())["simulations"]:
        # the orchestrator's greeting records no generation (no usage, no raw_data): context, not an action
        messages = [
            {**m, "role": "system"}
            if m["role"] == "assistant" and m.get("usage") is None and m.get("raw_data") is None
            else m
            for m in sim["messages"]
        ]
        out[sim["id"]] = _actions(messages, lambda c: json.dumps(c.get("arguments")), lambda m: m.get("id"))
    return out


def _actions(messages, args_of, answer_id):
    acts = []
    owner = {}
    for m in messages:
        role = m.get("role")
        if role == "assistant":
            calls = m.get("tool_calls") or []
            acts.append(
                {
                    "args": " ".join(args_of(c) for c in calls),
                    "text": m.get("content") or "",
                    "tool": "",
                    "user": "",
                }
            )
            for c in calls:
                owner[c.get("id")] = len(acts) - 1
        elif role == "tool" and acts:
            acts[owner.get(answer_id(m), len(acts) - 1)]["tool"] += " " + (m.get("content") or "")
        elif role == "user" and acts:
            acts[-1]["user"] += " " + (m.get("content") or "")
    return acts


@pytest.mark.parametrize(
    "fmt,rel,raw_reader,key_of",
    [
        (
            "tau-bench",
            "tau_bench_v1/gpt-4o-airline.json",
            _raw_actions_tau1,
            lambda tid: tid.split(":", 1)[1],
        ),
        ("tau2-bench", "tau2_bench/qwen2.5-7b_airline_1trial.json", _raw_actions_tau2, None),
    ],
)
def test_real_logs_edges_are_in_the_raw_json(real_data, fmt, rel, raw_reader, key_of):
    path = real_data / rel
    res = _ingest(fmt, path)
    nodes, edges, notes = annotate_rules(res.steps)
    e = pl.from_arrow(edges)
    n = pl.from_arrow(nodes)
    counts = dict(e.group_by("type").len().iter_rows())
    assert counts.get("success_utilization", 0) > 300 and counts.get("input", 0) > 200
    assert counts.get("failed_utilization", 0) > 50
    assert n["error"].sum() >= 70  # the logs hold 73 (tau-bench) / 79 (tau2) tool errors
    raw = raw_reader(path)
    traj_ids = res.trajectories.column("traj_id").to_pylist()
    meta = (
        dict(zip(traj_ids, res.trajectories.column("meta").to_pylist(), strict=True))
        if "meta" in res.trajectories.column_names
        else {}
    )
    checked = 0
    for row in e.filter(pl.col("type") != "failed_utilization").iter_rows(named=True):
        tid = row["traj_id"]
        key = (
            key_of(tid)
            if key_of
            else (json.loads(meta[tid]).get("id") if isinstance(meta.get(tid), str) else tid)
        )
        acts = raw.get(key) or raw.get(tid)
        assert acts is not None, tid
        assert len(acts) == n.filter(pl.col("traj_id") == tid).height
        src, dst = acts[row["src_turn"] - 1], acts[row["dst_turn"] - 1]
        values = row["info_unit"].split(", ")
        if len(row["info_unit"]) >= 200:
            values = values[:-1]
        origin = src["tool"] if row["type"] == "success_utilization" else src["user"]
        for v in values:
            assert (
                v in origin.casefold() or v in json.dumps(json.loads(origin), ensure_ascii=False).casefold()
                if origin.strip().startswith(("{", "["))
                else v in origin.casefold()
            ), (tid, row, v)
            assert v in (dst["args"] + " " + dst["text"]).casefold(), (tid, row, v)
        checked += 1
    assert checked == counts["success_utilization"] + counts["input"]


def test_annotate_stage_writes_schema_tables(real_data):
    from pipeline.config import Config
    from pipeline.stages import load_stages
    from schemas.edges import SPEC as EDGES
    from schemas.nodes import SPEC as NODES

    res = _ingest("tau-bench", real_data / "tau_bench_v1/gpt-4o-airline.json")
    steps = res.steps.slice(0, 400)
    out = load_stages()["annotate"].fn(res.trajectories, steps, Config(), {})
    EDGES.validate(out.tables["edges"])
    NODES.validate(out.tables["nodes"])
    assert isinstance(out.tables["edges"], pa.Table) and out.tables["edges"].num_rows > 0


@given(st.text(max_size=40) | st.sampled_from(["²", "HAT069", "①②", "x³", "٣٤٥", "abc", "Ⅻ", "𝟘𝟙"]))
@settings(max_examples=300, deadline=None)
def test_digit_test_is_str_isdigit(tok):
    """The regex-first digit test agrees with str.isdigit() on every character (superscripts, circled,
    Arabic-Indic and mathematical digits included; Roman numerals are not digits)."""
    assert _has_digit(tok) == any(c.isdigit() for c in tok)


def test_unicode_digit_values():
    s = RulesAnnotatorSettings()
    # an Arabic-Indic number is a number (normalised), circled digits are a code, "x²" is too short
    assert text_values("booking ٣٤٥٦٧ and x² and ①②③ codes", s) == {"34567", "①②③"}
