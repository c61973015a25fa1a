"""Ingest adapters: source records -> `trajectories` + `steps` (+ `quarantine`) Arrow tables.

Pure functions (no file I/O): the `creditflow ingest` command reads the files and writes the lake. Every
module of this package is imported, so a new format is one module with an `@adapter(...)` converter.
"""

import importlib
import pkgutil

from pipeline.ingest.core import IngestResult, Reject, SourceRecord, StepDraft, TrajectoryDraft, ingest
from pipeline.ingest.registry import ADAPTERS, AdapterSpec, adapter, get_adapter, register_adapter

# the modules of the ingest machinery; every other module of the package is an adapter (or, as verl_records, an
# adapter's helper: importing it registers nothing)
_MACHINERY = ("checks", "core", "readers", "records", "registry", "tables")
for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod not in _MACHINERY and not _mod.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod}")

__all__ = [
    "ADAPTERS",
    "AdapterSpec",
    "IngestResult",
    "Reject",
    "SourceRecord",
    "StepDraft",
    "TrajectoryDraft",
    "adapter",
    "get_adapter",
    "ingest",
    "register_adapter",
]
