"""Batch stages: the work a round runs on each batch of whole groups, in order: C3 detectors -> spans, IAPO
annotators -> nodes/edges, TCPO counterfactuals -> counterfactuals, the statistics pass -> credit_stats, credit
-> advantages, export -> train_batch. Each stage is one declaration (`BatchStage`, filled by `@batch_stage`)
beside its pure function: the tables it reads and writes, the settings it reads, whether it calls an LLM and
the sources that make its code version. Flows run any stage from its declaration alone (read its inputs, call
it, write its outputs) and key its cache on it; nothing outside the declaration names a stage.

    @batch_stage("detect", order=10, produces=("spans",), settings=("detect",))
    def detect(trajectories: pa.Table, steps: pa.Table, config: Config, inputs: dict[str, pa.Table],
               io: StageIO = NO_IO) -> StageOutput: ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa


@dataclass
class StageOutput:
    tables: dict[str, pa.Table]  # by table name; a per-method table by `method_key(table, method)`
    notes: dict[str, float] = field(default_factory=dict)  # counts for the run summary (llm calls, fallbacks)
    warnings: list[str] = field(default_factory=list)  # degraded but completed (endpoint down, ...)
    # LLM stages (filled by `execute`): requests that failed for good, by cause ("too_long: prompt ...")
    failures: dict[str, int] = field(default_factory=dict)


def method_key(table: str, method: str) -> str:
    """The key of one method's table in a stage's `inputs` and `StageOutput.tables` (`advantages[gae+c3]`)."""
    return f"{table}[{method}]"


class LLMRunner(Protocol):
    """What an LLM stage needs from a client: send a batch, one result or `LLMError` per request."""

    @property
    def records(self) -> list[Any]: ...

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


@dataclass
class LLMReply:
    """What the flow hands back for an exchange's requests: one result or `LLMError` per request, in order,
    the client's call records and the wall time of the batch."""

    results: list[Any]
    records: list[Any]
    wall_s: float


@dataclass
class LLMExchange:
    """An LLM stage's work, split: the requests it built (pure) and the parser of their answers, `parse(reply)`,
    which returns the stage's output or the next exchange (a re-ask of the answers that were not valid). The
    flow sends the requests through its client (`execute`); pipeline code never holds one."""

    settings: Any  # the client settings (pipeline.llm.types.LLMSettings)
    requests: list[Any]
    parse: Callable[[LLMReply], StageOutput | LLMExchange]


def failure_cause(error: Any) -> str:
    """One short line for a failed request's cause, the same for requests that failed alike (`HTTP 400: ...`
    without request ids, `too_long`, `connection: ...`)."""
    import re

    kind = getattr(error, "kind", type(error).__name__)
    if kind == "too_long":
        return "too_long: prompt + answer budget exceed the context"
    msg = str(getattr(error, "message", error)).splitlines()[0] if str(error) else ""
    msg = re.sub(r"(?<!HTTP )(?<!code: )\b(?:[0-9a-f]{8,}|\d{3,})\b", "N", msg)  # ids, sizes: per request
    return f"{kind}: {msg}"[:160]


def execute(work: StageOutput | LLMExchange, io: StageIO) -> StageOutput:
    """Run a stage's exchanges through the client of `io` until it returns its output (a stage without an LLM
    returns its output at once). It counts what was asked: notes `llm_requests_total` (every request of
    every exchange) and `llm_requests_failed`: those answered by an `LLMError` after the client's retries
    and restarts, plus the requests the stage gave up on as too long for the context (its note
    `llm_too_long`; a too_long answer the stage recovers from, by splitting the request, is no failure) and
    those whose answers stayed unusable after the stage's re-asks, so that it fell back (its note
    `llm_unusable`); `failures`: the failed requests by cause."""
    import time
    from collections import Counter

    client, settings = None, None
    total, causes = 0, Counter[str]()
    while isinstance(work, LLMExchange):
        if client is None or work.settings != settings:  # a re-ask goes through the same client
            client, settings = io.client(work.settings), work.settings
        seen = len(client.records)
        t0 = time.perf_counter()
        results = client.run_batch(work.requests) if work.requests else []
        wall_s = time.perf_counter() - t0
        total += len(work.requests)
        for res in results:
            if isinstance(res, Exception) and getattr(res, "kind", None) != "too_long":
                causes[failure_cause(res)] += 1
        work = work.parse(LLMReply(list(results), client.records[seen:], wall_s))
    if client is not None:
        unfit = int(work.notes.get("llm_too_long", 0))
        if unfit:
            causes["too_long: prompt + answer budget exceed the context (not sent)"] += unfit
        unusable = int(work.notes.get("llm_unusable", 0))
        if unusable:
            causes["unusable answer: not the expected schema after the re-asks (fell back)"] += unusable
        work.notes["llm_requests_total"] = float(total)
        work.notes["llm_requests_failed"] = float(sum(causes.values()))
        restarts = getattr(client, "restarts", 0)
        if restarts:
            work.notes["llm_service_restarts"] = float(restarts)
        work.failures = dict(causes)
    return work


