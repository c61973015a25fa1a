"""A hive-Parquet lake converted to Delta (`creditflow lake migrate`)."""

from __future__ import annotations

import os
from pathlib import Path

from warehouse.delta_lake import DeltaLake
from warehouse.lake import Lake, LakeError
from warehouse.tempfiles import temp_token


def migrate(src: str | os.PathLike, dest: str | os.PathLike | None = None) -> dict[str, int]:
    """Convert a hive-Parquet lake to Delta without re-ingesting: every (table, round, part) is written to
    the Delta lake at `dest` (default: in place, table by table through a temporary folder, so a table is
    either old or new). Returns rows per table. The side state (locks, caches, ledgers) stays."""
    import shutil

    from schemas import TABLES

    old = Lake(src)
    if old.format != "parquet":
        raise LakeError(f"lake {src}: already {old.format}")
    if not old.exists():
        raise LakeError(f"no lake at {src} (no table folders there); check --lake")
    in_place = dest is None
    counts: dict[str, int] = {}
    names = [t for t in TABLES if old.rounds(t)]
    for table in names:
        target_root = old.root / f".migrate-{temp_token()}" if dest is None else dest  # None: in place
        new = DeltaLake(target_root)
        n = 0
        for r in old.rounds(table):
            parts = {old.part_name(p): old.read(table, r, parts=[p]) for p in old.parts(table, r)}
            new.replace_partition(table, r, parts)
            n += sum(t.num_rows for t in parts.values())
        counts[table] = n
        if in_place:
            backup = old.root / f".old-{temp_token()}-{table}"
            os.replace(old.table_dir(table), backup)
            os.replace(Path(target_root) / table, old.table_dir(table))
            shutil.rmtree(backup, ignore_errors=True)
            shutil.rmtree(target_root, ignore_errors=True)
    marker = old.root if in_place else None
    if marker is not None:
        (marker / "_format").write_text("delta\n", encoding="utf-8")
    return counts
