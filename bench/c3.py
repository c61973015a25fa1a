"""Benchmark C3 on the 16M-assistant-token synthetic round (512 groups x 8 samples x 10 turns x 400 tokens,
`pipeline.synth`, mixed Search-R1 / tool-calling groups), batch by batch in memory:

- detectors (`detect_spans`: per-step regex + the vectorised char->token mapping), timed on their own;
- each base estimator alone (grpo, gae) vs the c3 refiner on its result. Target: c3 adds <= 50% to the
  estimator's time.

    python bench/c3.py [--groups 512 --samples 8 --turns 10 --tokens 400 --batch-groups 64] [--out FILE]

Run pinned to 2 cores (`taskset -c 0,1 python bench/c3.py`) to match CI."""

from __future__ import annotations

import argparse
import platform
import time
from collections import Counter
from pathlib import Path

import numpy as np

from pipeline.config import Config
from pipeline.credit import CreditContext
from pipeline.credit.registry import ESTIMATORS, REFINERS
from pipeline.detect import DetectSettings, detect_spans
from pipeline.synth import SynthSettings, iter_batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--batch-groups", type=int, default=64)
    ap.add_argument("--methods", default="grpo,gae")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    s = SynthSettings(groups=args.groups, samples=args.samples, turns=args.turns, tokens=args.tokens,
                      kind="mixed", batch_groups=args.batch_groups)
    cfg = Config()
    c3 = REFINERS["c3"]
    methods = args.methods.split(",")
    t_detect = t_ctx = 0.0
    t_est = dict.fromkeys(methods, 0.0)
    t_c3 = dict.fromkeys(methods, 0.0)
    n_tok = n_asst = n_traj = n_steps = 0
    behaviours: Counter = Counter()
    changed = dict.fromkeys(methods, 0)
    for traj, steps in iter_batches(s):
        t0 = time.perf_counter()
        spans, notes = detect_spans(traj, steps, DetectSettings())
        t_detect += time.perf_counter() - t0
        behaviours.update({k: int(v) for k, v in notes.items() if k.startswith("spans.")})
        t0 = time.perf_counter()
        ctx = CreditContext.from_arrow(traj, steps, config=cfg, annotations={"spans": spans})
        t_ctx += time.perf_counter() - t0
        n_tok += ctx.n_tokens
        n_asst += int(ctx.tok_mask.sum())
        n_traj += ctx.n_traj
        n_steps += ctx.n_steps
        for m in methods:
            est = ESTIMATORS[m]
            t0 = time.perf_counter()
            base = est.fn(ctx, cfg.stage(est.settings))
            t_est[m] += time.perf_counter() - t0
            t0 = time.perf_counter()
            out = c3.fn(ctx, base, cfg.stage("c3"))
            t_c3[m] += time.perf_counter() - t0
            changed[m] += int(np.count_nonzero(out.token_adv != base.token_adv))
    lines = [
        "# C3 benchmark",
        "",
        f"Synthetic round: {args.groups} groups x {args.samples} samples x {args.turns} turns x {args.tokens} "
        f"tokens (mixed search/tool), batches of {args.batch_groups} groups: {n_traj} trajectories, {n_steps} "
        f"steps, {n_tok / 1e6:.1f}M tokens ({n_asst / 1e6:.1f}M assistant).",
        f"Machine: {platform.processor() or platform.machine()}, python {platform.python_version()}.",
        "",
        f"Spans found: {sum(behaviours.values())} "
        f"({', '.join(f'{k[6:]} {v}' for k, v in sorted(behaviours.items()) if k != 'spans')}).",
        "",
        "| stage | seconds | note |",
        "|---|---|---|",
        f"| detectors (detect_spans) | {t_detect:.2f} | {n_steps / t_detect / 1e3:.0f}k steps/s, reported separately |",
        f"| CreditContext.from_arrow | {t_ctx:.2f} | shared by every method |",
    ]
    for m in methods:
        ratio = t_c3[m] / t_est[m] if t_est[m] else float("nan")
        verdict = "meets" if ratio <= 0.5 else "misses"
        lines.append(f"| {m} (estimator alone) | {t_est[m]:.2f} | |")
        lines.append(f"| c3 after {m} | {t_c3[m]:.2f} | +{100 * ratio:.0f}% of {m} ({verdict} the <= 50% target); "
                     f"{changed[m]} tokens changed |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
