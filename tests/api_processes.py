"""Finding the Prefect API servers a test's commands started (flows/api_launch.py launches them in sessions of
their own, so they are no children of the test): live processes running the API app whose environment names
the test's CREDITFLOW_CACHE."""

from __future__ import annotations

from pathlib import Path

from flows.api_launch import API_APP


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def servers_of(cache: Path) -> list[int]:
    """Pids of the live API servers started for this CREDITFLOW_CACHE (their cmdline and environment)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or API_APP.encode() not in _read(p / "cmdline"):
            continue
        state = _read(p / "stat").rsplit(b")", 1)[-1].split()[:1]
        if state == [b"Z"]:
            continue
        if f"CREDITFLOW_CACHE={cache}".encode() in _read(p / "environ").split(b"\0"):
            found.append(int(p.name))
    return found


def report(cache: Path) -> str:
    """For a failing check: each server left, its watchdog (if any) and the holders of the in-use lock."""
    lines = []
    inuse = cache / "services" / "prefect.inuse"
    ino = inuse.stat().st_ino if inuse.exists() else None
    holders = [
        line.split()[4]
        for line in _read(Path("/proc/locks")).decode().splitlines()
        if ino is not None and line.split()[5].endswith(f":{ino}")
    ]
    for pid in servers_of(cache):
        dogs = [
            p.name
            for p in Path("/proc").iterdir()
            if p.name.isdigit()
            and b"api_idle.py" in _read(p / "cmdline")
            and str(pid).encode() in _read(p / "cmdline")
        ]
        lines.append(f"server {pid}: watchdogs {dogs}")
    state = cache / "services" / "prefect.json"
    lines.append(f"in-use holders {holders}; record {_read(state)!r}")
    return "; ".join(lines)
