"""Benchmark `creditflow synth`: a 16M-assistant-token round (512 groups x 8 samples x 10 turns x 400 tokens)
generated and written into a temporary lake, batch by batch. Prints the times, tokens/s and peak RSS.

    python bench/synth.py [--groups 512 --samples 8 --turns 10 --tokens 400 --kind mixed --batch-groups 64]

Run it pinned to 2 cores (`taskset -c 0,1 python bench/synth.py`) to match CI."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import pyarrow.compute as pc
from _common import cores as n_cores
from _common import peak_rss_mb

from pipeline.synth import SynthSettings, iter_batches
from warehouse.lake import Lake
from warehouse.rounds import prefetched, write_round_parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--kind", default="mixed")
    ap.add_argument("--batch-groups", type=int, default=64)
    args = ap.parse_args()
    s = SynthSettings(
        groups=args.groups,
        samples=args.samples,
        turns=args.turns,
        tokens=args.tokens,
        kind=args.kind,
        batch_groups=args.batch_groups,
    )
    cores = n_cores()

    # 1. generation only (tables built, then dropped)
    t0 = time.perf_counter()
    n_tok = n_asst = n_steps = 0
    for _, steps in iter_batches(s):
        lens = pc.list_value_length(steps.column("token_ids"))
        n_tok += pc.sum(lens).as_py()
        n_asst += pc.sum(pc.if_else(pc.equal(steps.column("role"), "assistant"), lens, 0)).as_py()
        n_steps += steps.num_rows
    gen_s = time.perf_counter() - t0

    # 2. generation + validation + Parquet write into a lake (what `creditflow synth` does)
    root = tempfile.mkdtemp(prefix="synth-bench-")
    try:
        t0 = time.perf_counter()
        parts = write_round_parts(Lake(root), 0, prefetched(iter_batches(s)))
        total_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Lake(root).root.rglob("*.parquet"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rss_mb = peak_rss_mb()
    print(
        f"round: {args.groups} groups x {args.samples} samples x {args.turns} turns x {args.tokens} tokens "
        f"({args.kind}), batch_groups {args.batch_groups}, {cores} cores"
    )
    print(
        f"steps {n_steps:,}  tokens {n_tok:,} (assistant {n_asst:,})  parts {len(parts)}  parquet {size / 2**20:.0f} MiB"
    )
    print(f"generate only:            {gen_s:6.2f} s  {n_tok / gen_s / 1e6:6.2f} M tokens/s")
    print(f"generate+validate+write:  {total_s:6.2f} s  {n_tok / total_s / 1e6:6.2f} M tokens/s")
    print(f"peak RSS:                 {rss_mb:6.0f} MiB")


if __name__ == "__main__":
    main()
