"""Reading ingest inputs: the files under a source path, as text (JSON/JSONL formats) or as Arrow tables
(canonical Parquet). The adapters in pipeline/ingest take what these return and never open a file."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CANONICAL = ("trajectories", "steps")


def source_files(paths: Iterable[str | Path], extensions: Iterable[str]) -> list[Path]:
    """The given files, and under each given folder every file with one of `extensions` (sorted)."""
    exts = tuple(extensions)
    out: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            out.extend(
                sorted(
                    p
                    for p in path.rglob("*")
                    if p.is_file()
                    and p.name.endswith(exts)
                    and not any(part.startswith(".") for part in p.relative_to(path).parts)
                )
            )
        elif path.exists():
            out.append(path)
        else:
            raise FileNotFoundError(f"no such source: {path}")
    return out


def read_text_sources(paths: Iterable[str | Path], extensions: Iterable[str]) -> list[tuple[str, str]]:
    """(file name, text) of every source file, read as UTF-8."""
    return [(str(p), p.read_text(encoding="utf-8")) for p in source_files(paths, extensions)]


def _read_parquet(path: Path) -> pa.Table:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.parquet") if not p.name.startswith("."))
        if not files:
            raise FileNotFoundError(f"no Parquet files under {path}")
        return pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive")
    return pq.read_table(path)


def read_table_sources(paths: Iterable[str | Path]) -> list[tuple[str, dict[str, pa.Table]]]:
    """Canonical `trajectories` + `steps` tables from each source: a folder holding `trajectories/` and
    `steps/` (sub-folders or `*.parquet` files whose names contain the table name), or such files given
    directly. Each source is (name, {"trajectories": table, "steps": table})."""
    out: list[tuple[str, dict[str, pa.Table]]] = []
    loose: dict[str, list[Path]] = {name: [] for name in CANONICAL}
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"no such source: {path}")
        if path.is_dir() and all((path / name).is_dir() for name in CANONICAL):
            out.append((str(path), {name: _read_parquet(path / name) for name in CANONICAL}))
            continue
        files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
        for f in files:
            for name in CANONICAL:
                if name in f.name:
                    loose[name].append(f)
    if any(loose.values()):
        tables = {
            name: pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive")
            for name, files in loose.items()
            if files
        }
        where = ",".join(str(f) for files in loose.values() for f in files)
        out.append((where, tables))
    return out
