"""IAPO annotators: per assistant action an error flag and direct-user count (`nodes`), and typed signed
dependency edges between actions (`edges`). `config.annotator` picks the annotator: `rules` (deterministic,
the default, no model) or `llm` (a frozen model through the shared LLM client, pipeline/llm)."""

from __future__ import annotations

import pyarrow as pa

from pipeline.config import Config
from pipeline.stages import NO_IO, StageIO, StageOutput, batch_stage

ANNOTATORS = ("rules", "llm")


def run_annotator(
    steps: pa.Table,
    config: Config,
    annotator: str | None = None,
    annotator_id: str | None = None,
    io: StageIO = NO_IO,
) -> StageOutput:
    """Annotate one batch with the named annotator (default: config.annotator)."""
    import pipeline.annotate.settings  # noqa: F401  (registers the settings models)

    kind = (annotator or config.annotator or "rules").strip()
    if kind == "rules":
        from pipeline.annotate.rules import ANNOTATOR_ID, annotate_rules

        nodes, edges, notes = annotate_rules(
            steps, config.stage("annotate_rules"), annotator_id or ANNOTATOR_ID
        )
        return StageOutput(tables={"nodes": nodes, "edges": edges}, notes=notes)
    if kind == "llm":
        from pipeline.annotate.llm import annotate_llm

        return annotate_llm(steps, config, annotator_id=annotator_id, io=io)
    raise ValueError(f"unknown IAPO annotator {kind!r}; choose one of {ANNOTATORS}")


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
) -> StageOutput:
    """IAPO dependency graphs for one batch (annotator from config.annotator)."""
    return run_annotator(steps, config, io=io)
