"""IAPO annotators: per assistant action an error flag and direct-user count (`nodes`), and typed signed
dependency edges between actions (`edges`). `config.annotator` picks the annotator: `rules` (deterministic,
the default, no model) or `llm` (a frozen model through the shared LLM client, pipeline/llm)."""

from __future__ import annotations

import pyarrow as pa

from pipeline.config import Config
from pipeline.stages import NO_IO, LLMExchange, StageIO, StageOutput, batch_stage, execute

ANNOTATORS = ("rules", "llm")


def annotator_work(
    steps: pa.Table, config: Config, annotator: str | None = None, annotator_id: str | None = None
) -> StageOutput | LLMExchange:
    """One batch's annotation with the named annotator (default: config.annotator): the output of `rules`, or
    the `llm` annotator's requests and the parser of their answers (`pipeline.stages.execute` sends them)."""
    from pipeline.annotate.settings import RulesAnnotatorSettings

    kind = (annotator or config.annotator or "rules").strip()
    if kind == "rules":
        from pipeline.annotate.rules import ANNOTATOR_ID, annotate_rules

        nodes, edges, notes = annotate_rules(
            steps, config.settings(RulesAnnotatorSettings), annotator_id or ANNOTATOR_ID
        )
        return StageOutput(tables={"nodes": nodes, "edges": edges}, notes=notes)
    if kind == "llm":
        from pipeline.annotate.llm import annotate_llm_requests

        return annotate_llm_requests(steps, config, annotator_id=annotator_id)
    raise ValueError(f"unknown IAPO annotator {kind!r}; choose one of {ANNOTATORS}")


def run_annotator(
    steps: pa.Table,
    config: Config,
    annotator: str | None = None,
    annotator_id: str | None = None,
    io: StageIO = NO_IO,
) -> StageOutput:
    """Annotate one batch with the named annotator, an LLM's requests sent through the client of `io`."""
    return execute(annotator_work(steps, config, annotator, annotator_id), io)


@batch_stage(
    "annotate",
    order=20,
    produces=("nodes", "edges"),
    settings=("annotate_rules", "annotate_llm", "llm"),
    fields=("annotator", "llm"),
    uses_llm=True,
    llm_if=lambda config: (config.annotator or "rules").strip() == "llm",
)
def annotate(
    trajectories: pa.Table,
    steps: pa.Table,
    config: Config,
    inputs: dict[str, pa.Table],
    io: StageIO = NO_IO,
) -> StageOutput | LLMExchange:
    """IAPO dependency graphs for one batch (annotator from config.annotator); the llm annotator returns its
    requests, which the flow sends (`pipeline.stages.execute`)."""
    return annotator_work(steps, config)
