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


_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
_OBS_LABEL = re.compile(r"^\s*Observation(?:[ \t]*\d+)?[ \t]*:", re.I)


def changes_state(name: str, settings: DetectSettings) -> bool:
    """A call to `name` may change the environment's state: not a read-only tool (listed, or named with a
    read verb first: `detect.read_only_prefixes`); `detect.state_changing_tools` always changes it."""
    if name in settings.state_changing_tools:
        return True
    if name in settings.read_only_tools or name in QUERY_ACTIONS:
        return False
    words = _WORD.findall(name)
    return not (words and words[0].lower() in settings.read_only_prefixes)


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


def depends_on(changes: Sequence[frozenset[str]], values: frozenset[str]) -> bool:
    """A call reading `values` may see another state after these state-changing calls: one of them shares an
    argument value with it (make_payment(C1) before get_bills(C1)), or it has no arguments itself (it reads
    device-wide state: toggle_data() before check_status_bar()). A change without arguments does not touch a
    read about something named (toggle_airplane_mode() before get_details_by_id(L1002)): whether it did shows
    in the result, which an exact repeat must match too."""
    return bool(changes) and (not values or any(ch & values for ch in changes))


def _touched(
    changes: list[frozenset[str]],
    step_changes: list[frozenset[str]],
    start: int,
    n: int,
    values: frozenset[str],
) -> bool:
    """A state-changing call from index `start` up to `n` (the message's own earlier calls counted after
    `changes`) touches what `values` reads (`depends_on`)."""
    cut = len(changes)
    return depends_on(changes[start:], values) or depends_on(
        step_changes[max(0, start - cut) : n - cut], values
    )


def _result_text(content: str) -> str:
    """A tool result as the rules compare it: a ReAct `Observation N:` label dropped, whitespace collapsed."""
    return " ".join(_OBS_LABEL.sub("", content, count=1).split())


def action_results(traj: TrajView, settings: DetectSettings) -> dict[tuple[int, int], tuple[str, bool]]:
    """(step_idx, action index) -> (result text, is_error) for every action whose result the trajectory
    records: the step answering its call id, else (one action in the turn) the first observation after the
    turn that answers no other call. Cached on the trajectory."""
    if "results" in traj.cache:
        return traj.cache["results"]
    out: dict[tuple[int, int], tuple[str, bool]] = {}
    for pos, step in enumerate(traj.steps):
        if step.role != "assistant":
            continue
        parsed = parse_step(traj, step, settings)
        if not parsed or not parsed.actions:
            continue
        calls = step.tool_calls or []
        after: list[StepView] = []  # the steps after this turn up to the next assistant step
        for st in traj.steps[pos + 1 :]:
            if st.role == "assistant":
                break
            after.append(st)
        for k, act in enumerate(parsed.actions):
            cid = act.call_id
            if cid is None and len(parsed.actions) == 1 and len(calls) == 1:
                cid = calls[0].get("id")
            # ids may repeat across a log (tau-bench v1 has reused ones): the answer is the first after the call
            res = next((st for st in after if cid is not None and st.tool_call_id == cid), None)
            if res is None and len(parsed.actions) == 1:
                res = next((st for st in after if st.tool_call_id is None and not st.tool_calls), None)
            if res is not None:
                out[(step.step_idx, k)] = (_result_text(res.content), res.is_error)
    traj.cache["results"] = out
    return out


@dataclass
class _Seen:
    turn: int
    result: str | None  # None: not recorded
    changes: int  # state-changing calls made once this action had run (an index into the list of them)
    text: tuple | None = None  # near repetition: (normalised text, grams, identifiers, content words)


def _word_overlap(a: frozenset, b: frozenset) -> float:
    if not a or not b:
        return 0.0
    return len(a & b) / min(len(a), len(b))


