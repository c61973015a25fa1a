"""Ingest's memory with one huge record, with and without the per-record limit (#33.9).

A JSONL file of 20 ordinary records and one record whose assistant message is `--mb` MB is ingested by
`creditflow ingest` in a subprocess, with `--max-record-bytes 0` (no limit: the record is read, tokenized and
written) and with the default limit (64 MiB: quarantined unread, 64 KiB of it kept), interleaved. Printed:
the peak resident memory of the ingest process (its ru_maxrss, from wait4) and its wall time, min and median
of the repetitions, side by side. Usage: python bench/ingest_record_limit.py [--mb 100] [--reps 2]
[--limit-mb 64] [--no-baseline]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = str(Path(sys.executable).parent / "creditflow")


def _source(path: Path, mb: int) -> None:
    with open(path, "w") as fh:
        for i in range(20):
            msgs = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
            fh.write(
                json.dumps({"traj_id": f"t{i}", "group_id": "g", "reward": 1.0, "messages": msgs}) + "\n"
            )
        head = '{"traj_id": "huge", "group_id": "g", "reward": 1.0, "messages": [{"role": "user", "content": "q"}, '
        fh.write(head + '{"role": "assistant", "content": "')
        chunk = "lorem ipsum dolor sit amet " * 4096
        left = mb << 20
        while left > 0:
            fh.write(chunk[:left])
            left -= len(chunk)
        fh.write('"}]}\n')


def _run(src: Path, lake: Path, limit: str) -> tuple[float, float, int]:
    args = [CLI, "ingest", str(src), "--format", "chat-jsonl", "--lake", str(lake), "--round", "0"]
    args += ["--tokenizer", "bytes", "--max-record-bytes", limit]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    return usage.ru_maxrss / (1 << 20), wall, os.waitstatus_to_exitcode(status)  # GiB (ru_maxrss is KiB)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--limit-mb", type=int, default=64, help="the limit of the limited runs (default: the default)"
    )
    ap.add_argument(
        "--no-baseline", action="store_true", help="only the limited runs (a baseline of 100 MB needs 8 GB)"
    )
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "huge.jsonl"
        _source(src, opts.mb)
        limited = f"limit {opts.limit_mb} MiB"
        kinds = [(limited, str(opts.limit_mb << 20))]
        if not opts.no_baseline:
            kinds.insert(0, ("no limit (0)", "0"))
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name, _ in kinds}
        for rep in range(opts.reps):
            for name, limit in kinds:
                runs[name].append(_run(src, Path(tmp) / f"lake-{rep}-{limit}", limit))
        print(f"one {opts.mb} MB message among 20 records, {opts.reps} interleaved repetitions")
        print(f"{'':26}{'peak RSS GiB min/median':>26}{'wall s min/median':>22}{'exit':>6}")
        for name, rows in runs.items():
            rss, wall = [r[0] for r in rows], [r[1] for r in rows]
            print(
                f"{name:26}{min(rss):>14.2f} / {statistics.median(rss):<9.2f}{min(wall):>12.1f} / "
                f"{statistics.median(wall):<7.1f}{','.join(str(r[2]) for r in rows):>6}"
            )


if __name__ == "__main__":
    main()
