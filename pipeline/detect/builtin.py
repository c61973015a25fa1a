"""The built-in detectors of C3's Table 5 (spec 5): invalid actions per action format, tool returns flagged
as errors, and query loops / near repetitions. The actions of a step come from `pipeline.detect.parse` (per
action format, regex over its content).

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
  `detect.query_tools`; their query text is their string arguments. Issue 34: a repeat is waste only when
  nothing changed and nothing was learned; a near repetition whose result brought a word new to the run that
  the next turn uses, or that followed an empty / error result, is none (`learned`; `detect.near_needs_nothing_new`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.detect.parse import QUERY_ACTIONS, Action, argument_values, parse_step
from pipeline.detect.registry import DetectSettings, Hit, StepView, TrajView, detector
from pipeline.detect.text import content_words, identifiers, jaccard, ngrams, normalize_query


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
    error: bool = False  # the recorded result is an error


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
    shared). Either only when it learned nothing (`learned`; `detect.near_needs_nothing_new`). See the module
    doc."""
    strict = settings.loop_needs_no_change
    news = settings.near_needs_nothing_new
    results = action_results(traj, settings) if strict or news else {}
    earlier: dict[tuple[str, str], _Seen] = {}  # latest earlier action per (name, query or call)
    texts: dict[tuple[str, str], list[_Seen]] = {}  # (name, "" or fixed args) -> earlier texts
    # state-changing calls so far (the agent's that did not fail, everyone else's): their argument values
    changes: list[frozenset[str]] = []
    failed = {st.tool_call_id for st in traj.steps if st.is_error and st.tool_call_id is not None}
    for pos, step in enumerate(traj.steps):
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
            seen = _Seen(turn, result, len(changes) + len(step_changes), error=res is not None and res[1])
            prev = earlier.get(key)
            if prev is not None:
                same_result = prev.result is None or result is None or prev.result == result
                unchanged = not _touched(changes, step_changes, prev.changes, n_before, act.values)
                if not strict or (unchanged and same_result):
                    yield _exact_hit(step, act, prev, result, shown, strict)
                    current.append((key, seen, None))
                    continue
            near = _near(act, seen, settings)
            current.append((key, seen, near))
            if near is None or len(near[1][0]) < settings.min_len:
                continue
            candidates = [  # the state changed since one: asking again is not waste
                p
                for p in texts.get(near[0], ())
                if not (strict and _touched(changes, step_changes, p.changes, n_before, act.values))
            ]
            best_prev, best = _most_alike(act, near[1], result, candidates, settings)
            if best_prev is not None and not (news and learned(traj, pos, best_prev, seen)):
                yield _near_hit(step, act, near[1][0], best_prev, seen, best, strict, settings)
        changes += step_changes
        for key, seen, near in current:  # visible to later turns only
            earlier[key] = seen
            if near is not None:
                seen.text = near[1]
                texts.setdefault(near[0], []).append(seen)


def _words(step: StepView) -> frozenset[str]:
    """Content words of a step: its text and its tool calls' argument values."""
    text = (
        step.content
        + " "
        + " ".join(" ".join(sorted(argument_values(c.get("arguments")))) for c in step.tool_calls or ())
    )
    return content_words(normalize_query(text))


def learned(traj: TrajView, pos: int, prev: _Seen, seen: _Seen) -> bool:
    """The call of the assistant step at `pos` (`seen`), rewording `prev`'s, learned something, so it is no
    near repetition (`detect.near_needs_nothing_new`): both results are recorded and either the earlier one
    was empty or an error and this one is neither, or this one has a word in none of the trajectory's steps up
    to the call (the question, every earlier result and turn, the call itself) that the agent's next turn uses.
    A result that is only reworded or off the point (no new word taken up) teaches nothing."""
    if prev.result is None or seen.result is None:
        return False  # nothing recorded to show it learned something
    if (not prev.result or prev.error) and seen.result and not seen.error:
        return True
    later = next((st for st in traj.steps[pos + 1 :] if st.role == "assistant"), None)
    if later is None or seen.error:
        return False
    known: set[str] = set()
    for st in traj.steps[: pos + 1]:
        known |= _words(st)
    new = content_words(normalize_query(seen.result)) - known
    return bool(new & _words(later))


def _exact_hit(step: StepView, act: Action, prev: _Seen, result: str | None, shown: str, strict: bool) -> Hit:
    """The query_loop span of an exact repeat of `prev`."""
    why = (
        "nothing changed in between (no state-changing call"
        + (", the same result" if prev.result is not None and result is not None else "")
        + ")"
        if strict
        else "every repeat counts (detect.loop_needs_no_change=false)"
    )
    return Hit(
        step.step_idx,
        act.start,
        act.end,
        "query_loop",
        "query.exact",
        json.dumps({"query": shown[:200], "earlier_turn": prev.turn}, ensure_ascii=False),
        reason=f"repeats turn {prev.turn}'s {act.name} with the same "
        f"{'query' if act.query is not None else 'arguments'}; {why}",
    )


def _most_alike(
    act: Action, text: tuple, result: str | None, candidates: list[_Seen], settings: DetectSettings
) -> tuple[_Seen | None, float]:
    """The earlier text (of `candidates`: the same group, nothing it depends on changed since) that `act`'s
    text rewords most, and its Jaccard: the same identifiers, no word added to a query (unless
    `detect.near_refinements`); Jaccard >= threshold, or for a tool's free text the same non-empty result with
    most content words shared. (None, 0.0) when none."""
    _, g, ids, words = text
    best_score: tuple[int, float] = (-1, 0.0)
    best_prev, best = None, 0.0
    for p in candidates:
        assert p.text is not None
        _, g2, ids2, words2 = p.text
        if ids2 != ids:
            continue  # other identifiers or numbers: another question, however alike the letters
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
    return best_prev, best


def _near_hit(
    step: StepView,
    act: Action,
    q: str,
    prev: _Seen,
    seen: _Seen,
    best: float,
    strict: bool,
    settings: DetectSettings,
) -> Hit:
    """The near_repetition span of `act` rewording `prev` (Jaccard `best`)."""
    assert prev.text is not None
    result = seen.result
    rule = (
        f"query.{settings.ngram_unit}_jaccard"
        if act.query is not None
        else ("text.same_result" if best < settings.jaccard else f"text.{settings.ngram_unit}_jaccard")
    )
    what = "query" if act.query is not None else "free text"
    because = (
        f"{settings.ngram_unit} n-gram Jaccard {best:.2f} >= {settings.jaccard}"
        if best >= settings.jaccard
        else "the same result, most content words shared"
    )
    return Hit(
        step.step_idx,
        act.start,
        act.end,
        "near_repetition",
        rule,
        json.dumps(
            {
                "query": q[:200],
                "earlier": prev.text[0][:200],
                "earlier_turn": prev.turn,
                "jaccard": round(best, 4),
            },
            ensure_ascii=False,
        ),
        reason=f"rewords turn {prev.turn}'s {act.name} {what} ({because}; the same identifiers"
        + ("; nothing changed in between" if strict else "")
        + (
            "; it learned nothing: no word new to the trajectory in its result that the next turn uses)"
            if settings.near_needs_nothing_new and prev.result is not None and result is not None
            else ")"
        ),
    )


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
