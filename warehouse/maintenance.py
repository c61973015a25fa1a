"""Lake upkeep (`creditflow lake vacuum` / `lake compact`): what a lake accumulates as it is rewritten.

A Delta lake keeps the files of every version (a rewritten part leaves its old file, referenced by the older
versions), so `query --as-of` can read the past; a writer killed before its commit leaves files no version
references. `vacuum` deletes, table by table, the files no version newer than the retention references and the
unreferenced leftovers older than it (delta-rs `DeltaTable.vacuum(full=True)`): versions older than the retention
can no longer be read (`--as-of`). Below Delta's default of 7 days it refuses unless forced, since a run still
writing (its files not yet committed) or a reader on an old version could lose files.

`compact` rewrites a partition's small files into larger ones (delta-rs `optimize.compact`, one commit per
table that had any to merge). Each (round, part) of the lake is one partition that a write replaces whole, so
most hold one file and there is little to merge; the old files stay for time travel until a vacuum.

A hive-Parquet lake keeps no versions: the one thing to remove is the temporary files and staging folders of
writers that died (`Lake.cleanup`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from warehouse.lake import Lake, LakeError
from warehouse.tempfiles import stale_temp

if TYPE_CHECKING:
    from warehouse.delta_lake import DeltaLake

DEFAULT_RETAIN_HOURS = 168  # Delta's default delta.deletedFileRetentionDuration (7 days)


@dataclass
class Removed:
    """What a vacuum removed (or, dry run, would remove) from one table."""

    table: str
    files: int
    bytes: int


def _delta_tables(lake: DeltaLake) -> list[str]:
    from schemas import TABLES
    from warehouse.delta_store import EMPTY_PARTS

    return [t for t in (*TABLES, EMPTY_PARTS) if lake._table(t) is not None]


def _sizes(table, paths: list[str]) -> int:
    """Bytes of the table's files at `paths` (relative to the table; through delta-rs's own object store, so
    the same on S3)."""
    if not paths:
        return 0
    fs = table.to_pyarrow_dataset().filesystem
    return sum(max(info.size or 0, 0) for info in fs.get_file_info(paths))


def vacuum(
    lake: Lake, retain_hours: int | None = None, dry_run: bool = False, force: bool = False
) -> list[Removed]:
    """Remove (dry run: list) per table the files no lake version newer than `retain_hours` needs. Delta only;
    see `cleanup_leftovers` for a hive lake."""
    if lake.format != "delta":
        raise LakeError(f"lake {lake.uri}: vacuum needs a Delta lake (this one is {lake.format})")
    hours = DEFAULT_RETAIN_HOURS if retain_hours is None else retain_hours
    if hours < 0:
        raise LakeError(f"--retain-hours {hours:g}: must be 0 or more")
    if hours < DEFAULT_RETAIN_HOURS and not force:
        raise LakeError(
            f"--retain-hours {hours:g} is below Delta's default of {DEFAULT_RETAIN_HOURS} h: versions older than "
            "it could no longer be read (query --as-of, an export's lake version), and a run writing now could "
            "lose files it has not committed yet; add --force if no run is writing and you need no older version"
        )
    from deltalake.exceptions import DeltaError

    delta = cast("DeltaLake", lake)  # a Delta lake (checked above)
    out = []
    for name in _delta_tables(delta):
        table = delta._table(name)
        kwargs = {"retention_hours": int(hours), "enforce_retention_duration": not force, "full": True}
        try:
            paths = table.vacuum(dry_run=True, **kwargs)
            size = _sizes(table, paths)
            if paths and not dry_run:
                table.vacuum(dry_run=False, **kwargs)
        except DeltaError as exc:  # e.g. a table configured to keep its files longer
            raise LakeError(f"table {name!r}: {str(exc).splitlines()[0]}") from None
        out.append(Removed(name, len(paths), size))
    return out


def _leftovers(root: Path) -> list[Path]:
    """The stale temporary files and staging folders under a local lake (what `Lake.cleanup` removes)."""
    if not root.exists():
        return []
    found = [p for p in root.rglob(".tmp-*") if p.is_file() and stale_temp(p, ".tmp-")]
    for prefix in (".staging-", ".old-"):
        found += [p for p in root.glob(f"*/{prefix}*") if stale_temp(p, prefix)]
    return found


def _bytes(path: Path) -> int:
    try:
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.stat().st_size
    except OSError:
        return 0


def cleanup_leftovers(lake: Lake, dry_run: bool = False) -> Removed:
    """The files and folders of writers that died mid-write on a local lake (hive or Delta): `Lake.cleanup`."""
    if getattr(lake, "remote", False):
        return Removed("(leftovers)", 0, 0)
    found = _leftovers(Path(lake.root))
    size = sum(_bytes(p) for p in found)
    if not dry_run and found:
        lake.cleanup()
    return Removed("(leftovers)", len(found), size)


def compact(lake: Lake, dry_run: bool = False) -> list[Removed]:
    """Merge each partition's small files (delta-rs `optimize.compact`); per table, the files it replaced and
    their bytes (dry run: the partitions with more than one file, which a compaction would merge)."""
    if lake.format != "delta":
        raise LakeError(f"lake {lake.uri}: compact needs a Delta lake (this one is {lake.format})")
    import json

    import pyarrow as pa
    import pyarrow.compute as pc

    from warehouse.delta_store import PART

    delta = cast("DeltaLake", lake)  # a Delta lake (checked above)
    out = []
    for name in _delta_tables(delta):
        table = delta._table(name)
        if dry_run:
            acts = pa.table(table.get_add_actions(flatten=True))
            keys = [c for c in ("partition.round", f"partition.{PART}") if c in acts.column_names]
            if not keys or acts.num_rows == 0:
                out.append(Removed(name, 0, 0))
                continue
            counts = acts.group_by(keys).aggregate([("path", "count")])
            many = counts.filter(pc.greater(counts.column("path_count"), 1))
            files = int(pc.sum(many.column("path_count")).as_py() or 0)
            out.append(Removed(name, files, 0))
            continue
        metrics = table.optimize.compact()
        removed = json.loads(metrics.get("filesRemoved") or "{}")
        out.append(Removed(name, int(metrics.get("numFilesRemoved", 0)), int(removed.get("totalSize", 0))))
    return out


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


__all__ = ["DEFAULT_RETAIN_HOURS", "Removed", "cleanup_leftovers", "compact", "human_bytes", "vacuum"]
