"""Reading ingest inputs: the files under a source path, as text (JSON/JSONL formats) or as Arrow tables
(canonical Parquet). The adapters in pipeline/ingest take what these return and never open a file."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.ingest.core import Unreadable

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


DEFAULT_MAX_RECORD_BYTES = 64 << 20  # a record (a JSONL line, a JSON document) larger than this is not read
RAW_HEAD_BYTES = 64 << 10  # what a quarantine row keeps of a record too large to read


@dataclass(frozen=True)
class Oversized:
    """A record larger than the record limit, not read: ingest quarantines it (reason `record_too_large`) with
    its first `RAW_HEAD_BYTES` bytes (truncated, said in its detail), so memory is bounded by the limit."""

    location: str  # "line N" of a JSONL file, "file" for a JSON document
    size: int
    limit: int
    head: str


def _head(data: bytes) -> str:
    return data[:RAW_HEAD_BYTES].decode("utf-8", "backslashreplace")


def _read_limited(path: Path, limit: int | None) -> tuple[str, list[Oversized]]:
    """The file's text with each JSONL line over `limit` bytes blanked (line numbers stay) and returned as an
    `Oversized`; any other file over `limit` is one `Oversized` (a JSON document is read whole)."""
    if limit is None or limit <= 0:
        return path.read_bytes().removeprefix(b"\xef\xbb\xbf").decode("utf-8", "surrogateescape"), []
    size = path.stat().st_size
    if not path.name.endswith(".jsonl"):
        if size <= limit:
            return _read_limited(path, None)
        with open(path, "rb") as fh:
            return "", [Oversized("file", size, limit, _head(fh.read(RAW_HEAD_BYTES)))]
    kept: list[bytes] = []
    big: list[Oversized] = []
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if len(line) > limit:
                big.append(Oversized(f"line {number}", len(line.rstrip(b"\r\n")), limit, _head(line)))
                line = b"\n"
            kept.append(line)
    text = b"".join(kept).removeprefix(b"\xef\xbb\xbf").decode("utf-8", "surrogateescape")
    return text, big


def read_text_sources(
    paths: Iterable[str | Path], extensions: Iterable[str], max_record_bytes: int | None = None
) -> list[tuple[str, Any]]:
    """(file name, text) of every source file, read as UTF-8. Bytes that are not UTF-8 are kept as lone
    surrogates (`surrogateescape`): ingest quarantines the records holding them, not the whole file. A leading
    byte-order mark (editors on Windows write one) is dropped: it is no part of the first record. A file that
    cannot be read is (file name, `Unreadable`); a record over `max_record_bytes` (None or 0: no limit) is
    (file name, `Oversized`) and is not read."""
    out: list[tuple[str, Any]] = []
    for p in source_files(paths, extensions):
        try:
            text, big = _read_limited(p, max_record_bytes)
        except OSError as exc:
            out.append((str(p), unreadable(p, exc)))
            continue
        if text or not big:
            out.append((str(p), text))
        out.extend((str(p), o) for o in big)
    return out


def unreadable(path: Path, exc: BaseException) -> Unreadable:
    """What stands in for a file that cannot be read (ingest makes it one quarantine row)."""
    return Unreadable(
        f"cannot read {path.name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    )


def _concat(path: Path | str, files: list[Path]) -> pa.Table | Unreadable:
    """The files as one table, or `Unreadable` naming the first that cannot be read or joined."""
    tables = []
    for f in files:
        try:
            tables.append(pq.read_table(f))
        except (OSError, ValueError, pa.ArrowException) as exc:
            return unreadable(f, exc)
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (ValueError, TypeError, pa.ArrowException) as exc:
        return unreadable(Path(path), exc)


def _read_parquet(path: Path) -> pa.Table | Unreadable:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.parquet") if not p.name.startswith("."))
        if not files:
            raise FileNotFoundError(f"no Parquet files under {path}")
        return _concat(path, files)
    return _concat(path, [path])


def _read_delta_lake(path: Path) -> dict[str, pa.Table] | Unreadable:
    """The canonical tables of a Delta lake at its current version (its folders also hold the files of older
    versions, which a file listing would read too), without the lake's `round` (ingest gives its own)."""
    from warehouse.delta_lake import DeltaLake

    lake = DeltaLake(path)
    tables = {}
    for name in CANONICAL:
        try:
            table = lake.read(name)
        except (OSError, ValueError, pa.ArrowException) as exc:
            return unreadable(path / name, exc)
        tables[name] = table.drop_columns(["round"]) if "round" in table.column_names else table
    return tables


def _whole(tables: dict[str, pa.Table | Unreadable]) -> dict[str, pa.Table] | Unreadable:
    """A source's tables, or the first of them that could not be read (the source is then that file)."""
    whole: dict[str, pa.Table] = {}
    for name, table in tables.items():
        if isinstance(table, Unreadable):
            return table
        whole[name] = table
    return whole


def read_table_sources(paths: Iterable[str | Path]) -> list[tuple[str, dict[str, pa.Table] | Unreadable]]:
    """Canonical `trajectories` + `steps` tables from each source: a folder holding `trajectories/` and
    `steps/` (sub-folders or `*.parquet` files whose names contain the table name), or such files given
    directly. Each source is (name, {"trajectories": table, "steps": table})."""
    out: list[tuple[str, dict[str, pa.Table] | Unreadable]] = []
    loose: dict[str, list[Path]] = {name: [] for name in CANONICAL}
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"no such source: {path}")
        if path.is_dir() and all((path / name).is_dir() for name in CANONICAL):
            if any((path / name / "_delta_log").is_dir() for name in CANONICAL):
                out.append((str(path), _read_delta_lake(path)))
                continue
            out.append((str(path), _whole({name: _read_parquet(path / name) for name in CANONICAL})))
            continue
        files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
        for f in files:
            for name in CANONICAL:
                if name in f.name:
                    loose[name].append(f)
    if any(loose.values()):
        where = ",".join(str(f) for files in loose.values() for f in files)
        out.append((where, _whole({name: _concat(where, files) for name, files in loose.items() if files})))
    return out
