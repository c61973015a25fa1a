"""Task caching for batch stages. A stage's key is made of what decides its output:

- input content: (path, size, mtime) of every part the stage reads for the batch (trajectories, steps and
  the annotation / advantages parts it needs), so a re-ingested or re-annotated batch is recomputed;
- settings: the JSON of the settings models the stage declares it reads (validated, with defaults), the Config
  fields it reads and the methods whose work it does;
- code version: the package version and a hash of the source files its declaration names (its own, not the
  flow's nor pipeline/stages.py: a docstring edit there re-runs no stage).

All three come from the stage's declaration (pipeline.stages.BatchStage), the same for every stage;
tests/test_stage_registry.py runs each stage and fails when it reads a setting it does not declare.

The key says nothing about the outputs: the flow refreshes a batch whose output parts are missing, so a
deleted partition is rebuilt. Cache records (small JSON summaries) live in the lake under `_flow/cache`, so
they travel with the lake and a fresh lake starts cold; the results themselves are the lake's tables."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import Config
from pipeline.stages import BatchStage
from warehouse.lake import Lake
from warehouse.runlog import part_fingerprints

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = "_flow/cache"


def cache_dir(lake: Lake) -> Path:
    return lake.root / CACHE_DIR


def result_dir(lake: Lake) -> Path:
    """Where the stage tasks' results (the small JSON summaries the cache records point to) are kept."""
    return cache_dir(lake) / "results"


@functools.cache
def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("creditflow")
    except PackageNotFoundError:
        return "0+unknown"


@functools.cache
def _source_hash(paths: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for rel in paths:
        base = ROOT / rel
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base]
        for f in files:
            if f.exists():
                h.update(str(f.relative_to(ROOT)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def code_version(stage: BatchStage) -> str:
    """Package version + hash of the sources that decide the stage's output (its declaration's `code_paths`:
    its own sources, not the flow's modules)."""
    return f"{_package_version()}:{_source_hash(stage.code_paths())}"


def stage_settings(stage: BatchStage, config: Config) -> dict[str, Any]:
    """What a stage's output depends on besides its inputs and code, as plain JSON: the settings models it
    declares it reads, the Config fields it reads and the methods whose work it does."""
    out: dict[str, Any] = {
        "settings": {
            n: config.settings_named(n).model_dump(mode="json") for n in sorted(stage.settings_read(config))
        }
    }
    out |= {f: getattr(config, f) for f in stage.fields}
    if stage.methods is not None:
        out["methods"] = list(stage.methods(config))
    return out


def stage_cache_key(
    lake_root: str | Lake,
    round_: int,
    batch: str,
    stage: BatchStage,
    config: Config,
    round_stats: dict | None = None,
) -> str:
    """`round_stats`: the round's merged statistics a credit task gets; a change (one batch re-ingested)
    changes every credit key of the round. `lake_root`: the lake's URI (a flow task's argument) or the lake
    already open (a caller in the lake's process: opening it again finds its format, ~0.3 ms)."""
    lake = lake_root if isinstance(lake_root, Lake) else Lake(lake_root)
    fingerprint = [
        (Path(p).name, size, mtime)
        for p, size, mtime in part_fingerprints(lake, round_, stage.inputs(batch, config))
    ]
    payload = {
        "stage": stage.name,
        "lake": lake.uri,
        "round": int(round_),
        "batch": batch,
        "inputs": fingerprint,
        "settings": stage_settings(stage, config),
        "code": code_version(stage),
    }
    if round_stats is not None:
        payload["round_stats"] = round_stats
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return stage_key_prefix(round_, batch, stage) + digest


def degraded_batches(lake: Lake, round_: int, stage: BatchStage, batches: set[str] | list[str]) -> set[str]:
    """The batches whose last run of `stage` degraded (its `stage_runs` row has warnings: endpoint down,
    fallbacks used, unparseable answers). Such a result is not final: the flow runs the stage on them again
    (refreshing the cache record) instead of serving it from the cache, so a re-run after the endpoint
    recovers asks again. Reads only those batches' run-log parts (one small file each), as the lake lists them."""
    from warehouse.lake import safe_part_name
    from warehouse.runlog import TABLE, flush_stage_runs

    flush_stage_runs(
        lake, round_, reading=True
    )  # rows a run left spooled (a Delta lake: warehouse/runlog.py)
    wanted = {safe_part_name(f"{stage.name}.{b}") for b in batches}
    paths = [p for p in lake.parts(TABLE, round_) if lake.part_name(p) in wanted]
    if not paths:
        return set()
    runs = lake.read(TABLE, round_, columns=["batch", "warnings"], parts=paths)
    return {
        b
        for b, w in zip(runs.column("batch").to_pylist(), runs.column("warnings").to_pylist(), strict=True)
        if w
    }


def would_run(
    lake: Lake, round_: int, stage: BatchStage, batches: list[str], config: Config
) -> dict[str, str]:
    """The batches the flow runs `stage` on whatever its cache holds, each with why: an output part is missing
    (a deleted partition is rebuilt), or the stage calls an LLM and its last run there degraded (a fallback is
    never served as final). The flow refreshes their cache records; the up-to-date check (flows/uptodate.py)
    finds the round not up to date. The other batches are served from the cache when their key has a record."""
    from warehouse.runlog import parts_present

    out = {
        b: "output part(s) missing"
        for b in batches
        if not parts_present(lake, round_, stage.outputs(b, config.methods))
    }
    if stage.calls_llm(config):
        for b in degraded_batches(lake, round_, stage, [b for b in batches if b not in out]):
            out[b] = "its last run degraded (warnings)"
    return out


def stage_key_prefix(round_: int, batch: str, stage: BatchStage) -> str:
    """What every cache key of this (stage, round, batch) starts with; the input digest follows."""
    return f"{stage.name}-r{int(round_)}-{batch}-"


def _batch_stage_cache() -> type:
    """The Prefect cache policy class, built on first use: the key functions above need no Prefect, so a plain
    caller (flows.batch.round_statistics, the benchmarks) does not pay for importing it."""
    from prefect.cache_policies import CachePolicy

    @dataclass
    class BatchStageCache(CachePolicy):
        """Cache policy of the batch-stage tasks: reads `lake_root, round_, batch, stage, config` (and a credit
        task's `round_stats`) from the task's inputs (upstream summaries only order the work and do not enter
        the key)."""

        def compute_key(
            self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
        ) -> str | None:
            return stage_cache_key(
                inputs["lake_root"],
                inputs["round_"],
                inputs["batch"],
                inputs["stage"],
                inputs["config"],
                inputs.get("round_stats"),
            )

    BatchStageCache.__module__, BatchStageCache.__qualname__ = __name__, "BatchStageCache"
    return BatchStageCache


def __getattr__(name: str) -> Any:
    if name == "BatchStageCache":
        cls = globals()["BatchStageCache"] = _batch_stage_cache()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
