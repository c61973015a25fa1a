"""Ingest adapters by format name. A new format is one module in `pipeline/ingest/` that decorates its
converter with `@adapter(...)`; the package imports every module, so no central list is edited.

Two kinds of adapter:
- text adapters: `reader(text, source_file)` splits a file's text into `SourceRecord`s (verbatim raw text and
  a location each) and `convert(record)` turns one record into a `TrajectoryDraft` (or raises `Reject`);
- table adapters (`kind="tables"`): `ingest_tables(sources, round_, tokenizer)` takes already-parsed Arrow
  tables (canonical Parquet) and returns an `IngestResult` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.ingest.records import SourceRecord, TrajectoryDraft

Reader = Callable[[str, str], "Iterator[SourceRecord]"]
Converter = Callable[["SourceRecord"], "TrajectoryDraft"]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    kind: str  # "text" | "tables"
    action_format: str | None
    description: str
    extensions: tuple[str, ...]
    reader: Reader | None = None
    convert: Converter | None = None
    ingest_tables: Callable[..., Any] | None = None
    options: dict = field(default_factory=dict)


ADAPTERS: dict[str, AdapterSpec] = {}


def register_adapter(spec: AdapterSpec) -> AdapterSpec:
    if spec.name in ADAPTERS and ADAPTERS[spec.name] != spec:
        raise ValueError(f"ingest adapter {spec.name!r} is registered twice")
    ADAPTERS[spec.name] = spec
    return spec


def adapter(
    name: str,
    *,
    reader: Reader,
    action_format: str | None,
    extensions: tuple[str, ...] = (".json", ".jsonl"),
    description: str = "",
) -> Callable[[Converter], Converter]:
    """Register a text adapter: `reader` splits a file into records, the decorated function converts one."""

    def wrap(convert: Converter) -> Converter:
        register_adapter(
            AdapterSpec(
                name=name,
                kind="text",
                action_format=action_format,
                description=description or (convert.__doc__ or "").strip().split("\n")[0],
                extensions=extensions,
                reader=reader,
                convert=convert,
            )
        )
        return convert

    return wrap


def get_adapter(name: str) -> AdapterSpec:
    """The adapter registered as `name`. Every adapter module is registered by then: importing this module
    runs the package's `__init__` first, which imports them all."""
    try:
        return ADAPTERS[name]
    except KeyError:
        raise KeyError(f"unknown ingest format {name!r}; known: {sorted(ADAPTERS)}") from None