# a declared set of names: fixed, or a function of the round's Config (a credit stage's follow its methods)
Names = tuple[str, ...] | Callable[[Any], Iterable[str]]


def _names(declared: Names, config: Any) -> tuple[str, ...]:
    return tuple(declared(config)) if callable(declared) else tuple(declared)


def method_part(batch: str, method: str) -> str:
    """The part of a per-method table holding one batch of one method: `<batch>.<method slug>` (`+` -> `-`,
    then the lake's safe file-name alphabet)."""
    import re

    return re.sub(r"[^A-Za-z0-9_.=+-]", "_", f"{batch}.{method.replace('+', '-')}")[:180]


# one part a stage reads or writes of a batch: (table, part name, key in its `inputs` / `StageOutput.tables`)
Part = tuple[str, str, str]


def _parts(
    tables: Iterable[str], per_method: Iterable[str], batch: str, methods: Sequence[str]
) -> list[Part]:
    out = [(t, batch, t) for t in tables]
    return out + [(t, method_part(batch, m), method_key(t, m)) for t in per_method for m in methods]


@dataclass(frozen=True)
class BatchStage:
    """One batch stage, declared. A stage reads `trajectories` and `steps` (`step_columns`: only those; None:
    all) and the parts of `needs` (tables of earlier stages, one part per batch) and `needs_per_method`
    (one part per batch and method, `inputs[method_key(t, m)]`); it writes the tables of `produces` (one part
    per batch) and `produces_per_method` (one per batch and method of the round). Its cache key holds the
    settings models it reads (`settings`: every settings model its function looks up, checked by
    tests/test_stage_registry.py), the Config fields it reads (`fields`), `methods` (the method chains whose
    work it does) and the hash of `code` (its sources; default: its module's package)."""

    name: str
    fn: Callable[..., StageOutput | LLMExchange]
    order: int  # detect 10, annotate 20, counterfactual 30, credit_stats 40, credit 50, export 60
    produces: tuple[str, ...] = ()
    produces_per_method: tuple[str, ...] = ()
    needs: Names = ()
    needs_per_method: tuple[str, ...] = ()
    step_columns: Callable[[Any], Sequence[str]] | Sequence[str] | None = None
    settings: Names = ()
    fields: tuple[str, ...] = ()  # top-level Config fields (annotator, llm)
    methods: Callable[[Any], Sequence[str]] | None = None
    uses_llm: bool = False
    llm_if: Callable[..., bool] | None = None  # config -> whether this run calls a model (default: uses_llm)
    runs_if: Callable[[Any], bool] | None = (
        None  # runs in every round where true; None: when a stage needs it
    )
    round_statistics: bool = False  # reads the round's merged statistics (inputs["credit_stats"])
    records_source: bool = False  # its rows carry what they were computed from (the cache key): `source`
    code: tuple[str, ...] = ()  # source paths (files or folders) that decide its output

    def __str__(self) -> str:  # a task run's name (`{stage}-{batch}`)
        return self.name

    def __reduce__(self):  # to a worker process by name: its functions (lambdas) stay where they are declared
        return (get_stage, (self.name,))

    def reads(self, batch: str, config) -> list[Part]:
        """The parts it reads of one batch besides `trajectories` and `steps`: one per table of `needs`, one
        per method of the round per table of `needs_per_method`."""
        return _parts(self.tables_needed(config), self.needs_per_method, batch, list(config.methods))

    def inputs(self, batch: str, config) -> list[tuple[str, str]]:
        """(table, part) of everything it reads of one batch, trajectories and steps included."""
        return [("trajectories", batch), ("steps", batch)] + [(t, p) for t, p, _ in self.reads(batch, config)]

    def writes(self, batch: str, methods: Sequence[str]) -> list[Part]:
        """The parts it writes for one batch (all present: its work on that batch is on disk)."""
        return _parts(self.produces, self.produces_per_method, batch, list(methods))

    def outputs(self, batch: str, methods: Sequence[str]) -> list[tuple[str, str]]:
        """(table, part) of everything it writes for one batch."""
        return [(t, p) for t, p, _ in self.writes(batch, methods)]

    def tables(self) -> tuple[str, ...]:
        """Every table it writes."""
        return (*self.produces, *self.produces_per_method)

    def calls_llm(self, config) -> bool:
        """Whether the stage talks to an LLM endpoint under this config (the IAPO `rules` annotator does not)."""
        return self.uses_llm if self.llm_if is None else bool(self.llm_if(config))

    def tables_needed(self, config) -> tuple[str, ...]:
        return _names(self.needs, config)

    def settings_read(self, config) -> tuple[str, ...]:
        return _names(self.settings, config)

    def columns(self, config) -> list[str] | None:
        cols = self.step_columns(config) if callable(self.step_columns) else self.step_columns
        return None if cols is None else list(cols)

    def code_paths(self) -> tuple[str, ...]:
        """What decides its output besides the settings: `code`, else its module's package (or the module file
        of a top-level module), and the LLM client code of a stage that calls one. Not this module nor the
        flow's: a docstring edit there re-runs no stage."""
        if self.code:
            paths = self.code
        else:
            import sys

            module = self.fn.__module__.split(".")
            package = len(module) > 2 or hasattr(sys.modules.get(self.fn.__module__), "__path__")
            paths = ("/".join(module[:2]),) if package else ("/".join(module) + ".py",)
        return paths + (("pipeline/llm",) if self.uses_llm else ())


