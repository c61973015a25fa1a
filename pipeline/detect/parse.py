"""The actions of an assistant step, per action format (Search-R1, ReAct, WebShop, OpenAI tool calls): each
action's char range, name, query or canonical call, and the invalid ones with the rule they break. Parsing is
per step (regex over its content), cached on the trajectory (`parse_step`)."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipeline.detect.registry import DetectSettings, StepView, TrajView
from pipeline.detect.text import mask_think
from pipeline.render import canonical_arguments, tool_call_spans

QUERY_ACTIONS = ("search", "lookup")  # actions whose argument is a free-text query, in every format


@dataclass
class Action:
    start: int | None  # char range of the action text (tags included); None = the whole turn
    end: int | None
    query: str | None = None  # the free-text query of a query action (search / lookup / a query tool)
    name: str = ""  # the action or tool name
    call: str | None = None  # a tool call's canonical arguments: its exact repeats are loops, any tool
    call_id: str | None = None  # the tool call's id (links its result)
    free: str | None = None  # a non-query tool call's free-text arguments (near repetition compares them)
    fixed: str = ""  # that call's other arguments, canonical: a reworded repeat keeps them all
    values: frozenset[str] = (
        frozenset()
    )  # its argument values (`argument_values`): what a state change touches


@dataclass
class Parsed:
    actions: list[Action]
    invalid: Sequence[tuple[str, int | None, int | None, str]]  # (rule, start, end, evidence)


# ---- Search-R1 ------------------------------------------------------------------------------------
_SR1_BLOCK = re.compile(r"<(search|answer)>(.*?)</\1>", re.S)


def parse_search_r1(text: str) -> Parsed:
    blocks = list(_SR1_BLOCK.finditer(text))
    n_search, n_answer = text.count("<search>"), text.count("<answer>")
    if not blocks:
        return Parsed([], [("search_r1.no_action", None, None, "no complete <search> or <answer> block")])
    lo, hi = blocks[0].start(), blocks[-1].end()
    if n_search and n_answer:
        return Parsed([], [("search_r1.both_tags", lo, hi, f"{n_search} <search> and {n_answer} <answer>")])
    if n_search > 1 or n_answer > 1:
        tag = "search" if n_search > 1 else "answer"
        return Parsed([], [("search_r1.multiple", lo, hi, f"{max(n_search, n_answer)} <{tag}> tags")])
    b = blocks[0]
    query = b.group(2).strip() if b.group(1) == "search" else None
    return Parsed([Action(b.start(), b.end(), query, b.group(1))], [])


# ---- ReAct ----------------------------------------------------------------------------------------
_REACT_LINE = re.compile(r"^[ \t]*Action(?:[ \t]*\d+)?[ \t]*:[ \t]*(.*?)[ \t]*$", re.M)
_REACT_ACTION = re.compile(r"(search|lookup|finish)\[(.*)\]", re.S)


def parse_react(text: str) -> Parsed:
    """The turn's action is its first Action line: the one a ReAct harness runs (FireAct and ReAct execute the
    first action of a generation). Later Action lines never ran: they are one invalid span
    (`react.unexecuted_actions`, from the second Action line to the end of the last) and never queries."""
    lines = list(_REACT_LINE.finditer(text))
    if not lines:
        return Parsed([], [("react.no_action", None, None, "no Action line")])
    actions, invalid = [], []
    m = lines[0]
    start, end = m.start(), m.end()
    start += len(m.group(0)) - len(m.group(0).lstrip())
    act = _REACT_ACTION.fullmatch(m.group(1))
    if act is None:
        invalid.append(("react.unparseable", start, end, m.group(1)[:200]))
    else:
        query = act.group(2).strip() if act.group(1) in QUERY_ACTIONS else None
        actions.append(Action(start, end, query, act.group(1)))
    if len(lines) > 1:
        lo = lines[1].start() + len(lines[1].group(0)) - len(lines[1].group(0).lstrip())
        extra = [x.group(1)[:80] for x in lines[1:]]
        invalid.append(
            ("react.unexecuted_actions", lo, lines[-1].end(), json.dumps(extra[:10], ensure_ascii=False))
        )
    return Parsed(actions, invalid)


# ---- WebShop --------------------------------------------------------------------------------------
_WS_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<action>.*?</action>\s*", re.S)
_WS_ACTION = re.compile(r"<action>(.*?)</action>", re.S)
_WS_VERB = re.compile(r"(search|click)\[(.*)\]", re.S)
_CJK = re.compile(r"[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")
_ADMISSIBLE = re.compile(r"admissible actions[^\[]*\[(.*?)\]\s*\.?\s*$", re.S | re.I)
_QUOTED = re.compile(r"'([^']*)'|\"([^\"]*)\"")


def webshop_available(traj: TrajView, step: StepView) -> tuple[bool, set[str]] | None:
    """(has_search_bar, lower-cased clickables) for this turn: meta.available_actions (a list by turn or a
    dict keyed by turn), else the admissible-actions list of the latest observation; None if unknown."""
    avail = traj.meta.get("available_actions")
    entry = None
    if isinstance(avail, list) and step.turn and 0 < step.turn <= len(avail):
        entry = avail[step.turn - 1]
    elif isinstance(avail, dict):
        entry = avail.get(str(step.turn))
    if isinstance(entry, dict):
        return bool(entry.get("has_search_bar")), {str(c).lower() for c in entry.get("clickables") or []}
    obs = None
    for s in traj.steps:
        if s.step_idx >= step.step_idx:
            break
        if s.role != "assistant":
            obs = s
    if obs is None:
        return None
    m = _ADMISSIBLE.search(obs.content)
    if m is None:
        return None
    items = _QUOTED.findall(m.group(1))
    items = [a or b for a, b in items]
    has_search = any(i.startswith("search[") for i in items)
    clicks = {i[6:-1].lower() for i in items if i.startswith("click[") and i.endswith("]")}
    return has_search, clicks


def parse_webshop(text: str, traj: TrajView, step: StepView) -> Parsed:
    blocks = list(_WS_ACTION.finditer(text))
    ok_format = (
        _WS_FORMAT.fullmatch(text) is not None
        and text.count("<think>") == 1
        and text.count("</think>") == 1
        and text.count("<action>") == 1
        and text.count("</action>") == 1
    )
    lo, hi = (blocks[0].start(), blocks[-1].end()) if blocks else (None, None)
    if not ok_format:
        return Parsed([], [("webshop.malformed", lo, hi, "not <think>..</think><action>..</action>")])
    cjk = _CJK.search(text)
    if cjk:
        return Parsed([], [("webshop.cjk", lo, hi, f"CJK character {cjk.group(0)!r}")])
    b = blocks[0]
    action = b.group(1).strip()
    verb = _WS_VERB.fullmatch(action)
    if verb is None:
        return Parsed([], [("webshop.unparseable", b.start(), b.end(), action[:200])])
    avail = webshop_available(traj, step)
    if avail is not None:
        has_search, clicks = avail
        if verb.group(1) == "search" and not has_search:
            return Parsed(
                [], [("webshop.impermissible", b.start(), b.end(), f"{action[:200]} (no search bar)")]
            )
        if verb.group(1) == "click" and verb.group(2).strip().lower() not in clicks:
            return Parsed(
                [], [("webshop.impermissible", b.start(), b.end(), f"{action[:200]} (not clickable)")]
            )
    query = verb.group(2).strip() if verb.group(1) == "search" else None
    return Parsed([Action(b.start(), b.end(), query, verb.group(1))], [])


# ---- OpenAI tool calls ----------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def _validator(schema_json: str):
    import jsonschema

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def parse_openai_tools(step: StepView, traj: TrajView, settings: DetectSettings) -> Parsed:
    calls = step.tool_calls or []
    if not calls:
        return Parsed([], [])
    ranges: list[tuple[int | None, int | None]] = list(tool_call_spans(step.content))
    if len(ranges) != len(calls):
        ranges = [(None, None)] * len(calls)
    tools = traj.tools()
    actions, invalid = [], []
    for call, (lo, hi) in zip(calls, ranges, strict=True):
        name = call.get("name") or ""
        raw = call.get("arguments")
        if tools is not None and name not in tools:
            invalid.append(("tool.unknown_name", lo, hi, f"tool {name!r} is not in the tool list"))
        try:
            args: dict | None = json.loads(raw) if raw else {}
            if not isinstance(args, dict):
                raise ValueError("arguments are not a JSON object")
        except (TypeError, ValueError) as exc:
            invalid.append(("tool.invalid_json", lo, hi, f"{name}: {str(exc)[:160]}"))
            args = None
        if args is not None and tools is not None and tools.get(name):
            schema = tools[name]
            err = next(iter(_validator(json.dumps(schema, sort_keys=True)).iter_errors(args)), None)
            if err is not None:
                invalid.append(("tool.schema", lo, hi, f"{name}: {err.message[:160]}"))
        query, free, fixed = None, None, ""
        if name in QUERY_ACTIONS or name in settings.query_tools:
            texts = [v for _, v in sorted(args.items()) if isinstance(v, str)] if args else []
            query = " ".join(texts)
        elif args:
            free_keys = [
                k
                for k, v in sorted(args.items())
                if isinstance(v, str) and len(v.split()) >= settings.free_text_min_words
            ]
            if free_keys:
                free = " ".join(args[k] for k in free_keys)
                rest = {k: v for k, v in args.items() if k not in free_keys}
                fixed = unicodedata.normalize("NFKC", json.dumps(rest, sort_keys=True, ensure_ascii=False))
        canonical = unicodedata.normalize("NFKC", canonical_arguments(raw))
        call_id = call.get("id")
        actions.append(
            Action(
                lo,
                hi,
                query,
                name,
                None if query is not None else canonical,
                call_id,
                free,
                fixed,
                argument_values(args if args is not None else raw),
            )
        )
    return Parsed(actions, invalid)


# ---- dispatch -------------------------------------------------------------------------------------
def action_format(traj: TrajView, step: StepView, settings: DetectSettings) -> str | None:
    fmt = traj.action_format or settings.default_action_format
    if fmt is None and step.tool_calls:
        return "openai_tools"
    return fmt


def parse_step(traj: TrajView, step: StepView, settings: DetectSettings) -> Parsed | None:
    """The actions of one assistant step (cached on the trajectory); None for formats without rules."""
    key = ("parsed", step.step_idx)
    if key in traj.cache:
        return traj.cache[key]
    fmt = action_format(traj, step, settings)
    text = mask_think(step.content) if settings.exclude_think else step.content
    if fmt == "search_r1":
        out = parse_search_r1(text)
    elif fmt == "react":
        out = parse_react(text)
    elif fmt == "webshop":
        out = parse_webshop(step.content, traj, step)  # the format rule needs the <think> block itself
    elif fmt == "openai_tools":
        out = parse_openai_tools(step, traj, settings)
    else:
        out = None
    traj.cache[key] = out
    return out


def argument_values(arguments) -> frozenset[str]:
    """The scalar values of a call's arguments (JSON text or object), lower-cased: what the call is about."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return frozenset([arguments.strip().lower()]) if arguments.strip() else frozenset()
    out: set[str] = set()
    stack = [arguments]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif x is not None and not isinstance(x, bool) and str(x).strip():
            out.add(unicodedata.normalize("NFKC", str(x)).strip().lower())
    return frozenset(out)
