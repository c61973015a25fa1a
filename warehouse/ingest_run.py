"""The one ingest path: rollout logs of one format -> a round's `trajectories`, `steps` and `quarantine`.

`creditflow ingest` calls `ingest_sources` with the steps run directly; `flows.ingest.ingest_flow` calls it with
each step run as a Prefect task. Both read the sources with one rule (`read_sources`: a file
that cannot be read is quarantined as one row with the reason `unreadable_file`, the other files are ingested),
convert them (`pipeline.ingest`: bad records quarantined with a stable reason category), and write the round
with all its tables or none (`warehouse.rounds.write_round`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.ingest.core import UNREADABLE_FILE, IngestResult
from warehouse.interop_sources import read_raw_sources
from warehouse.sources import DEFAULT_MAX_RECORD_BYTES, Oversized, read_table_sources, read_text_sources

UNREADABLE = UNREADABLE_FILE
RECORD_TOO_LARGE = "record_too_large"  # a record over the record limit: quarantined unread, raw truncated


class NothingIngested(ValueError):
    """No trajectory could be ingested: the round's quarantine is written, its trajectories and steps stay."""


@dataclass
class IngestRun:
    """What one ingest read, kept and wrote."""

    fmt: str
    round: int
    sources: list[str]
    inputs: int
    unreadable: int
    result: IngestResult
    parts: list[str] = field(default_factory=list)
    lake: str = ""

    def summary(self) -> dict:
        return {
            "format": self.fmt,
            "round": self.round,
            "sources": len(self.sources),
            "files_read": self.inputs - self.unreadable,
            "unreadable_files": self.unreadable,
            "trajectories": self.result.trajectories.num_rows,
            "steps": self.result.steps.num_rows,
            "quarantined": self.result.quarantine.num_rows,
            "parts": len(self.parts),
            "tokens": self.result.stats.get("tokens"),
            "lake": self.lake,
        }


def read_sources(
    paths: Iterable[str | Path],
    spec,
    allow_pickle: bool = False,
    max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES,
) -> list[tuple[str, Any]]:
    """The inputs of an ingest of format `spec` (`pipeline.ingest.get_adapter`), read with one rule for every
    caller (the CLI and the flow): a file that cannot be read (an I/O error, not Parquet, truncated, a corrupt
    dump) is an `Unreadable` that ingest quarantines as one row with the reason `unreadable_file`, and the other
    files are read; a source path that does not exist is the user's mistake (FileNotFoundError). A text
    record over `max_record_bytes` is an `Oversized`, not read (`warehouse.sources.read_text_sources`)."""
    if spec.options.get("raw_files"):  # framework dumps (Parquet / .npz / pickle) as tables or arrays
        return read_raw_sources(paths, spec.extensions, allow_pickle=allow_pickle)
    if spec.kind == "tables":
        return read_table_sources(paths)
    return read_text_sources(paths, spec.extensions, max_record_bytes)


def read_step(
    sources: list[str],
    fmt: str,
    allow_pickle: bool = False,
    max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES,
) -> list:
    """The sources' inputs (`read_sources`); none at all is the user's mistake."""
    from pipeline.ingest import get_adapter

    inputs = read_sources(sources, get_adapter(fmt), allow_pickle, max_record_bytes)
    if not inputs:
        raise FileNotFoundError(f"no {fmt} input found under {', '.join(map(str, sources))}")
    return inputs


def convert_step(fmt: str, inputs: list, round_: int, tokenizer: str | None) -> IngestResult:
    import pyarrow as pa

    from pipeline.ingest import ingest
    from schemas import quarantine as quarantine_schema
    from warehouse.tokenizers import get_tokenizer

    big = [(name, src) for name, src in inputs if isinstance(src, Oversized)]
    inputs = [(name, src) for name, src in inputs if not isinstance(src, Oversized)]
    result = ingest(fmt, inputs, round_=round_, tokenizer=get_tokenizer(tokenizer))
    if big:
        rows = [
            {
                "round": round_,
                "source_file": name,
                "location": o.location,
                "record_id": None,
                "field": None,
                "reason": RECORD_TOO_LARGE,
                "detail": f"{o.size} bytes, over the record limit of {o.limit} bytes (--max-record-bytes): not "
                f"read; raw holds its first {len(o.head.encode('utf-8', 'surrogatepass'))} bytes, truncated",
                "raw": o.head,
                "stage": f"ingest:{fmt}",
            }
            for name, o in big
        ]
        extra = pa.Table.from_pylist(rows, schema=quarantine_schema.SCHEMA)
        result.quarantine = pa.concat_tables([quarantine_schema.SPEC.conform(result.quarantine), extra])
        result.stats["records_read"] = result.stats.get("records_read", 0) + len(big)
    return result


def write_step(lake_uri: str, round_: int, result: IngestResult, batch_groups: int) -> list[str]:
    """Write the round (all its tables or none); with no trajectory at all only its quarantine, then
    `NothingIngested`."""
    from warehouse.lake import Lake
    from warehouse.rounds import write_round

    lake = Lake(lake_uri)
    if result.trajectories.num_rows == 0:
        lake.replace_partition("quarantine", round_, result.quarantine)
        raise NothingIngested(
            f"no trajectory could be ingested; {result.quarantine.num_rows} record(s) quarantined in "
            f"{lake.partition_dir('quarantine', round_)}"
        )
    return write_round(lake, round_, result.trajectories, result.steps, batch_groups, result.quarantine)


def _direct(step: Callable, *args: Any) -> Any:
    return step(*args)


def ingest_sources(
    sources: list[str],
    fmt: str,
    round_: int,
    lake: str,
    tokenizer: str | None = None,
    batch_groups: int = 64,
    allow_pickle: bool = False,
    run: Callable[..., Any] = _direct,
    max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES,
) -> IngestRun:
    """Ingest `sources` of format `fmt` into round `round_` of the lake at `lake` (its ingest tables are
    replaced, all or none). `run(step, *args)` runs each step (the flow: as a task). `max_record_bytes`: a
    text record larger than this is quarantined unread (`record_too_large`), which bounds ingest's memory
    (None or 0: no limit)."""
    from pipeline.ingest import get_adapter
    from pipeline.ingest.core import Unreadable

    if batch_groups < 1:
        raise ValueError(f"batch_groups {batch_groups}: must be >= 1")
    get_adapter(fmt)  # an unknown format: KeyError naming the known ones, before any file is read
    from warehouse.lake import Lake

    sources = [str(s) for s in sources]
    lake = Lake(lake).uri
    inputs = run(read_step, sources, fmt, allow_pickle, max_record_bytes)
    unreadable = sum(isinstance(src, Unreadable) for _, src in inputs)
    result = run(convert_step, fmt, inputs, round_, tokenizer)
    out = IngestRun(fmt, round_, sources, len(inputs), unreadable, result, lake=lake)
    out.parts = run(write_step, lake, round_, result, batch_groups)
    return out
