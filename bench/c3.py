"""Benchmark C3 on the 16M-assistant-token synthetic round (512 groups x 8 samples x 10 turns x 400 tokens,
`pipeline.synth`, mixed Search-R1 / tool-calling groups), batch by batch, as users run it:

- detectors: the `detect` annotation stage (flows.batch.run_stage: read, detect_spans, write the spans
  part), once per round, shared by every method;
- per base method m: the credit stage with methods=[m] (read the steps columns m needs + trajectories, build the
  context, estimate, write m's advantages part) next to methods=[m+c3] (the same plus the spans
  and the logprobs c3 reads, the refiner, and the m+c3 part). Target: c3 adds at most 50% to the estimator's
  time, i.e. t(m+c3) <= 1.5 t(m).
- in memory, for reference: the estimator function alone and the c3 function alone on a built context.

    taskset -c 0,1 python bench/c3.py [--groups 512 ...] [--lake DIR] [--baseline WORKTREE] [--out FILE]

Each timing is its own subprocess (the fastest of --reps runs); `--baseline` times another checkout's engine on
the same lake, interleaved."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import emit, machine_note, md_table, peak_rss_mb, run_worker, write_md  # noqa: E402


def _settings(cfg, name: str):
    """A stage's settings by name; a --baseline tree from before #35's typed lookup has only config.stage."""
    lookup = getattr(cfg, "settings_named", None) or cfg.stage
    return lookup(name)


def worker_detect(lake_dir: str) -> dict:
    from flows.batch import round_batches, run_stage
    from pipeline.config import Config
    from pipeline.stages import get_stage
    from warehouse.lake import Lake

    lake, cfg = Lake(lake_dir), Config(lake=lake_dir)
    t0 = time.perf_counter()
    steps = spans = 0
    for b in round_batches(lake, 0):
        s = run_stage(lake, 0, b, get_stage("detect"), cfg)
        steps += s["steps"]
        spans += s["rows_out"]["spans"]
    return {"seconds": time.perf_counter() - t0, "steps": steps, "spans": spans, "rss_mb": peak_rss_mb()}


def worker_credit(lake_dir: str, method: str) -> dict:
    from flows.batch import round_batches, run_stage
    from pipeline.config import Config
    from pipeline.stages import get_stage
    from warehouse.lake import Lake

    lake, cfg = Lake(lake_dir), Config(lake=lake_dir, methods=[method])
    import pipeline.credit  # noqa: F401  (import time is not processing time)

    t0 = time.perf_counter()
    changed = 0.0
    for b in round_batches(lake, 0):
        s = run_stage(lake, 0, b, get_stage("credit"), cfg)
        changed += s["notes"].get(f"{method}.c3.tokens_changed", 0.0)
    return {"seconds": time.perf_counter() - t0, "changed": changed, "rss_mb": peak_rss_mb()}


def worker_memory(lake_dir: str, method: str) -> dict:
    """In memory: context built from the steps columns m+c3 reads; the estimator fn, then the c3 fn, timed."""
    import pipeline.credit as credit
    from flows.batch import round_batches
    from pipeline.config import Config
    from pipeline.credit.registry import ESTIMATORS, REFINERS, method_step_columns
    from warehouse.lake import Lake
    from warehouse.rounds import read_batch

    lake, cfg = Lake(lake_dir), Config(lake=lake_dir)
    est, c3 = ESTIMATORS[method], REFINERS["c3"]
    t_est = t_c3 = 0.0
    for b in round_batches(lake, 0):
        # the credit batch (#35), or a --baseline tree's CreditContext; both take these keywords
        batch_type = getattr(credit, "CreditBatch", None) or credit.CreditContext
        ctx = batch_type.from_arrow(
            read_batch(lake, "trajectories", 0, b),
            read_batch(lake, "steps", 0, b, columns=method_step_columns([f"{method}+c3"])),
            config=cfg,
            annotations={"spans": read_batch(lake, "spans", 0, b)},
        )
        t0 = time.perf_counter()
        base = est.fn(ctx, _settings(cfg, est.settings))
        t_est += time.perf_counter() - t0
        t0 = time.perf_counter()
        c3.fn(ctx, base, _settings(cfg, "c3"))
        t_c3 += time.perf_counter() - t0
    return {"estimator": t_est, "c3": t_c3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument(
        "--lake", type=Path, default=None, help="a lake with round 0 (bench/credit.py's); else synthesised"
    )
    ap.add_argument("--methods", default="grpo,gae")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline", type=Path, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "c3.md"))
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs="+")
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, str(Path(args.root).resolve()))
        kind, lake_dir, *rest = args.worker
        emit(
            {"detect": worker_detect, "credit": worker_credit, "memory": worker_memory}[kind](lake_dir, *rest)
        )
        return
    sys.path.insert(0, str(ROOT))
    lake_dir = args.lake or Path(tempfile.mkdtemp(prefix="c3-bench-"))
    if not (lake_dir / "steps" / "round=0").exists():
        from pipeline.synth import SynthSettings, iter_batches
        from warehouse.lake import Lake
        from warehouse.rounds import prefetched, write_round_parts

        s = SynthSettings(
            groups=args.groups,
            samples=args.samples,
            turns=args.turns,
            tokens=args.tokens,
            round=0,
            seed=0,
            batch_groups=64,
        )
        write_round_parts(Lake(lake_dir), 0, prefetched(iter_batches(s)))

    def best(*w: str, root: Path = ROOT) -> dict:
        runs = [run_worker(__file__, "--root", str(root), "--worker", *w) for _ in range(args.reps)]
        return min(runs, key=lambda r: r.get("seconds", r.get("estimator", 0.0)))

    det = best("detect", str(lake_dir))
    rows, mem_rows = [], []
    for m in args.methods.split(","):
        t = {}
        for label, root in ((("before", args.baseline),) if args.baseline else ()) + (("after", ROOT),):
            t[label] = (
                best("credit", str(lake_dir), m, root=root),
                best("credit", str(lake_dir), f"{m}+c3", root=root),
            )
        for label, (e, c) in t.items():
            add = c["seconds"] / e["seconds"] - 1
            rows.append(
                [
                    label,
                    m,
                    f"{e['seconds']:.2f}",
                    f"{c['seconds']:.2f}",
                    f"+{100 * add:.0f}%",
                    "meets" if add <= 0.5 else "misses",
                    f"{c['changed']:,.0f}",
                ]
            )
            print(rows[-1], flush=True)
        mem = best("memory", str(lake_dir), m)
        mem_rows.append(
            [m, f"{mem['estimator']:.2f}", f"{mem['c3']:.2f}", f"+{100 * mem['c3'] / mem['estimator']:.0f}%"]
        )
    lines = [
        "# C3 benchmark",
        "",
        f"Round: {args.groups} groups x {args.samples} samples x {args.turns} turns x ~{args.tokens} tokens (mixed "
        "search/tool, pipeline.synth), batches of 64 groups, processed as `creditflow process` does "
        "(flows.batch).",
        machine_note() + f" Each time is its own subprocess, the fastest of {args.reps} runs.",
        "",
        f"Detectors (the `detect` stage: read, detect_spans, write spans; once per round, shared by every method): "
        f"{det['seconds']:.2f} s, {det['steps'] / det['seconds'] / 1e3:.0f}k steps/s, {det['spans']:,} spans.",
        "",
        "The estimator's time = the credit stage (flows.batch.run_stage) with methods=[m] (read the steps columns m needs + trajectories, "
        "context, estimate, write m's advantages part); with c3 = methods=[m+c3] (also reads the spans and the "
        "logprobs c3 needs, refines, writes the m+c3 part). Target: c3 adds at most 50%.",
        "",
        *md_table(["code", "method", "m alone s", "m+c3 s", "c3 adds", "target", "tokens changed"], rows),
        "",
        "In memory, on a context already built (the functions alone; the estimator broadcast is the cheap part of a "
        "trajectory-level method, so this ratio says little about what users wait for):",
        "",
        *md_table(["method", "estimator fn s", "c3 fn s", "c3 / estimator"], mem_rows),
    ]
    write_md(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
