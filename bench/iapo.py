"""Benchmark IAPO on the 16M-assistant-token synthetic round (512 groups x 8 samples x 10 turns x 400 tokens,
`pipeline.synth`, mixed Search-R1 / tool-calling groups), batch by batch:

1. routing with a given graph: the rules annotator's output (its own time reported apart), then the `iapo`
   refiner after grpo, side by side with the Parquet I/O floor of the data it produces (write + read back the
   method's `advantages` part with the lake's zstd Parquet). Target: iapo within 2x of the floor.
2. the llm annotator stage against the local stand-in server (tests/llm_standin.py) with a fixed latency:
   throughput vs ideal concurrency (ceil(n / concurrency) x latency). Target: >= 0.8 of ideal.

    python bench/iapo.py [--groups 512 --samples 8 --turns 10 --tokens 400 --batch-groups 64] [--out FILE]

Run pinned to 2 cores (`taskset -c 0,1 python bench/iapo.py`) to match CI."""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import machine_note

from pipeline.annotate.rules import annotate_rules
from pipeline.config import Config
from pipeline.credit import CreditBatch
from pipeline.credit.process import advantages_table
from pipeline.credit.registry import ESTIMATORS, REFINERS
from pipeline.synth import SynthSettings, iter_batches
from warehouse.lake import Lake


