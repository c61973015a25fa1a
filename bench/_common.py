"""Helpers the benchmark scripts share: peak RSS, a machine/load note, timed worker subprocesses, markdown tables.

from _common import machine_note, md_table, peak_rss_mb, run_worker   # (bench/ is on sys.path when a
                                                                      #  script runs as bench/<name>.py)
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mb() -> float:
    """This process's peak resident set size (ru_maxrss, KiB on Linux) in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cores() -> int:
    """CPUs this process may run on (the taskset pinning), else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_note() -> str:
    """One line: CPUs usable / on the machine, load average at the time of writing, Python."""
    try:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "n/a"
    return (
        f"Machine: {platform.machine()}, {cores()} of {os.cpu_count()} CPUs usable (taskset), "
        f"load average {load} (1/5/15 min) when written, Python {platform.python_version()}."
    )


def run_worker(
    script: str | os.PathLike,
    *args: str,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Run `python script *args` in a fresh process; its last stdout line is a JSON object, returned with the
    wall time of the whole subprocess added as `wall_s` (so each measurement has its own peak RSS)."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    wall = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"{script} {' '.join(args)}: {out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res.setdefault("wall_s", wall)
    return res


def emit(result: dict) -> None:
    """A worker's answer to run_worker: one JSON line on stdout."""
    print(json.dumps(result), flush=True)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table as lines (cells are str()-ed; format numbers before)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def write_md(path: str | os.PathLike, lines: Iterable[str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
