"""Annotation stages: the work that runs on a batch before credit (C3 detectors -> spans, IAPO annotators
-> nodes/edges, TCPO counterfactuals -> counterfactuals). Each stage is a pure function of one batch of
whole groups and returns the tables it produces; flows decide which stages run from what the requested
methods need, run them in order, and write their tables as parts named like the batch.

    @annotation_stage("detect", produces=("spans",), order=10)
    def detect(trajectories: pa.Table, steps: pa.Table, config: Config, inputs: dict[str, pa.Table]
               ) -> StageOutput: ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa


@dataclass
class StageOutput:
    tables: dict[str, pa.Table]
    notes: dict[str, float] = field(default_factory=dict)  # counts for the run summary (llm calls, fallbacks)
    warnings: list[str] = field(default_factory=list)  # degraded but completed (endpoint down, ...)


class LLMRunner(Protocol):
    """What an LLM stage needs from a client: send a batch, one result or `LLMError` per request."""

    records: list[Any]

    def run_batch(self, requests: Sequence[Any]) -> list[Any]: ...


def _serial_map(fn: Callable[..., Any], *iterables: Iterable[Any]) -> list[Any]:
    return list(map(fn, *iterables))


@dataclass(frozen=True)
class StageIO:
    """The effects a flow hands to a stage. Pipeline code builds requests and parses answers; it never opens a
    socket or a process itself: `llm(settings)` returns a client (trainer.llm.client.LLMClient in a flow, a
    stand-in in a test) and `map` may run independent checks (verifiers) in parallel."""

    llm: Callable[[Any], LLMRunner] | None = None
    map: Callable[..., list[Any]] = _serial_map

    def client(self, settings: Any) -> LLMRunner:
        if self.llm is None:
            raise RuntimeError(
                "this stage calls an LLM: run it through a flow (flows.batch.stage_io) or pass io=StageIO(llm=...)"
            )
        return self.llm(settings)


NO_IO = StageIO()


@dataclass(frozen=True)
class AnnotationStage:
    name: str
    produces: tuple[str, ...]
    fn: Callable[..., StageOutput]
    order: int  # detect 10, annotate 20, counterfactual 30
    uses_llm: bool
    needs: tuple[str, ...]  # tables from earlier stages it reads
    llm_if: Callable[..., bool] | None = None  # config -> whether this run calls a model (default: uses_llm)

    def calls_llm(self, config) -> bool:
        """Whether the stage talks to an LLM endpoint under this config (the IAPO `rules` annotator does not)."""
        return self.uses_llm if self.llm_if is None else bool(self.llm_if(config))


STAGES: dict[str, AnnotationStage] = {}


def annotation_stage(
    name: str,
    produces: tuple[str, ...],
    order: int,
    uses_llm: bool = False,
    needs: tuple[str, ...] = (),
    llm_if: Callable[..., bool] | None = None,
):
    def deco(fn: Callable[..., StageOutput]) -> Callable[..., StageOutput]:
        STAGES[name] = AnnotationStage(name, tuple(produces), fn, order, uses_llm, tuple(needs), llm_if)
        return fn

    return deco


STAGE_PACKAGES = ("pipeline.detect", "pipeline.annotate", "pipeline.counterfactual")
_loaded = False


def load_stages() -> dict[str, AnnotationStage]:
    """Import the stage packages and every module in them (each stage registers itself, so a new stage is one
    new module in one of these packages) and return the registry."""
    global _loaded
    if _loaded:
        return STAGES
    import importlib
    import pkgutil

    for name in STAGE_PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{name}.{info.name}")
    _loaded = True
    return STAGES


def stages_for(tables_needed: set[str]) -> list[AnnotationStage]:
    """The stages that produce the needed tables, plus what they need in turn, in run order."""
    stages = load_stages()
    by_table = {t: s for s in stages.values() for t in s.produces}
    chosen: dict[str, AnnotationStage] = {}
    todo = list(tables_needed)
    while todo:
        table = todo.pop()
        stage = by_table.get(table)
        if stage is None:
            raise KeyError(f"no stage produces table {table!r}; stages: {sorted(stages)}")
        if stage.name not in chosen:
            chosen[stage.name] = stage
            todo.extend(stage.needs)
    return sorted(chosen.values(), key=lambda s: s.order)
