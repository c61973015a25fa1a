"""The incoming folder a `creditflow serve` deployment polls: each file or folder dropped directly under it is
one new round. A ledger in the lake (`_flow/incoming.json`) records which entry became which round, so a
crash between ingest and the final move re-uses the same round (idempotent); finished entries move to
`done/`, failed ones to `failed/`."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from warehouse.lake import Lake
from warehouse.tempfiles import temp_token

LEDGER = "_flow/incoming.json"
SKIP = {"done", "failed"}
_ROUND_IN_NAME = re.compile(r"round[=_-]?(\d+)", re.IGNORECASE)


def _mtime(path: Path) -> float:
    if path.is_file():
        return path.stat().st_mtime
    times = [p.stat().st_mtime for p in path.rglob("*")] + [path.stat().st_mtime]
    return max(times)


def new_entries(incoming: Path, settle_s: float = 2.0) -> list[Path]:
    """Entries under `incoming` (not done/, failed/ or hidden) unmodified for `settle_s` seconds, oldest first."""
    if not incoming.exists():
        return []
    now = time.time()
    entries = [p for p in incoming.iterdir() if p.name not in SKIP and not p.name.startswith((".", "_"))]
    settled = [p for p in entries if now - _mtime(p) >= settle_s]
    return sorted(settled, key=lambda p: (_mtime(p), p.name))


def read_ledger(lake: Lake) -> dict[str, dict]:
    path = lake.root / LEDGER
    return json.loads(path.read_text()) if path.exists() else {}


def write_ledger(lake: Lake, ledger: dict[str, dict]) -> None:
    path = lake.root / LEDGER
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{temp_token()}.json")
    tmp.write_text(json.dumps(ledger, indent=1, sort_keys=True))
    os.replace(tmp, path)


def assign_round(lake: Lake, entry: Path, ledger: dict[str, dict]) -> int:
    """The entry's round: the one the ledger already gave it, `round=N` in its name, or the next free round."""
    if entry.name in ledger:
        return int(ledger[entry.name]["round"])
    match = _ROUND_IN_NAME.search(entry.name)
    if match:
        return int(match.group(1))
    used = set(lake.rounds("trajectories")) | {int(v["round"]) for v in ledger.values()}
    return max(used) + 1 if used else 0


def move_entry(entry: Path, incoming: Path, folder: str) -> Path:
    """Move an entry into incoming/<folder>/ (a name already there gets a numbered suffix)."""
    target_dir = incoming / folder
    target_dir.mkdir(exist_ok=True)
    target = target_dir / entry.name
    n = 1
    while target.exists():
        target = target_dir / f"{entry.stem}.{n}{entry.suffix}"
        n += 1
    shutil.move(str(entry), str(target))
    return target
