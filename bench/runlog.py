"""The run log's cost on a Delta lake: a round's stage_runs rows spooled and committed once
(warehouse.runlog.flush_stage_runs, since #36) beside one Delta commit per row (the code before), interleaved.

    python bench/runlog.py [--stages 5] [--batches 12] [--reps 3]

Each repetition writes a fresh lake's round (stages x batches rows: a flow's 12-batch round of 5 stages is 60),
then the same rows again (a re-run over a committed log, where every commit replays a longer log), each way;
cells are min / median wall and CPU seconds (time.process_time), and the commits each way added to the log."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_round(spool: bool, stages: int, batches: int) -> dict[str, float]:
    from warehouse import runlog
    from warehouse.lake import Lake

    os.environ["CREDITFLOW_LAKE_FORMAT"] = "delta"
    lake = Lake(tempfile.mkdtemp(prefix="bench-runlog-"))
    real = runlog.spools
    if not spool:  # the code before: every row its own commit
        runlog.spools = lambda lake: False
    out: dict[str, float] = {}
    try:
        for phase in ("new", "rerun"):
            t0, c0 = time.perf_counter(), time.process_time()
            for b in range(batches):
                for s in range(stages):
                    runlog.record_stage_run(lake, 0, f"stage{s}", f"b{b:05d}", seconds=1.0, tokens=b)
            runlog.flush_stage_runs(lake, 0)
            out[f"{phase}_s"] = time.perf_counter() - t0
            out[f"{phase}_cpu"] = time.process_time() - c0
        out["commits"] = len(list((lake.root / runlog.TABLE / "_delta_log").glob("*.json")))
        assert runlog.read_stage_runs(lake, 0).num_rows == stages * batches
    finally:
        runlog.spools = real
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import uptime

    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=5)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    print(f"load at start: {uptime()}")
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for rep in range(args.reps):
        for spool in (True, False) if rep % 2 == 0 else (False, True):
            runs[spool].append(one_round(spool, args.stages, args.batches))

    def cell(spool: bool, key: str) -> str:
        vals = [r[key] for r in runs[spool]]
        return f"{min(vals):.2f} / {statistics.median(vals):.2f}"

    rows = args.stages * args.batches
    print(
        f"{rows} rows ({args.stages} stages x {args.batches} batches), {args.reps} repetitions, min / median"
    )
    print("| run log | new round: wall s | CPU s | re-run: wall s | CPU s | Delta commits (both) |")
    print("|---|---|---|---|---|---|")
    for spool, name in (
        (False, "one commit per row (before)"),
        (True, "spooled, one commit per round (after)"),
    ):
        print(
            f"| {name} | {cell(spool, 'new_s')} | {cell(spool, 'new_cpu')} | {cell(spool, 'rerun_s')} | "
            f"{cell(spool, 'rerun_cpu')} | {runs[spool][0]['commits']:.0f} |"
        )
    print(f"load at end: {uptime()}")


if __name__ == "__main__":
    main()
