"""Settings of the IAPO annotators (stage names `annotate_rules` and `annotate_llm`).

They are imported by pipeline/credit/methods/iapo.py so that `Config.check()` knows them whenever the credit
engine is loaded (config files can set `stages: {annotate_rules: {...}}`)."""

from __future__ import annotations

from pydantic import Field

from pipeline.config import StageSettings, register_settings


@register_settings("annotate_rules")
class RulesAnnotatorSettings(StageSettings):
    min_number_digits: int = Field(
        3, ge=1, description="[INF] numbers with fewer digits (0, 1, 42) are trivial and never bind an edge"
    )
    min_value_chars: int = Field(3, ge=1, description="[INF] shortest string value that can bind an edge")
    text_values: bool = Field(
        True, description="[INF] values stated in an action's text (not only tool-call arguments) bind edges"
    )
    recovery_edges: bool = Field(
        True,
        description="[INF] the first action after an observable error gets a failed_utilization edge from the "
        "erroneous action (it must fall back because of it)",
    )
    repeat_edges: bool = Field(
        True,
        description="a later identical tool call (same name, same canonical arguments) of an errored call "
        "is a failed_utilization edge",
    )
    rejections: bool = Field(True, description="explicit user rejections of the preceding action set e = 1")
    max_info_chars: int = Field(200, ge=16, description="info_unit text is truncated to this many characters")


@register_settings("annotate_llm")
class LLMAnnotatorSettings(StageSettings):
    model: str | None = Field(None, description="annotator model (None: the LLM client's default model)")
    retries: int = Field(
        1, ge=0, description="re-asks after a malformed answer before recording a parse failure"
    )
    max_tokens: int = Field(2048, ge=64, description="answer budget per trajectory")
    structured_output: bool = Field(
        True, description="send response_format json_schema (servers that reject it get plain JSON mode)"
    )
    max_message_chars: int = Field(
        4000,
        ge=100,
        description="characters of one message sent to the annotator (longer ones are cut in the middle)",
    )
    window_overlap: float = Field(
        0.3,
        ge=0.0,
        lt=1.0,
        description="a trajectory longer than the context is labelled in overlapping windows: the share of a "
        "window that repeats the end of the one before (each action is labelled by the window where it is most "
        "central)",
    )
    include_system: bool = Field(
        False, description="send system messages too (policy text; no action cites them)"
    )
    annotator_id: str | None = Field(
        None, description="annotator id written to nodes/edges (None: llm:<model>)"
    )
