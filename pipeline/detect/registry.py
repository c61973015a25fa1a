"""The detector registry and the `detect` settings. A detector is a Python function registered by name;
it looks at one trajectory (its steps as plain Python values, per-step text) and yields `Hit`s: a step,
a char range in that step's content (None = the whole turn), the behaviour and the rule that fired.
Severities come from the settings (per behaviour), so users re-weight behaviours without touching code.

    from pipeline.detect import detector, Hit

    @detector("apology_loop")
    def apology_loop(traj, settings):
        for step in traj.assistant_steps():
            if step.content.lower().count("sorry") > 2:
                yield Hit(step.step_idx, None, None, "apology_loop", "apology.count", "3+ apologies")
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from pipeline.config import StageSettings, register_settings

BUILTIN_SEVERITIES = {"invalid_action": 1.0, "query_loop": 1.0, "near_repetition": 0.5}  # Table 5


@register_settings("detect")
class DetectSettings(StageSettings):
    enabled: list[str] = Field(
        default_factory=lambda: ["invalid_action", "tool_error", "query_loop"],
        description="detectors to run, by registered name (built in: invalid_action, tool_error, query_loop)",
    )
    severities: dict[str, float] = Field(
        default_factory=lambda: dict(BUILTIN_SEVERITIES),
        description="severity s in [0,1] per behaviour (Table 5: invalid_action 1.0, query_loop 1.0, "
        "near_repetition 0.5); a behaviour not listed uses its detector's default",
    )
    span_mode: Literal["action", "turn"] = Field(
        "action",
        description="span = the offending action's text incl. tags (action) or the whole turn (turn)",
    )
    ngram_unit: Literal["char", "word"] = Field(
        "char", description="near repetition: character or word trigrams"
    )
    ngram_n: int = Field(3, ge=1, description="n of the n-grams (Table 5: trigrams)")
    min_len: int = Field(
        8, ge=0, description="near repetition needs the current normalised query to have >= this many chars"
    )
    jaccard: float = Field(0.9, ge=0.0, le=1.0, description="near repetition: n-gram Jaccard threshold")
    near_refinements: bool = Field(
        False,
        description="near repetition also matches a query that adds a content word the earlier one lacks "
        "(false: such a refinement is never a near repetition; reorderings, inflections and dropped words are)",
    )
    exclude_think: bool = Field(
        True, description="text inside <think>...</think> is neither parsed nor part of a turn span"
    )
    query_tools: list[str] = Field(
        default_factory=list,
        description="tool-calling agents: tools whose string arguments are a free-text query (near repetition "
        "compares them), besides search and lookup; an exact repeat of any tool call is a query loop",
    )
    loop_needs_no_change: bool = Field(
        True,
        description="a repeat is a query loop (or near repetition) only when nothing it depends on changed in "
        "between: no state-changing call (by the agent or anyone else, e.g. a user simulator) since the latest "
        "earlier identical call, and (exact repeats) the same result when both results are recorded; false: "
        "every repeat of an earlier turn's action counts (the rule before issue 34)",
    )
    read_only_prefixes: list[str] = Field(
        default_factory=lambda: [
            "get",
            "check",
            "search",
            "lookup",
            "find",
            "list",
            "calculate",
            "think",
            "fetch",
            "read",
            "view",
            "show",
            "query",
            "retrieve",
            "count",
            "can",
            "is",
            "has",
        ],
        description="a tool whose name's first word (split at _ - . and camel case) is one of these only reads "
        "state; a call to any other tool may change it (unless it returned an error)",
    )
    read_only_tools: list[str] = Field(
        default_factory=list, description="tools that only read state, whatever their name"
    )
    state_changing_tools: list[str] = Field(
        default_factory=list, description="tools that change state, whatever their name (beats read_only_*)"
    )
    free_text_min_words: int = Field(
        3,
        ge=1,
        description="a string argument of a tool call with at least this many words is free text: near "
        "repetition compares it for every tool, not only query tools",
    )
    near_word_overlap: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="free text of a non-query tool: a reworded repeat (near repetition) also when the call "
        "returned the same non-empty result and this share of the shorter text's content words is in the other's",
    )
    near_needs_nothing_new: bool = Field(
        True,
        description="a reworded repeat is a near repetition only when it learned nothing: when both calls' "
        "results are recorded, not when the earlier one returned nothing or an error and the later one did not, "
        "nor when the later result has a word new to the trajectory (in none of its steps up to the call) that "
        "the agent's next turn uses; false: the thresholds alone decide (the rule before issue 34's near "
        "repetition review)",
    )
    default_action_format: str | None = Field(
        None,
        description="action format for trajectories whose action_format is null (None: openai_tools when "
        "the step has tool_calls, else no format rule)",
    )


@dataclass
class StepView:
    step_idx: int
    role: str
    turn: int | None
    content: str
    tool_calls: list[dict] | None
    tool_call_id: str | None
    is_error: bool


@dataclass
class TrajView:
    traj_id: str
    action_format: str | None
    meta: dict[str, Any]
    steps: list[StepView]
    reward: float = 0.0
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)  # parses shared between detectors

    def assistant_steps(self) -> list[StepView]:
        return [s for s in self.steps if s.role == "assistant"]

    def tools(self) -> dict[str, dict] | None:
        """meta.tools as {name: JSON schema of its parameters}; None when the trajectory lists no tools."""
        if "tools" not in self.cache:
            raw = self.meta.get("tools")
            out = None
            if isinstance(raw, list):
                out = {}
                for spec in raw:
                    fn = spec.get("function", spec) if isinstance(spec, dict) else None
                    if isinstance(fn, dict) and fn.get("name"):
                        out[str(fn["name"])] = fn.get("parameters") or {}
            self.cache["tools"] = out
        return self.cache["tools"]


@dataclass(frozen=True)
class Hit:
    step_idx: int
    char_start: int | None  # None: the whole turn
    char_end: int | None
    behavior: str
    rule: str
    evidence: str = ""
    severity: float | None = None  # None: from settings.severities / the detector default
    reason: str = (
        ""  # one sentence saying why the rule fired (spans.reason; empty: the rule's stock sentence)
    )


@dataclass(frozen=True)
class Detector:
    name: str
    fn: Callable[[TrajView, DetectSettings], Iterable[Hit]]
    default_severity: float
    doc: str


DETECTORS: dict[str, Detector] = {}


def detector(name: str, default_severity: float = 1.0):
    """Register `fn(traj: TrajView, settings: DetectSettings) -> Iterable[Hit]` under `name`."""

    def deco(fn):
        DETECTORS[name] = Detector(name, fn, float(default_severity), (fn.__doc__ or "").strip())
        return fn

    return deco


def parse_meta(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        out = json.loads(raw)
    except (TypeError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}
