"""Benchmark TCPO.

1. The estimator without counterfactuals on the 16M-assistant-token synthetic round (512 groups x 8 samples
   x 10 turns x 400 tokens, `pipeline.synth`), batch by batch from a temporary lake, side by side with the
   Parquet I/O floor (read the batch's trajectories + steps, write one advantages part of the same shape).
   Target: tcpo end to end within 2x of the floor.
2. The counterfactual stage against the local stand-in server (tests/llm_standin.py) with a fixed
   per-request latency: achieved concurrency and efficiency = (requests x latency / concurrency) / wall.
   Target >= 0.8.

    python bench/tcpo.py [--groups 512 --samples 8 --turns 10 --tokens 400] [--cf-groups 32 --latency 1.0]

Run pinned to 2 cores (`taskset -c 0,1 python bench/tcpo.py`) to match CI."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# the project before bench/ (which holds a flows.py of its own) when this runs as `python bench/tcpo.py`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import cores as n_cores  # noqa: E402
from _common import machine_note, peak_rss_mb  # noqa: E402

from pipeline.config import Config  # noqa: E402
from pipeline.credit import CreditBatch, run_methods  # noqa: E402
from pipeline.credit.process import advantages_table  # noqa: E402
from pipeline.synth import SynthSettings, iter_batches  # noqa: E402
from warehouse.lake import Lake  # noqa: E402
from warehouse.rounds import batch_names, read_batch, write_round_parts  # noqa: E402


def bench_estimator(args) -> dict:
    s = SynthSettings(
        groups=args.groups,
        samples=args.samples,
        turns=args.turns,
        tokens=args.tokens,
        kind="mixed",
        batch_groups=args.batch_groups,
    )
    root = tempfile.mkdtemp(prefix="tcpo-bench-")
    try:
        lake = Lake(root)
        write_round_parts(lake, 0, iter_batches(s))
        names = batch_names(lake, 0)
        cfg = Config()
        floor = {"read": 0.0, "write": 0.0}
        tc = {"read": 0.0, "context": 0.0, "estimator": 0.0, "table": 0.0, "write": 0.0}
        n_tok = n_asst = 0
        for name in names:  # the I/O floor: read the batch, write an advantages part of the same shape
            t0 = time.perf_counter()
            traj = read_batch(lake, "trajectories", 0, name)
            steps = read_batch(lake, "steps", 0, name)
            floor["read"] += time.perf_counter() - t0
            n_tok += pc.sum(pc.list_value_length(steps.column("token_ids"))).as_py()
            ctx = CreditBatch.from_arrow(traj, steps, config=cfg)
            n_asst += int(ctx.tok_mask.sum())
            res = run_methods(ctx, ["grpo"])["grpo"]
            table = advantages_table(ctx, "floor", res)
            t0 = time.perf_counter()
            lake.write_part("advantages", 0, table, part=f"{name}.floor")
            floor["write"] += time.perf_counter() - t0
        for name in names:  # tcpo end to end: read, context, estimator, advantages table, write
            t0 = time.perf_counter()
            traj = read_batch(lake, "trajectories", 0, name)
            steps = read_batch(lake, "steps", 0, name)
            t1 = time.perf_counter()
            ctx = CreditBatch.from_arrow(traj, steps, config=cfg)
            t2 = time.perf_counter()
            res = run_methods(ctx, ["tcpo"])["tcpo"]
            t3 = time.perf_counter()
            table = advantages_table(ctx, "tcpo", res)
            t4 = time.perf_counter()
            lake.write_part("advantages", 0, table, part=f"{name}.tcpo")
            t5 = time.perf_counter()
            for key, dt in zip(tc, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                tc[key] += dt
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"batches": len(names), "tokens": n_tok, "assistant_tokens": n_asst, "floor": floor, "tcpo": tc}


def bench_cf(args) -> dict:
    """The stand-in runs in its own process (as a vLLM server would), so its CPU does not share our GIL."""
    import subprocess

    from flows.batch import stage_io
    from pipeline.counterfactual import counterfactual
    from pipeline.stages import execute

    tests = Path(__file__).resolve().parents[1] / "tests"
    code = (
        f"import sys, time; sys.path.insert(0, {str(tests)!r}); from llm_standin import StandIn; "
        f"s = StandIn(latency_s={args.latency}).start(); print(s.url, flush=True); time.sleep(3600)"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        cfg = Config(
            methods=["tcpo"],
            llm={"endpoints": [url], "cache": False, "concurrency": args.concurrency, "max_retries": 0},
            stages={"tcpo": {"L": 5, "M": 8}},
        )
        warm, wsteps = next(
            iter_batches(SynthSettings(groups=1, samples=2, turns=2, tokens=20, kind="search", seed=1))
        )
        io = stage_io(cfg)  # the flow's client and verifier pool
        execute(counterfactual(warm, wsteps, cfg, {}, io=io), io)  # imports, the first connection: untimed
        s = SynthSettings(
            groups=args.cf_groups, samples=8, turns=5, tokens=100, kind="search", batch_groups=args.cf_groups
        )
        traj, steps = next(iter_batches(s))
        t0 = time.perf_counter()
        out = execute(counterfactual(traj, steps, cfg, {}, io=io), io)
        wall = time.perf_counter() - t0
    finally:
        server.kill()
        server.wait()
    n = out.notes
    calls = int(n["llm_requests"])
    ideal = calls * args.latency / args.concurrency
    return {
        "requests": calls,
        "alternatives": out.tables["counterfactuals"].num_rows,
        "wall_s": wall,
        "ideal_s": ideal,
        "efficiency": ideal / wall if wall else float("nan"),
        "achieved_concurrency": calls * args.latency / wall,
        "concurrency": args.concurrency,
        "latency_s": args.latency,
        "notes": n,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--batch-groups", type=int, default=64)
    ap.add_argument("--cf-groups", type=int, default=32)
    ap.add_argument("--latency", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--skip-estimator", action="store_true")
    args = ap.parse_args()
    cores = n_cores()
    print(f"cores {cores}, numpy {np.__version__}, pyarrow {pa.__version__}")
    print(machine_note())
    if not args.skip_estimator:
        e = bench_estimator(args)
        f, t = e["floor"], e["tcpo"]
        floor_s, tcpo_s = sum(f.values()), sum(t.values())
        print(
            f"round: {args.groups} groups x {args.samples} samples x {args.turns} turns x {args.tokens} tokens, "
            f"{e['batches']} batches, tokens {e['tokens']:,} (assistant {e['assistant_tokens']:,})"
        )
        print(
            f"I/O floor (read + write advantages): {floor_s:7.2f} s  (read {f['read']:.2f}, write {f['write']:.2f})"
        )
        print(
            f"tcpo end to end:                     {tcpo_s:7.2f} s  "
            + ", ".join(f"{k} {v:.2f}" for k, v in t.items())
        )
        print(
            f"ratio tcpo / floor: {tcpo_s / floor_s:.2f}x;  estimator alone {e['tokens'] / t['estimator'] / 1e6:.1f} M tokens/s"
        )
    c = bench_cf(args)
    print(
        f"counterfactual stage: {c['requests']} requests (n=8), {c['alternatives']} alternatives, latency "
        f"{c['latency_s']} s, concurrency limit {c['concurrency']}: wall {c['wall_s']:.2f} s, ideal {c['ideal_s']:.2f} s, "
        f"efficiency {c['efficiency']:.2f}, achieved concurrency {c['achieved_concurrency']:.1f}"
    )
    n = c["notes"]
    llm_eff = c["requests"] * c["latency_s"] / c["concurrency"] / n["llm_wall_s"]
    print(
        f"  of which LLM phase {n['llm_wall_s']:.2f} s (efficiency {llm_eff:.2f}), verification {n['verify_wall_s']:.2f} s"
    )
    print(f"peak RSS {peak_rss_mb():.0f} MiB")


if __name__ == "__main__":
    main()
