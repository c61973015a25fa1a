"""Helpers the benchmark scripts share: peak memory, a machine/load note, timed worker subprocesses, markdown tables.

from _common import machine_note, md_table, peak_rss_mb, run_worker   # (bench/ is on sys.path when a
                                                                      #  script runs as bench/<name>.py)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB: VmHWM, the high-water mark of its own address space.
    (Not ru_maxrss: Linux keeps in it the peak of the process a child was forked from, so every worker of a big
    parent reported the parent's peak.)"""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # not Linux: the best there is

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _tree_rss_kib(root: int) -> int:
    """The resident set of process `root` and all its descendants now, in KiB (0 when it is gone)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(name)
        children.setdefault(int(fields[1]), []).append(pid)  # ppid
        rss[pid] = int(fields[21]) * (os.sysconf("SC_PAGE_SIZE") // 1024)  # rss in pages
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


class TreePeak:
    """Samples the summed resident set of a process tree every `interval` seconds, in a thread, while the tree
    runs: `peak_mb` after `stop()`. What a sample misses (a spike between two) the process's own VmHWM
    (peak_rss_mb, reported by the worker) covers for the largest process."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval, self.peak_kib = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if not os.path.isdir("/proc"):
            return
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, _tree_rss_kib(self.pid))
            self._stop.wait(self.interval)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_kib / 1024


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
    wall time of the whole subprocess added as `wall_s` and the peak memory of its whole process tree as
    `tree_peak_mb`: the summed resident sets of the worker and its descendants, sampled every 20 ms, or the
    worker's own high-water mark (`rss_mb`, when it reports one) where that is more."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    sampler = TreePeak(proc.pid)
    stdout, stderr = proc.communicate()
    tree_mb = sampler.stop()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{script} {' '.join(args)}: {stderr[-3000:]}")
    res = json.loads(stdout.strip().splitlines()[-1])
    res.setdefault("wall_s", wall)
    res["tree_peak_mb"] = max(tree_mb, float(res.get("rss_mb", 0.0)))
    return res


def uptime() -> str:
    """`uptime`'s line (the load of this shared machine), or the load averages where it is missing."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


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


def report(path: str | os.PathLike, title: str, intro: str, headers: Sequence[str], rows) -> None:
    """A results file: `# title`, the intro paragraph and the table, printed and written to `path`."""
    lines = [f"# {title}", "", intro, "", *md_table(headers, rows)]
    print("\n".join(lines))
    write_md(path, lines)
    print(f"wrote {path}")
