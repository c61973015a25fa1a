"""Delta commits across many rounds in one long-lived process (#36): what `creditflow loop` and a Prefect worker
or API server that outlives its rounds do to the lake. Each round writes its batches' parts of one table, a
batch's method parts in one commit (`Lake.write_parts`, as the credit stage does), after the stage's checks of
what is there (`has_part`, `part_names`); the table's files grow by `methods` per commit, round after round.

Printed per side: ms per commit in the first and the last round (min / median over the round's commits), the
whole run's seconds, and the process's peak memory (VmHWM). "before" runs the same workload against a baseline
worktree's `warehouse` (`--baseline`), "after" this checkout's; each run is a fresh process on a fresh lake, the
sides interleaved, the order alternating; min / median over `--reps`.

    nice .venv/bin/python bench/delta_rounds.py [--rounds 12] [--batches 25] [--methods 4] [--rows 2000]
        [--reps 3] [--baseline WORKTREE] [--out bench/results/delta_rounds.md]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import emit, machine_note, md_table, peak_rss_mb, run_worker, uptime, write_md  # noqa: E402

TABLE = "bench_probe"  # no schema: the commit's cost is the log's, not the rows' validation


def worker(root: str, lake_dir: str, rounds: int, batches: int, methods: int, rows: int) -> None:
    sys.path.insert(0, str(Path(root).resolve()))
    import numpy as np
    import pyarrow as pa

    from warehouse.delta_lake import DeltaLake

    rng = np.random.default_rng(0)
    lens = rng.integers(50, 400, rows)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    adv = pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(rng.standard_normal(int(offsets[-1]), np.float32))
    )
    part = pa.table({"traj_id": pa.array([f"t{i:06d}" for i in range(rows)]), "advantages": adv})
    lake = DeltaLake(lake_dir)
    per_round: list[list[float]] = []
    t_all = time.perf_counter()
    for r in range(rounds):
        times = []
        for b in range(batches):
            t0 = time.perf_counter()
            names = {f"b{b:04d}.m{m}": part for m in range(methods)}
            if not all(lake.has_part(TABLE, r, n) for n in names):
                lake.write_parts(TABLE, r, names)
            times.append(time.perf_counter() - t0)
        assert len(lake.part_names(TABLE, r)) == batches * methods
        per_round.append(times)
    emit(
        {
            "total_s": time.perf_counter() - t_all,
            "first_ms": [1000 * t for t in per_round[0]],
            "last_ms": [1000 * t for t in per_round[-1]],
            "files": rounds * batches * methods,
            "commits": rounds * batches,
            "rss_mb": peak_rss_mb(),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batches", type=int, default=25)
    ap.add_argument("--methods", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline", help="a worktree of the code before (git worktree add ...)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "delta_rounds.md"))
    ap.add_argument("--worker", nargs=2, metavar=("ROOT", "LAKE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.rounds, args.batches, args.methods, args.rows)
        return
    shape = [f"--{k}={getattr(args, k)}" for k in ("rounds", "batches", "methods", "rows")]

    sides = {"after": str(ROOT)} | ({"before": args.baseline} if args.baseline else {})
    results: dict[str, list[dict]] = {s: [] for s in sides}
    load_before = uptime()
    for rep in range(args.reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for side in order:
            tmp = Path(tempfile.mkdtemp(prefix="creditflow-delta-rounds-"))
            try:
                res = run_worker(__file__, *shape, "--worker", sides[side], str(tmp / "lake"))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            results[side].append(res)
            print(
                f"rep {rep} {side}: {res['total_s']:.1f} s, last round "
                f"{statistics.median(res['last_ms']):.1f} ms/commit, {res['rss_mb']:.0f} MB",
                flush=True,
            )
    load_after = uptime()

    def mm(xs: list[float], fmt: str = "{:.1f}") -> str:
        return f"{fmt.format(min(xs))} / {fmt.format(statistics.median(xs))}"

    rows = []
    for side, runs in results.items():
        rows.append(
            [
                side,
                mm([min(r["first_ms"]) for r in runs])
                + " ; "
                + mm([statistics.median(r["first_ms"]) for r in runs]),
                mm([min(r["last_ms"]) for r in runs])
                + " ; "
                + mm([statistics.median(r["last_ms"]) for r in runs]),
                mm([r["total_s"] for r in runs]),
                mm([r["rss_mb"] for r in runs], "{:.0f}"),
            ]
        )
    r0 = next(iter(results.values()))[0]
    lines = [
        "# Delta commits across many rounds in one process",
        "",
        f"`python bench/delta_rounds.py {' '.join(sys.argv[1:])}`",
        "",
        f"{args.rounds} rounds x {args.batches} batches, {args.methods} parts per commit ({args.rows} rows each): "
        f"{r0['commits']} commits, {r0['files']} files at the end. Each cell: min / median over {args.reps} "
        "repetitions (a fresh process on a fresh lake each, the sides interleaved); per-commit cells: the "
        "round's fastest commit ; the round's median commit.",
        "",
        *md_table(
            ["side", "first round ms/commit", "last round ms/commit", "whole run s", "peak MB (VmHWM)"], rows
        ),
        "",
        f"{machine_note()}",
        f"Load before: {load_before}",
        f"Load after: {load_after}",
    ]
    print("\n".join(lines))
    write_md(args.out, lines)


if __name__ == "__main__":
    main()