def bench_routing(args) -> tuple[list[str], dict]:
    s = SynthSettings(
        groups=args.groups,
        samples=args.samples,
        turns=args.turns,
        tokens=args.tokens,
        kind="mixed",
        batch_groups=args.batch_groups,
    )
    cfg = Config()
    grpo, iapo = ESTIMATORS["grpo"], REFINERS["iapo"]
    t = dict.fromkeys(["annotate", "ctx", "grpo", "iapo", "table", "io"], 0.0)
    n_tok = n_asst = n_traj = n_steps = n_edges = 0
    w_all = []
    lake = Lake(tempfile.mkdtemp(prefix="iapo-bench-"))
    for b, (traj, steps) in enumerate(iter_batches(s)):
        t0 = time.perf_counter()
        nodes, edges, _ = annotate_rules(steps)
        t["annotate"] += time.perf_counter() - t0
        n_edges += edges.num_rows
        t0 = time.perf_counter()
        ctx = CreditBatch.from_arrow(traj, steps, config=cfg, annotations={"nodes": nodes, "edges": edges})
        t["ctx"] += time.perf_counter() - t0
        n_tok += ctx.n_tokens
        n_asst += int(ctx.tok_mask.sum())
        n_traj += ctx.n_traj
        n_steps += ctx.n_steps
        t0 = time.perf_counter()
        base = grpo.fn(ctx, cfg.settings_named("grpo"))
        t["grpo"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = iapo.fn(ctx, base, cfg.settings_named("iapo"))
        t["iapo"] += time.perf_counter() - t0
        w = out.components["w"]
        w_all.append(w[~np.isnan(w)])
        t0 = time.perf_counter()
        table = advantages_table(ctx, "grpo+iapo", out)
        t["table"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        path = lake.write_part("advantages", 0, table, part=f"b{b:05d}.grpo-iapo")
        lake.read("advantages", 0, parts=[path])
        t["io"] += time.perf_counter() - t0
    w = np.concatenate(w_all) if w_all else np.zeros(0)
    ratio = t["iapo"] / t["io"] if t["io"] else float("nan")
    lines = [
        "## Routing with a given graph (rules annotator output)",
        "",
        f"Synthetic round: {args.groups} groups x {args.samples} samples x {args.turns} turns x {args.tokens} "
        f"tokens (mixed search/tool), batches of {args.batch_groups} groups: {n_traj} trajectories, {n_steps} "
        f"steps, {n_tok / 1e6:.1f}M tokens ({n_asst / 1e6:.1f}M assistant); {n_edges} edges from the rules "
        "annotator.",
        "",
        "| stage | seconds | note |",
        "|---|---|---|",
        f"| rules annotator (annotate_rules) | {t['annotate']:.2f} | {n_steps / t['annotate'] / 1e3:.1f}k steps/s "
        "(per-step text work), reported apart |",
        f"| CreditBatch.from_arrow | {t['ctx']:.2f} | shared by every method |",
        f"| grpo (base estimator) | {t['grpo']:.2f} | |",
        f"| **iapo refiner** (features, Eq. 4-7, token broadcast) | **{t['iapo']:.2f}** | "
        f"{n_asst / t['iapo'] / 1e6:.0f}M assistant tokens/s |",
        f"| advantages_table (Arrow layout) | {t['table']:.2f} | |",
        f"| Parquet I/O floor (write + read the grpo+iapo advantages parts, zstd) | {t['io']:.2f} | |",
        "",
        f"iapo / I/O floor = {ratio:.2f}x ({'meets' if ratio <= 2 else 'misses'} the <= 2x target).",
        f"Routing weights on actions: std {w.std():.3f}, min {w.min():.3f}, max {w.max():.3f}, "
        f"{100 * np.mean(np.abs(w - 1) > 0.1):.1f}% moved > 10% from flat (all branches, A_hat = 0 gives w = 1).",
        "",
    ]
    return lines, {"iapo_s": t["iapo"], "io_s": t["io"], "ratio": ratio}


_SERVER = """
import json, sys, time
sys.path.insert(0, {tests!r})
from llm_standin import StandIn
reply = json.dumps({{"actions": [{{"action_id": 1, "error": 0, "error_kind": "none", "sources": []}}]}})
with StandIn(lambda body, kind, i: reply, latency_s={latency}) as server:
    print(server.url, flush=True)
    sys.stdin.read()
"""


def bench_llm(n_traj: int, latency: float, concurrency: int) -> tuple[list[str], dict]:
    """The stand-in runs in its own process (as a real server would), so it does not share the GIL."""
    import subprocess

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's flows/, not bench/flows.py
    from flows.batch import stage_io
    from pipeline.annotate.llm import annotate_llm

    s = SynthSettings(
        groups=max(1, n_traj // 8), samples=8, turns=6, tokens=200, kind="tool", batch_groups=64
    )
    traj, steps = next(iter_batches(s))
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER.format(tests=tests, latency=latency)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        cfg = Config(
            annotator="llm",
            llm={"endpoints": [url], "cache": False, "concurrency": concurrency, "max_retries": 0},
        )
        annotate_llm(steps.slice(0, 50), cfg, io=stage_io(cfg))  # warm up (imports, model name)
        t0 = time.perf_counter()
        out = annotate_llm(steps, cfg, io=stage_io(cfg))
        elapsed = time.perf_counter() - t0
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    n = traj.num_rows
    ideal = math.ceil(n / concurrency) * latency
    eff = ideal / elapsed
    lines = [
        "## llm annotator stage against the stand-in server",
        "",
        f"{n} trajectories (one request each, ~{steps.num_rows // n} messages per transcript), stand-in latency "
        f"{latency:.2f} s in its own process, client concurrency {concurrency}: {elapsed:.2f} s; ideal "
        f"ceil({n}/{concurrency}) x {latency:.2f} = {ideal:.2f} s; efficiency **{eff:.2f}** "
        f"({'meets' if eff >= 0.8 else 'misses'} the >= 0.8 target); llm calls "
        f"{int(out.notes.get('llm_calls', 0))}, parse failures {int(out.notes.get('parse_failures', 0))}.",
        "",
    ]
    return lines, {"llm_eff": eff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--batch-groups", type=int, default=64)
    ap.add_argument("--llm-trajectories", type=int, default=256)
    ap.add_argument("--llm-latency", default="2.0,0.25", help="stand-in latencies (s), comma-separated")
    ap.add_argument("--llm-concurrency", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-routing", action="store_true", help="only the llm annotator part")
    args = ap.parse_args()
    lines = ["# IAPO benchmark", "", machine_note() + " `taskset -c 0,1 python bench/iapo.py`.", ""]
    r_lines = [] if args.skip_routing else bench_routing(args)[0]
    l_lines = []
    for k, lat in enumerate(float(x) for x in args.llm_latency.split(",")):
        part, _ = bench_llm(args.llm_trajectories, lat, args.llm_concurrency)
        l_lines += part if k == 0 else part[2:]
    text = "\n".join(lines + r_lines + l_lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
