"""The advantages table's list columns (issue #36: gae's token_adv and token_returns in one pass), compute only:
`advantages_table` alone and `process_batch` (batch + estimate + table, bench/credit.py's compute cell) on one
in-memory batch of a synthetic round, this checkout beside a baseline worktree, interleaved.

    git worktree add /tmp/base REV
    python bench/credit_columns.py --baseline /tmp/base [--groups 64 --samples 8 --turns 4 --tokens 300] [--reps 5]

Each measurement is its own subprocess importing the side's code; a measurement is the min of `--inner` calls
after a warm-up call; the table shows min / median over `--reps` interleaved repetitions."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["gae", "turn_ppo", "grpo"]


def worker(lake_dir: str, method: str, inner: int) -> dict:
    """In the side's interpreter (its checkout first on sys.path): the two timings on the round's first batch."""
    from flows.batch import round_batches
    from pipeline.config import Config
    from pipeline.credit.batch import CreditBatch
    from pipeline.credit.process import advantages_table, process_batch
    from pipeline.credit.registry import method_step_columns, run_methods
    from warehouse.lake import Lake
    from warehouse.rounds import read_batch

    lake, cfg = Lake(lake_dir), Config(lake=lake_dir, methods=[method])
    part = round_batches(lake, 0)[0]
    traj = read_batch(lake, "trajectories", 0, part)
    steps = read_batch(lake, "steps", 0, part, columns=method_step_columns([method]))
    batch = CreditBatch.from_arrow(traj, steps, method_step_columns([method]), config=cfg, round_=0)
    result = run_methods(batch, [method])[method]
    advantages_table(batch, method, result)  # warm-up: lazy imports, the heap's first growth
    process_batch(traj, steps, [method], cfg, round_=0)
    table, whole = [], []
    for _ in range(inner):
        t0 = time.perf_counter()
        advantages_table(batch, method, result)
        table.append(time.perf_counter() - t0)
    for _ in range(max(1, inner // 3)):
        t0 = time.perf_counter()
        process_batch(traj, steps, [method], cfg, round_=0)
        whole.append(time.perf_counter() - t0)
    return {"table_s": min(table), "batch_s": min(whole), "tokens": batch.n_tokens}


def _run(root: Path, lake: Path, method: str, inner: int) -> dict:
    code = (
        f"import sys, json; sys.path.insert(0, {str(root)!r}); sys.path.append({str(ROOT / 'bench')!r}); "
        f"from credit_columns import worker; print(json.dumps(worker({str(lake)!r}, {method!r}, {inner})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"worker failed ({root}, {method}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cell(values: list[float]) -> str:
    return f"{min(values) * 1e3:.2f} / {statistics.median(values) * 1e3:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="a worktree of the code before the change")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions per side and method")
    p.add_argument("--inner", type=int, default=9, help="calls per measurement (the min is kept)")
    p.add_argument("--methods", default=",".join(METHODS))
    args = p.parse_args()
    sides = {"before": Path(args.baseline).resolve(), "after": ROOT}
    with tempfile.TemporaryDirectory(prefix="credit-columns-") as tmp:
        lake = Path(tmp) / "lake"
        synth = ["synth", "--groups", str(args.groups), "--batch-groups", str(args.groups), "--samples"]
        synth += [
            str(args.samples),
            "--turns",
            str(args.turns),
            "--tokens",
            str(args.tokens),
            "--out",
            str(lake),
        ]
        code = f"import sys; sys.argv = ['creditflow'] + {synth!r}; from flows.cli import app; app()"
        env_note = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.reps):
            for method in args.methods.split(","):
                for side, root in sides.items():
                    runs.setdefault((side, method), []).append(_run(root, lake, method, args.inner))
        env_end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    tokens = runs[("after", args.methods.split(",")[0])][0]["tokens"]
    print(
        f"{tokens:,} tokens in one batch; {args.reps} interleaved reps x {args.inner} calls; ms min / median"
    )
    print(f"load at start: {env_note}\nload at end:   {env_end}\n")
    print("| method | advantages_table before | after | after/before (min) | process_batch before | after |")
    print("|---|---|---|---|---|---|")
    for method in args.methods.split(","):
        b, a = runs[("before", method)], runs[("after", method)]
        bt, at = [r["table_s"] for r in b], [r["table_s"] for r in a]
        ratio = min(at) / min(bt)
        row = [method, _cell(bt), _cell(at), f"{ratio:.2f}", _cell([r["batch_s"] for r in b])]
        print("| " + " | ".join(row + [_cell([r["batch_s"] for r in a])]) + " |")


if __name__ == "__main__":
    main()
