"""SQL over the steps table's derived columns (`n_tokens`, `values_mean`, `values_m2`), beside the code before.

The hive catalog's `steps` view derives those columns where a part lacks them (a lake written before them);
since the ninth session of #36 it does so only while a part lacks them (`warehouse.catalog._hold_all`, from the
parts' footers), so a query of a token count no longer reads every `token_ids`. Each cell is a fresh process of
one checkout (this one, or `--baseline`, a worktree of the code before): `connect(lake)` (the catalog built from
the lake, the footers read), then each query run `--runs` times (the fastest kept); cells interleaved, the
sides' order alternating, min / median over `--reps`.

    .venv/bin/python bench/sql_derived.py --lake LAKE --baseline WORKTREE [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUERIES = {
    "sum(n_tokens)": "SELECT sum(n_tokens) FROM steps",
    "sum(values_m2)": "SELECT sum(values_m2) FROM steps",
    "tokens per round": "SELECT round, sum(n_tokens) FROM steps GROUP BY round",
}
WORKER = """
import json, sys, time
t0 = time.perf_counter()
from warehouse.catalog import connect
con = connect(sys.argv[1])
out = {"connect": time.perf_counter() - t0}
for name, sql in json.loads(sys.argv[2]).items():
    best = None
    for _ in range(int(sys.argv[3])):
        t = time.perf_counter()
        con.execute(sql).fetchall()
        best = min(best or 1e9, time.perf_counter() - t)
    out[name] = best
print(json.dumps(out))
"""


def cell(root: Path, lake: str, runs: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", WORKER, lake, json.dumps(QUERIES), str(runs)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lake", required=True, help="a hive lake with a steps table")
    ap.add_argument("--baseline", type=Path, required=True, help="a worktree of the code before")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="runs of each query in a cell (the fastest kept)")
    args = ap.parse_args()
    sides = {"after": ROOT, "before": args.baseline}
    got: dict[str, list[dict]] = {s: [] for s in sides}
    for rep in range(args.reps):
        for side in list(sides)[:: 1 if rep % 2 == 0 else -1]:
            got[side].append(cell(sides[side], args.lake, args.runs))
    print(f"lake {args.lake}; {args.reps} repetitions, min / median ms; load {os.getloadavg()[0]:.2f}")
    print("| | " + " | ".join(sides) + " |")
    print("|---|" + "---|" * len(sides))
    for key in ["connect", *QUERIES]:
        row = [key]
        for side in sides:
            vals = [r[key] * 1000 for r in got[side]]
            row.append(f"{min(vals):.1f} / {statistics.median(vals):.1f}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