@detector("query_loop", default_severity=1.0)
def query_loop(traj: TrajView, settings: DetectSettings):
    """Repeats that mean waste: a repeat counts only when nothing it depends on changed in between (no
    state-changing call by anyone since the latest earlier identical action, and, for an exact repeat, the same
    result when both are recorded; `detect.loop_needs_no_change`).
    query_loop (1.0): the same call (name, canonical arguments) or the same normalised query of a query action
    as an earlier turn. near_repetition (0.5), when no exact repeat: a query action's text with n-gram Jaccard
    >= threshold against an earlier query of the same action, >= min_len chars, the same identifiers and
    numbers, adding no content word; or a call of any tool whose free-text arguments reword an earlier call's
    with its other arguments the same (Jaccard >= threshold, or the same result and most content words
    shared). See the module doc."""
    strict = settings.loop_needs_no_change
    results = action_results(traj, settings) if strict else {}
    earlier: dict[tuple[str, str], _Seen] = {}  # latest earlier action per (name, query or call)
    texts: dict[tuple[str, str], list[_Seen]] = {}  # (name, "" or fixed args) -> earlier texts
    # state-changing calls so far (the agent's that did not fail, everyone else's): their argument values
    changes: list[frozenset[str]] = []
    failed = {st.tool_call_id for st in traj.steps if st.is_error and st.tool_call_id is not None}
    for step in traj.steps:
        if step.role != "assistant":
            for call in step.tool_calls or ():  # another actor's calls (a user simulator's own tools)
                if changes_state(str(call.get("name") or ""), settings) and call.get("id") not in failed:
                    changes.append(argument_values(call.get("arguments")))
            continue
        parsed = parse_step(traj, step, settings)
        if not parsed:
            continue
        turn = step.turn if step.turn is not None else step.step_idx
        current: list[tuple[tuple[str, str], _Seen, tuple[tuple[str, str], tuple] | None]] = []
        step_changes: list[frozenset[str]] = []
        for k, act in enumerate(parsed.actions):
            res = results.get((step.step_idx, k))
            result = res[0] if res is not None else None
            n_before = len(changes) + len(step_changes)  # the calls of one message ran in order

            if (
                act.call is not None
                and changes_state(act.name, settings)
                and not (res is not None and res[1])
            ):
                step_changes.append(act.values)
            if act.query is not None:
                q = normalize_query(act.query)
                if not q:
                    continue  # nothing left to compare: never a loop
                key, shown = (act.name, q), q
            elif act.call is not None:
                key, shown = (act.name, act.call), f"{act.name} {act.call}"
            else:
                continue
            seen = _Seen(turn, result, len(changes) + len(step_changes))
            prev = earlier.get(key)
            if prev is not None:
                same_result = prev.result is None or result is None or prev.result == result
                unchanged = not _touched(changes, step_changes, prev.changes, n_before, act.values)
                if not strict or (unchanged and same_result):
                    why = (
                        "nothing changed in between (no state-changing call"
                        + (", the same result" if prev.result is not None and result is not None else "")
                        + ")"
                        if strict
                        else "every repeat counts (detect.loop_needs_no_change=false)"
                    )
                    yield Hit(
                        step.step_idx,
                        act.start,
                        act.end,
                        "query_loop",
                        "query.exact",
                        json.dumps({"query": shown[:200], "earlier_turn": prev.turn}, ensure_ascii=False),
                        reason=f"repeats turn {prev.turn}'s {act.name} with the same "
                        f"{'query' if act.query is not None else 'arguments'}; {why}",
                    )
                    current.append((key, seen, None))
                    continue
            near = _near(act, seen, settings)
            current.append((key, seen, near))
            if near is None:
                continue
            group, text = near
            q, g, ids, words = text
            if len(q) < settings.min_len:
                continue
            best_score: tuple[int, float] = (-1, 0.0)
            best_prev, best = None, 0.0
            for p in texts.get(group, ()):
                assert p.text is not None
                q2, g2, ids2, words2 = p.text
                if ids2 != ids:
                    continue  # other identifiers or numbers: another question, however alike the letters
                if strict and _touched(changes, step_changes, p.changes, n_before, act.values):
                    continue  # the state changed since: asking again is not waste
                if act.query is not None and not settings.near_refinements and not words <= words2:
                    continue  # it adds a word: a refinement of the earlier query, not a repeat
                j = jaccard(g, g2)
                if j >= settings.jaccard:
                    score = (1, j)
                elif (
                    act.query is None
                    and result is not None
                    and p.result == result
                    and bool(result)  # an empty result (think) says nothing of what the call did
                    and _word_overlap(words, words2) >= settings.near_word_overlap
                ):
                    score = (0, j)  # a reworded call that did the same thing
                else:
                    continue
                if score > best_score:
                    best_score, best_prev, best = score, p, j
            if best_prev is None or best_prev.text is None:
                continue
            rule = (
                f"query.{settings.ngram_unit}_jaccard"
                if act.query is not None
                else (
                    "text.same_result" if best < settings.jaccard else f"text.{settings.ngram_unit}_jaccard"
                )
            )
            what = "query" if act.query is not None else "free text"
            because = (
                f"{settings.ngram_unit} n-gram Jaccard {best:.2f} >= {settings.jaccard}"
                if best >= settings.jaccard
                else "the same result, most content words shared"
            )
            yield Hit(
                step.step_idx,
                act.start,
                act.end,
                "near_repetition",
                rule,
                json.dumps(
                    {
                        "query": q[:200],
                        "earlier": best_prev.text[0][:200],
                        "earlier_turn": best_prev.turn,
                        "jaccard": round(best, 4),
                    },
                    ensure_ascii=False,
                ),
                reason=f"rewords turn {best_prev.turn}'s {act.name} {what} ({because}; the same identifiers"
                + ("; nothing changed in between)" if strict else ")"),
            )
        changes += step_changes
        for key, seen, near in current:  # visible to later turns only
            earlier[key] = seen
            if near is not None:
                seen.text = near[1]
                texts.setdefault(near[0], []).append(seen)


def _near(act: Action, seen: _Seen, settings: DetectSettings) -> tuple[tuple[str, str], tuple] | None:
    """(comparison group, (normalised text, n-grams, identifiers, content words)) of an action near repetition
    compares: a query action's query (group: its name), a tool call's free text (group: name and its other
    arguments); None otherwise."""
    if act.query is not None:
        raw, group = act.query, (act.name, "")
    elif act.free is not None:
        raw, group = act.free, (act.name, act.fixed)
    else:
        return None
    q = normalize_query(raw)
    if not q:
        return None
    return group, (q, ngrams(q, settings.ngram_n, settings.ngram_unit), identifiers(raw), content_words(q))
