"""The built-in detectors of C3's Table 5 (spec 5): invalid actions per action format, tool returns flagged
as errors, and query loops / near repetitions. Parsing is per step (regex over its content).

The query rules (issue 24):
- query loop (exact, severity 1.0): an action repeats an earlier turn's action exactly. For every tool call:
  same name and canonically the same arguments (sorted keys, NFKC). For query actions (`search[q]`,
  `lookup[q]`, `<search>`, and tool calls of query tools): same action name and the same normalised query
  (NFKC, then Search-R1's normalize_answer). An empty normalised query (`search[!!!]`) is never a loop.
- near repetition (0.5): only free-text queries of query actions, compared by their text alone (not the tool
  name) with an earlier query of the same action: n-gram Jaccard >= `jaccard`, current query >= `min_len`
  chars, never two queries whose identifiers or numbers differ (`text.identifiers`: L1001 vs L1002,
  1914 vs 1915, JFK vs SEA), and never a query that adds a content word the earlier one lacks (a refinement:
  "... extraction 2015 cast" after "... extraction 2015"; `detect.near_refinements` lifts this). Query tools of tool-calling agents: `search` and `lookup`, plus the tools named in
  `detect.query_tools`; their query text is their string arguments.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipeline.detect.registry import DetectSettings, Hit, StepView, TrajView, detector
from pipeline.detect.text import content_words, identifiers, jaccard, mask_think, ngrams, normalize_query
from pipeline.render import canonical_arguments, tool_call_spans

QUERY_ACTIONS = ("search", "lookup")  # actions whose argument is a free-text query, in every format


@dataclass
class Action:
    start: int | None  # char range of the action text (tags included); None = the whole turn
    end: int | None
    query: str | None = None  # the free-text query of a query action (search / lookup / a query tool)
    name: str = ""  # the action or tool name
    call: str | None = None  # a tool call's canonical arguments: its exact repeats are loops, any tool


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
    lines = list(_REACT_LINE.finditer(text))
    if not lines:
        return Parsed([], [("react.no_action", None, None, "no Action line")])
    actions, invalid = [], []
    for m in lines:
        start, end = m.start(), m.end()
        start += len(m.group(0)) - len(m.group(0).lstrip())
        act = _REACT_ACTION.fullmatch(m.group(1))
        if act is None:
            invalid.append(("react.unparseable", start, end, m.group(1)[:200]))
            continue
        query = act.group(2).strip() if act.group(1) in QUERY_ACTIONS else None
        actions.append(Action(start, end, query, act.group(1)))
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
        query = None
        if name in QUERY_ACTIONS or name in settings.query_tools:
            texts = [v for _, v in sorted(args.items()) if isinstance(v, str)] if args else []
            query = " ".join(texts)
        canonical = unicodedata.normalize("NFKC", canonical_arguments(raw))
        actions.append(Action(lo, hi, query, name, None if query is not None else canonical))
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


@detector("invalid_action", default_severity=1.0)
def invalid_action(traj: TrajView, settings: DetectSettings):
    """Malformed or impermissible actions (Table 5), by the trajectory's action format."""
    for step in traj.assistant_steps():
        parsed = parse_step(traj, step, settings)
        for rule, lo, hi, evidence in parsed.invalid if parsed else ():
            yield Hit(step.step_idx, lo, hi, "invalid_action", rule, evidence)


@detector("tool_error", default_severity=1.0)
def tool_error(traj: TrajView, settings: DetectSettings):
    """A tool return flagged is_error: the span is the call that produced it (matched by tool_call_id,
    latest earlier call with that id; else the preceding assistant turn)."""
    for i, step in enumerate(traj.steps):
        if step.role == "assistant" or not step.is_error:
            continue
        producer, lo, hi = None, None, None
        for prev in reversed(traj.steps[:i]):
            if prev.role != "assistant":
                continue
            if producer is None:
                producer = prev  # fallback: the nearest earlier assistant turn
            calls = prev.tool_calls or []
            ids = [c.get("id") for c in calls]
            if step.tool_call_id is not None and step.tool_call_id in ids:
                producer = prev
                parsed = parse_step(traj, prev, settings)
                k = ids.index(step.tool_call_id)
                if parsed is not None and len(parsed.actions) == len(calls):
                    lo, hi = parsed.actions[k].start, parsed.actions[k].end
                break
            if step.tool_call_id is None:
                break
        if producer is None:
            continue
        if lo is None and producer.tool_calls and len(producer.tool_calls) == 1:
            parsed = parse_step(traj, producer, settings)
            if parsed is not None and len(parsed.actions) == 1:
                lo, hi = parsed.actions[0].start, parsed.actions[0].end
        yield Hit(producer.step_idx, lo, hi, "invalid_action", "tool.error_return", step.content[:200])


@detector("query_loop", default_severity=1.0)
def query_loop(traj: TrajView, settings: DetectSettings):
    """Exact repetition of an earlier turn's action: same call (name, canonical arguments) or same normalised
    query of a query action (query_loop, 1.0); otherwise a query action's text with n-gram Jaccard >=
    threshold against an earlier query of the same action, >= min_len chars and the same identifiers and
    numbers (near_repetition, 0.5). See the module doc."""
    earlier: dict[tuple[str, str], int] = {}  # (name, normalised query or canonical call) -> first turn
    grams: dict[str, list[tuple]] = {}  # name -> (query, turn, grams, identifiers, content words)
    for step in traj.assistant_steps():
        parsed = parse_step(traj, step, settings)
        if not parsed:
            continue
        turn = step.turn if step.turn is not None else step.step_idx
        current: list[tuple[tuple[str, str], tuple | None]] = []
        for act in parsed.actions:
            if act.query is not None:
                q = normalize_query(act.query)
                if not q:
                    continue  # nothing left to compare: never a loop
                key = (act.name, q)
            elif act.call is not None:
                q, key = f"{act.name} {act.call}", (act.name, act.call)
            else:
                continue
            if key in earlier:
                yield Hit(
                    step.step_idx,
                    act.start,
                    act.end,
                    "query_loop",
                    "query.exact",
                    json.dumps({"query": q[:200], "earlier_turn": earlier[key]}, ensure_ascii=False),
                )
                current.append((key, None))
                continue
            if act.query is None:
                current.append((key, None))
                continue
            g = ngrams(q, settings.ngram_n, settings.ngram_unit)
            ids = identifiers(act.query)
            words = content_words(q)
            current.append((key, (q, g, ids, words)))
            if len(q) < settings.min_len:
                continue
            best, best_q, best_t = -1.0, "", 0
            for q2, t2, g2, ids2, words2 in grams.get(act.name, ()):
                if ids2 != ids:
                    continue  # other identifiers or numbers: another question, however alike the letters
                if not settings.near_refinements and not words <= words2:
                    continue  # it adds a word: a refinement of the earlier query, not a repeat
                j = jaccard(g, g2)
                if j > best:
                    best, best_q, best_t = j, q2, t2
            if best >= settings.jaccard:
                yield Hit(
                    step.step_idx,
                    act.start,
                    act.end,
                    "near_repetition",
                    f"query.{settings.ngram_unit}_jaccard",
                    json.dumps(
                        {
                            "query": q[:200],
                            "earlier": best_q[:200],
                            "earlier_turn": best_t,
                            "jaccard": round(best, 4),
                        },
                        ensure_ascii=False,
                    ),
                )
        for key, text in current:  # visible to later turns only
            if key not in earlier:
                earlier[key] = turn
                if text is not None:
                    grams.setdefault(key[0], []).append((text[0], turn, *text[1:]))
