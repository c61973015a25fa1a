"""Credit-engine benchmark: every estimator on a synthetic round, next to the Parquet I/O floor and the
per-trajectory Python reference (tests/test_credit_reference.py).

    python bench/credit.py [--groups 512 --samples 8 --turns 10 --tokens 400] [--lake DIR] [--double]

Each measurement runs in its own subprocess (peak RSS = that process's ru_maxrss), processing the round batch
by batch with flows.process_round.process_credit_batch, as `creditflow process` does. The reference is timed
on a subsample of groups and extrapolated by assistant tokens. Results: bench/results/credit.md."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
METHODS = ["grpo", "rloo", "gdpo", "gae", "turn_ppo", "mt_grpo", "gigpo"]
# steps columns each method reads (the I/O floor reads exactly these)
NEEDS = {
    "grpo": ["traj_id", "step_idx", "role", "turn", "token_ids"],
    "rloo": ["traj_id", "step_idx", "role", "turn", "token_ids"],
    "gdpo": ["traj_id", "step_idx", "role", "turn", "token_ids"],
    "gae": ["traj_id", "step_idx", "role", "turn", "token_ids", "values"],
    "turn_ppo": ["traj_id", "step_idx", "role", "turn", "token_ids", "values"],
    "mt_grpo": ["traj_id", "step_idx", "role", "turn", "token_ids", "verifier_score"],
    "gigpo": ["traj_id", "step_idx", "role", "turn", "token_ids", "verifier_score", "content", "is_error"],
}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_round(lake_dir: Path, round_: int, groups: int, samples: int, turns: int, tokens: int) -> dict:
    from pipeline.synth import SynthSettings, iter_batches
    from warehouse.lake import Lake
    from warehouse.rounds import write_round_parts

    s = SynthSettings(groups=groups, samples=samples, turns=turns, tokens=tokens, round=round_, seed=round_,
                      batch_groups=64)
    t0 = time.perf_counter()
    names = write_round_parts(Lake(lake_dir), round_, iter_batches(s, prefetch=True))
    return {"batches": len(names), "seconds": time.perf_counter() - t0}


def worker_engine(lake_dir: Path, round_: int, method: str) -> dict:
    from flows.process_round import process_credit_batch, round_batches
    from pipeline.config import Config
    from warehouse.lake import Lake

    lake = Lake(lake_dir)
    cfg = Config(lake=str(lake_dir), methods=[method])
    import pipeline.credit  # noqa: F401  (import time is not processing time)

    t0 = time.perf_counter()
    tokens = 0
    for b in round_batches(lake, round_):
        tokens += process_credit_batch(lake, round_, b, [method], cfg).tokens
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "rss_mb": peak_rss_mb()}


def worker_floor(lake_dir: Path, round_: int, method: str) -> dict:
    """Read the steps columns the method needs + trajectories, write its advantages part (same compression)."""
    import pyarrow.parquet as pq

    from flows.process_round import advantages_part, round_batches
    from warehouse.lake import COMPRESSION, Lake

    lake = Lake(lake_dir)
    seconds = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for b in round_batches(lake, round_):
            adv = pq.read_table(lake.partition_dir("advantages", round_) / f"part-{advantages_part(b, method)}.parquet")
            t0 = time.perf_counter()
            pq.read_table(lake.partition_dir("steps", round_) / f"part-{b}.parquet", columns=NEEDS[method])
            pq.read_table(lake.partition_dir("trajectories", round_) / f"part-{b}.parquet")
            pq.write_table(adv, Path(tmp) / "adv.parquet", compression=COMPRESSION)
            seconds += time.perf_counter() - t0
            del adv
    return {"seconds": seconds, "rss_mb": peak_rss_mb()}


def worker_reference(lake_dir: Path, round_: int, method: str, sample_groups: int) -> dict:
    """The per-trajectory reference on the first `sample_groups` groups of the first batch."""
    import pyarrow.compute as pc

    sys.path.insert(0, str(ROOT / "tests"))
    import test_credit_reference as ref

    from flows.process_round import round_batches
    from warehouse.lake import Lake
    from warehouse.rounds import read_batch

    lake = Lake(lake_dir)
    b = round_batches(lake, round_)[0]
    traj = read_batch(lake, "trajectories", round_, b)
    groups = pc.unique(traj.column("group_id")).slice(0, sample_groups)
    traj = traj.filter(pc.is_in(traj.column("group_id"), value_set=groups))
    steps = read_batch(lake, "steps", round_, b)
    steps = steps.filter(pc.is_in(steps.column("traj_id"), value_set=traj.column("traj_id")))
    is_asst = pc.equal(steps.column("role"), "assistant")
    tokens = int(pc.sum(pc.list_value_length(steps.filter(is_asst).column("token_ids"))).as_py())
    t0 = time.perf_counter()
    trajs, by_traj, grp = ref.load(traj, steps)
    result = {
        "grpo": lambda: ref.ref_grpo(trajs, by_traj, grp),
        "rloo": lambda: ref.ref_rloo(trajs, by_traj, grp),
        "gdpo": lambda: ref.ref_gdpo(trajs, by_traj, grp),
        "gae": lambda: ref.ref_gae(trajs, by_traj),
        "turn_ppo": lambda: ref.ref_turn_ppo(trajs, by_traj),
        "mt_grpo": lambda: ref.ref_mt_grpo(trajs, by_traj, grp),
        "gigpo": lambda: ref.ref_gigpo(trajs, by_traj, grp),
    }[method]()
    out = result[0] if isinstance(result, tuple) else result
    ref.token_layout(trajs, by_traj, out)  # the per-token advantages, as the engine produces
    return {"seconds": time.perf_counter() - t0, "assistant_tokens": tokens}


def sub(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{args}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def assistant_tokens(lake_dir: Path, round_: int) -> tuple[int, int]:
    import duckdb

    path = f"{lake_dir}/steps/round={round_}/*.parquet"
    a, t = duckdb.sql(f"SELECT sum(len(token_ids)) FILTER (WHERE role = 'assistant'), sum(len(token_ids)) "
                      f"FROM read_parquet('{path}')").fetchall()[0]
    return int(a), int(t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=512)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--lake", type=Path, default=None)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ref-groups", type=int, default=2)
    p.add_argument("--double", action="store_true", help="also run a round of twice the groups (RSS growth)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "credit.md")
    p.add_argument("--worker", nargs=4, metavar=("KIND", "LAKE", "ROUND", "METHOD"))
    args = p.parse_args()
    if args.worker:
        kind, lake_dir, round_, method = args.worker
        fn = {"engine": worker_engine, "floor": worker_floor}.get(kind)
        res = fn(Path(lake_dir), int(round_), method) if fn else worker_reference(
            Path(lake_dir), int(round_), method, args.ref_groups)
        print(json.dumps(res))
        return

    lake_dir = args.lake or Path(tempfile.mkdtemp(prefix="creditflow-bench-"))
    methods = [m for m in args.methods.split(",") if m]
    rounds = [(0, args.groups)] + ([(1, 2 * args.groups)] if args.double else [])
    for r, g in rounds:
        if not (lake_dir / "steps" / f"round={r}").exists():
            info = make_round(lake_dir, r, g, args.samples, args.turns, args.tokens)
            print(f"round {r}: {g} groups synthesised in {info['seconds']:.1f} s", flush=True)
    asst, total = assistant_tokens(lake_dir, 0)
    lines = [
        "# Credit engine benchmark",
        "",
        f"Round: {args.groups} groups x {args.samples} samples x {args.turns} turns x ~{args.tokens} tokens "
        f"(pipeline/synth.py, kind=mixed): {asst:,} assistant tokens, {total:,} tokens in all; "
        f"batches of 64 groups, processed one by one with flows.process_round.process_credit_batch "
        f"(read steps + trajectories, build the context, estimate, write the advantages part).",
        f"Machine: {os.cpu_count()} CPUs. Each row is its own subprocess; peak RSS is its ru_maxrss.",
        "",
        "I/O floor: pyarrow only, read the steps columns the method needs + the trajectories, write the "
        "method's advantages part with the lake's compression (zstd). Reference: the per-trajectory Python "
        f"oracle of tests/test_credit_reference.py, timed on {args.ref_groups} groups of the first batch and "
        "**extrapolated** to the round by assistant tokens.",
        "",
        "| method | wall s | assistant tok/s | peak RSS MB | I/O floor s | x floor | reference s (extrap.) "
        "| x faster than ref |" + (" RSS MB at 2x round |" if args.double else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if args.double else ""),
    ]
    for m in methods:
        e = sub("--worker", "engine", str(lake_dir), "0", m)
        f = sub("--worker", "floor", str(lake_dir), "0", m)
        rf = sub("--ref-groups", str(args.ref_groups), "--worker", "reference", str(lake_dir), "0", m)
        ref_s = rf["seconds"] * asst / max(rf["assistant_tokens"], 1)
        row = (f"| {m} | {e['seconds']:.2f} | {asst / e['seconds']:,.0f} | {e['rss_mb']:.0f} | {f['seconds']:.2f} "
               f"| {e['seconds'] / f['seconds']:.2f} | {ref_s:.0f} | {ref_s / e['seconds']:.0f} |")
        if args.double:
            e2 = sub("--worker", "engine", str(lake_dir), "1", m)
            row += f" {e2['rss_mb']:.0f} ({e2['seconds']:.1f} s) |"
        print(row, flush=True)
        lines.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