STAGES: dict[str, BatchStage] = {}


def batch_stage(
    name: str,
    order: int,
    produces: tuple[str, ...] = (),
    *,
    produces_per_method: tuple[str, ...] = (),
    needs: Names = (),
    needs_per_method: tuple[str, ...] = (),
    step_columns: Callable[[Any], Sequence[str]] | Sequence[str] | None = None,
    settings: Names = (),
    fields: tuple[str, ...] = (),
    methods: Callable[[Any], Sequence[str]] | None = None,
    uses_llm: bool = False,
    llm_if: Callable[..., bool] | None = None,
    runs_if: Callable[[Any], bool] | None = None,
    round_statistics: bool = False,
    records_source: bool = False,
    code: tuple[str, ...] = (),
):
    """Register `fn(trajectories, steps, config, inputs, io=NO_IO) -> StageOutput | LLMExchange` as a batch stage
    (an LLM stage returns its requests and their parser; the flow sends them, `execute`). A second
    stage of the same name from another function is an error (a silent overwrite would change a round)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        old = STAGES.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"stage {name!r} is registered twice ({old.fn.__module__} and {fn.__module__})")
        STAGES[name] = BatchStage(
            name,
            fn,
            order,
            tuple(produces),
            tuple(produces_per_method),
            needs if callable(needs) else tuple(needs),
            tuple(needs_per_method),
            step_columns,
            settings if callable(settings) else tuple(settings),
            tuple(fields),
            methods,
            uses_llm,
            llm_if,
            runs_if,
            round_statistics,
            records_source,
            tuple(code),
        )
        return fn

    return deco


# every module of these packages is imported (a new annotation stage is one new module in one of them), and
# these modules hold the credit stages
STAGE_PACKAGES = ("pipeline.detect", "pipeline.annotate", "pipeline.counterfactual")
STAGE_MODULES = ("pipeline.credit.process", "pipeline.export")
_loaded = False


def load_stages() -> dict[str, BatchStage]:
    """Import the stage packages and modules (each stage registers itself) and return the registry."""
    global _loaded
    if _loaded:
        return STAGES
    import importlib
    import pkgutil

    for name in STAGE_PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{name}.{info.name}")
    for name in STAGE_MODULES:
        importlib.import_module(name)
    _loaded = True
    return STAGES


def get_stage(name: str) -> BatchStage:
    """One stage's declaration; the stage packages are imported only when it is not registered yet (credit,
    the statistics pass and export register with their modules, so a credit caller skips the annotators')."""
    stage = STAGES.get(name)
    return stage if stage is not None else load_stages()[name]


def stages_for(tables_needed: set[str], config: Any = None) -> list[BatchStage]:
    """The stages that produce the needed tables, plus what they need in turn, in run order."""
    stages = load_stages()
    by_table = {t: s for s in stages.values() for t in (*s.produces, *s.produces_per_method)}
    chosen: dict[str, BatchStage] = {}
    todo = list(tables_needed)
    while todo:
        table = todo.pop()
        stage = by_table.get(table)
        if stage is None:
            raise KeyError(f"no stage produces table {table!r}; stages: {sorted(stages)}")
        if stage.name not in chosen:
            chosen[stage.name] = stage
            todo.extend(stage.tables_needed(config))
            todo.extend(stage.needs_per_method)
    return sorted(chosen.values(), key=lambda s: s.order)


def round_stages(config: Any) -> list[BatchStage]:
    """The stages a round runs, in order: those whose `runs_if` holds under the config (credit, the statistics
    pass when a method takes a statistic over the round, export when on) and the stages producing what they
    read."""
    chosen = [s for s in load_stages().values() if s.runs_if is not None and s.runs_if(config)]
    needed = {t for s in chosen for t in (*s.tables_needed(config), *s.needs_per_method)}
    out = {s.name: s for s in chosen} | {s.name: s for s in stages_for(needed, config)}
    return sorted(out.values(), key=lambda s: s.order)
