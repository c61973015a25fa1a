"""What the credit engine spends beyond its I/O floor, item by item, on a lake made by bench/credit.py.

    python bench/credit.py --lake /tmp/b/lake --methods grpo --reps 1 --no-compute --out /tmp/b/x.md  # the lake
    python bench/credit_breakdown.py --lake /tmp/b/lake --methods grpo,gdpo,gae --reps 5

Each repetition is a fresh process per method (methods interleaved, the order alternating), with the allocator
settings every process of a round starts with (flows.runtime.tune_allocator, as bench/credit.py's workers),
after the imports every process of a round makes and the heap freeze of its first batch stage
(flows.runtime.freeze_heap). Per
batch, in the engine's order, each item timed on its own: the engine's reads
(`read_batch` of the trajectories and credit's steps columns) beside the floor's (`pq.read_table` of the same
files, the order of the two alternating by batch), the estimate (`process_batch` with the round's statistics),
the advantages write as the lake does it (`Lake.write_parts`: validation, a temporary file, fsync, rename, the
folder's fsync) beside a plain `pq.write_table` of the same table with the lake's writer options (the floor's),
and the run-log row (`record_stage_runs`). "first batch" is the first batch's estimate less the median of the
others' (a fresh process's first touches). Then `run_stage` of credit on every batch again, whole: "stage
machinery" is its time less its items measured the same way right after (steady state, the fastest of 3 passes
of each: a difference of two timings, it can read a little below 0 under noise). For a method with a statistics
pass, the pass itself (`round_statistics` on a round without parts) is timed first.

The baseline of each row is the floor: floor = floor reads + plain write; engine items add up to what the
engine pays; x floor is their ratio. Cells: min / median over the repetitions, ms per round (all batches).
Writes the table to bench/results/credit_breakdown.md (or --out)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import emit, machine_note, report, run_worker, uptime  # noqa: E402

PASSES = 3
ITEMS = (
    ("floor_read", "floor: pq.read_table of the same columns"),
    ("plain_write", "floor: plain pq.write_table of the advantages"),
    ("engine_read", "engine: read_batch (trajectories + steps)"),
    ("compute", "engine: process_batch (estimate, advantages table)"),
    ("first_batch", "  of which the first batch's excess"),
    ("lake_write", "engine: Lake.write_parts of the advantages"),
    ("runlog", "engine: the run-log row"),
    ("machinery", "engine: stage machinery (run_stage less its items, steady state)"),
    ("statistics", "engine: the statistics pass (round_statistics)"),
)


def worker(lake_dir: str, method: str, round_: int = 0) -> dict:
    sys.path.insert(0, str(ROOT))
    from flows.runtime import tune_allocator

    tune_allocator()  # what the CLI, the flow and its workers do at start (bench/credit.py's workers too)
    import pyarrow as pa
    import pyarrow.parquet as pq

    import pipeline.credit  # noqa: F401  (what every process of a round imports once, as bench/credit.py)
    from flows.batch import round_batches, round_statistics, run_stage
    from pipeline.config import Config
    from pipeline.credit.process import process_batch, statistics_json
    from pipeline.credit.registry import method_step_columns
    from pipeline.stages import get_stage, load_stages
    from warehouse.lake import Lake, write_options
    from warehouse.rounds import read_batch
    from warehouse.runlog import record_stage_runs, stage_run_row

    load_stages()
    pa.array([0])
    try:  # what run_stage does at a process's first batch stage (#36), where the checkout has it
        from flows.runtime import freeze_heap

        freeze_heap()
    except ImportError:
        pass
    lake = Lake(lake_dir)
    if lake.format != "parquet":
        raise SystemExit("credit_breakdown: a hive lake (bench/credit.py --lake DIR writes one)")
    cfg = Config(lake=lake_dir, methods=[method])
    cols = method_step_columns([method])
    batches = round_batches(lake, round_)
    out = dict.fromkeys((k for k, _ in ITEMS), 0.0)

    def timed(key: str, fn):
        t0 = time.perf_counter()
        value = fn()
        out[key] += (time.perf_counter() - t0) * 1000
        return value

    import shutil

    shutil.rmtree(lake.partition_dir("credit_stats", round_), ignore_errors=True)
    stats = timed("statistics", lambda: round_statistics(lake, round_, cfg, batches))
    computes: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, b in enumerate(batches):
            paths = [lake.partition_dir(t, round_) / f"part-{b}.parquet" for t in ("steps", "trajectories")]
            reads = [
                ("floor_read", lambda p=paths: (pq.read_table(p[0], columns=cols), pq.read_table(p[1]))),
                (
                    "engine_read",
                    lambda b=b: (
                        read_batch(lake, "steps", round_, b, columns=cols),
                        read_batch(lake, "trajectories", round_, b),
                    ),
                ),
            ]
            for key, fn in reads if i % 2 else reversed(reads):
                steps, traj = timed(key, fn)
            before = out["compute"]
            tables, _ = timed(
                "compute",
                lambda t=traj, s=steps: process_batch(
                    t, s, [method], cfg, round_=round_, round_stats=stats or None
                ),
            )
            computes.append(out["compute"] - before)
            parts = {f"{b}.{m}": t for m, t in tables.items()}
            timed("lake_write", lambda parts=parts: lake.write_parts("advantages", round_, parts))
            for t in tables.values():
                stored = t.drop(["round"])
                timed(
                    "plain_write",
                    lambda t=stored: pq.write_table(t, Path(tmp) / "a.parquet", **write_options(t.schema)),
                )
            row = {f"credit.{b}": stage_run_row(round_, "credit", b, seconds=0.0)}
            timed("runlog", lambda row=row: record_stage_runs(lake, round_, row))
    out["first_batch"] = computes[0] - statistics.median(computes[1:]) if len(computes) > 1 else 0.0
    # the whole stage, steady state: run_stage against its items measured the same way right after, each the
    # fastest of PASSES passes over the batches (a difference of two timings: the passes keep the noise down)
    round_stats = statistics_json(stats) if stats else None
    whole = {b: float("inf") for b in batches}
    items = {b: float("inf") for b in batches}
    for _ in range(PASSES):
        for b in batches:
            t0 = time.perf_counter()
            run_stage(lake, round_, b, get_stage("credit"), cfg, round_stats=round_stats)
            t1 = time.perf_counter()
            traj = read_batch(lake, "trajectories", round_, b)
            steps = read_batch(lake, "steps", round_, b, columns=cols)
            tables, _ = process_batch(traj, steps, [method], cfg, round_=round_, round_stats=stats or None)
            lake.write_parts("advantages", round_, {f"{b}.{m}": t for m, t in tables.items()})
            record_stage_runs(lake, round_, {f"credit.{b}": stage_run_row(round_, "credit", b, seconds=0.0)})
            t2 = time.perf_counter()
            whole[b] = min(whole[b], (t1 - t0) * 1000)
            items[b] = min(items[b], (t2 - t1) * 1000)
    out["machinery"] = sum(whole.values()) - sum(items.values())
    return out


def _cell(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lake", help="a hive lake made by bench/credit.py --lake")
    ap.add_argument("--methods", default="grpo,gdpo,gae,turn_ppo")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/credit_breakdown.md"))
    ap.add_argument("--worker", nargs=2, metavar=("LAKE", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        emit(worker(*args.worker))
        return
    if not args.lake:
        ap.error("--lake is required (a hive lake made by bench/credit.py --lake DIR)")
    methods = [m for m in args.methods.split(",") if m]
    start = uptime()
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for rep in range(args.reps):
        for m in methods if rep % 2 == 0 else list(reversed(methods)):
            runs[m].append(run_worker(__file__, "--worker", args.lake, m))
            print(f"[{rep + 1}/{args.reps}] {m}", flush=True)
    headers = ["item", *[f"{m}: ms / round" for m in methods]]
    rows = [[label, *(_cell([r[key] for r in runs[m]]) for m in methods)] for key, label in ITEMS]

    def total(m: str, keys: tuple[str, ...]) -> list[float]:
        return [sum(r[k] for k in keys) for r in runs[m]]

    engine = ("engine_read", "compute", "lake_write", "runlog", "machinery", "statistics")
    floor = ("floor_read", "plain_write")
    rows.append(["**floor** (reads + plain write)", *(_cell(total(m, floor)) for m in methods)])
    rows.append(["**engine** (its items)", *(_cell(total(m, engine)) for m in methods)])
    ratio = [[e / f for e, f in zip(total(m, engine), total(m, floor), strict=True)] for m in methods]
    rows.append(["**x floor**", *(f"{min(r):.2f} / {statistics.median(r):.2f}" for r in ratio)])
    intro = (
        __doc__.split("\n\n", 2)[2].split("\n\nWrites")[0].replace("\n", " ")
        + f"\n\nLake: `{args.lake}`; {args.reps} repetitions. Load: `{start}` at the start, `{uptime()}` at the "
        f"end. {machine_note()}"
    )
    title = "What the credit engine spends beyond its I/O floor (bench/credit_breakdown.py)"
    report(args.out, title, intro, headers, rows)


if __name__ == "__main__":
    main()
