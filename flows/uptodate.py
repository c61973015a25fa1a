"""Is a round already processed with the current inputs, settings and code? `creditflow process` asks before it
starts Prefect (its API, seconds of imports and start-up), so a re-run of a finished round costs about a second.

The answer is exactly the flow's own decision, made without running it: the flow serves a (stage, batch) from
the cache when the stage's cache key (flows/caching.py: the input parts' identities, the settings the stage
reads, its code; for credit also the round's merged statistics) has a record in the lake's cache folder and
the stage's outputs are present and not degraded. When every (stage, batch) of the round would be served so,
and the flow would find nothing else to do (no parts of batches the round no longer holds, the hive lake's
catalog file written after the last stage run), running it changes nothing but the run's bookkeeping: the
round is up to date. Anything else (a re-ingested batch, a `--set`, a code change, a deleted output part, a
degraded LLM answer, a run in progress on the round) falls through to the flow.

Reads only: no lake file, cache record or lock is written here (the round's lock is taken to read a
consistent round, and released)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from pathlib import Path

from pipeline.config import Config
from warehouse.lake import Lake

log = logging.getLogger(__name__)

UP_TO_DATE = "round {round} is up to date (inputs, settings and code unchanged): nothing to run; --force runs the flow anyway"


def derived_tables() -> tuple[str, ...]:
    """The tables a round derives from its trajectories and steps (what the flow prunes of vanished batches):
    every table a batch stage declares it writes, and the run log."""
    from pipeline.stages import load_stages
    from warehouse.runlog import TABLE as RUNS

    return tuple(sorted({t for s in load_stages().values() for t in s.tables()})) + (RUNS,)


def cache_record_valid(cache_folder: Path, key: str, results: Path) -> bool:
    """Prefect's cache record `key` (written by the task's cache policy with `key_storage=cache_folder`: a JSON
    file named by the key, holding `storage_key`, the path of the task's persisted result, and `expiration`)
    exists, has not expired and its result file is there (a relative path is under `results`, the flow's
    result storage): what Prefect needs to serve the task as Cached."""
    try:
        meta = json.loads((cache_folder / key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or not meta.get("storage_key"):
        return False
    expiration = meta.get("expiration")
    if expiration:
        try:
            when = dt.datetime.fromisoformat(str(expiration).replace("Z", "+00:00"))
        except ValueError:
            return False
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        if when <= dt.datetime.now(dt.UTC):
            return False
    result = Path(str(meta["storage_key"]))
    if not result.is_absolute():
        result = results / result
    return result.is_file()


def stale_parts(lake: Lake, round_: int, batches: list[str]) -> list[str]:
    """`table/part` of the derived parts whose batch the round no longer holds (the flow would delete them),
    the run log's spooled rows (not committed yet: the flow commits them, then prunes) among them."""
    from warehouse.runlog import TABLE as RUNS
    from warehouse.runlog import spooled_parts

    keep = set(batches)
    out = []
    for table in derived_tables():
        names = [lake.part_name(path) for path in lake.parts(table, round_)]
        if table == RUNS:
            names += [n for n in spooled_parts(lake, round_) if n not in names]
        for name in names:
            batch = name.split(".", 1)[-1] if table == RUNS else name.split(".", 1)[0]
            if batch not in keep:
                out.append(f"{table}/{name}")
    return out


def current_round_statistics(lake: Lake, round_: int, config: Config, batches: list[str]) -> dict | None:
    """The round's merged statistics as the flow hands them to credit (`statistics_json`), read from the
    `credit_stats` parts; None when a batch's part is missing or was computed from other inputs, settings or code
    (the flow would run the statistics pass first). Writes nothing (flows.batch.round_statistics would)."""
    import pyarrow as pa

    from flows.batch import current_statistics, is_current
    from pipeline.credit.process import merge_statistics, statistics_json

    parts = []
    for b in batches:
        part, source = current_statistics(lake, round_, b, config)
        if not is_current(part, source):
            return None
        parts.append(part)
    return statistics_json(merge_statistics(pa.concat_tables(parts)))


def not_up_to_date(lake: Lake, round_: int, config: Config) -> str | None:
    """Why the flow would have work to do on this round (one line), or None: it would do nothing (every
    (stage, batch) served from the cache, nothing to prune or refresh). The flow's own decisions: `would_run`
    (what it refreshes) and the cache key it looks up."""
    from flows.batch import round_batches, round_stages
    from flows.caching import cache_dir, result_dir, stage_cache_key, would_run
    from pipeline.credit.process import STATS

    if not config.flow.cache:
        return "caching is off (flow.cache=false)"
    folder = cache_dir(lake)
    if not folder.is_dir():
        return "no cache records"
    batches = round_batches(lake, round_)
    stale = stale_parts(lake, round_, batches)
    if stale:
        return f"parts of batches the round no longer holds: {', '.join(stale[:3])}"
    round_stats: dict | None = None
    stages = round_stages(config)
    for stage in stages:
        if stage.round_statistics and any(s.name == STATS for s in stages):
            round_stats = current_round_statistics(lake, round_, config, batches)
            if round_stats is None:
                return "the round's statistics are missing or stale"
        must = would_run(lake, round_, stage, batches, config)
        if must:
            return "; ".join(f"{stage.name} {b}: {why}" for b, why in must.items())
        for b in batches:
            stats = round_stats if stage.round_statistics else None
            key = stage_cache_key(lake, round_, b, stage, config, stats)
            if not cache_record_valid(folder, key, result_dir(lake)):
                return f"{stage.name} {b}: inputs, settings or code changed (no cache record {key})"
    if lake.format == "parquet" and not _catalog_current(lake, round_):
        return "the catalog file is older than the round's last stage run"
    return None


def _catalog_current(lake: Lake, round_: int) -> bool:
    """The hive lake's catalog file (rebuilt at the end of every flow run) is newer than every stage run."""
    from warehouse.catalog import CATALOG_FILE
    from warehouse.runlog import TABLE as RUNS

    try:
        built = (lake.root / CATALOG_FILE).stat().st_mtime_ns
    except OSError:
        return False
    return all(Path(p).stat().st_mtime_ns <= built for p in lake.parts(RUNS, round_))


def up_to_date_summary(
    config: Config, lake: Lake, round_: int, skipped: list[str] | tuple = ()
) -> dict | None:
    """The round summary from the lake (what the flow would return, every stage cached) when the round is up
    to date, else None (the caller runs the flow). Called under the round's lock (flows.run.process_checked_round
    holds it from this check to the flow's end), so no run is in progress on the round while it looks."""
    t0 = time.perf_counter()
    why = not_up_to_date(lake, round_, config)
    if why is None:
        from flows.batch import round_stages
        from flows.summary import round_summary

        summary = round_summary(lake, round_, [s.name for s in round_stages(config)])
    if why is not None:
        log.info("round %s: running the flow: %s", round_, why)
        return None

    n = summary.get("batches", 0)
    summary.update(
        {
            "this_run": {s.name: {"batches": n, "cached": n, "warnings": []} for s in round_stages(config)},
            "warnings": [],
            "state": "Completed",
            "up_to_date": True,
            "methods": ", ".join(config.methods),
            **({"skipped (unmet preconditions)": " | ".join(skipped)} if skipped else {}),
            "seconds": round(time.perf_counter() - t0, 2),
            "advantages": str(lake.partition_dir("advantages", round_)),
        }
    )
    return summary
