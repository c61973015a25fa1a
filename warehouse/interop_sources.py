"""Reading the RL frameworks' binary dumps for ingest: TRL's `completions_*.parquet` and verl-style batches
saved as Parquet or NumPy `.npz`. Each file becomes `(file name, columns)`, where columns is a `pyarrow.Table`
(Parquet) or a dict of NumPy arrays (`.npz`, loaded without pickle). The adapters never open a file."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.ingest.core import Unreadable
from warehouse.sources import source_files, unreadable


def read_raw_source(path: Path) -> pa.Table | dict[str, np.ndarray] | Unreadable:
    """The file's columns, or `Unreadable` (a corrupt file, an object array that would need pickle, ...)."""
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        return pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 -- zipfile, pickle, Arrow and OS errors alike: this file only
        return unreadable(path, exc)


def read_raw_sources(paths: Iterable[str | Path], extensions: Iterable[str]) -> list[tuple[str, object]]:
    """(file name, Arrow table or dict of arrays) of every source file with one of `extensions`."""
    return [(str(p), read_raw_source(p)) for p in source_files(paths, extensions)]
