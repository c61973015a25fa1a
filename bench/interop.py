"""Benchmark the export layouts: the synthetic round (default 512 groups x 8 samples x 10 turns x 400 tokens,
~16M assistant tokens) written to a temporary lake and processed with grpo batch by batch, then exported per
batch in each layout (flat Parquet-ready table vs verl / openrlhf / skyrl padded arrays + np.savez). Prints time
and the peak RSS of each layout, each measured in a fresh child process.

    python bench/interop.py [--groups 512 --samples 8 --turns 10 --tokens 400 --batch-groups 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import tempfile
import time

import pyarrow.compute as pc


def _export(root: str, layout: str, q) -> None:
    import pyarrow.parquet as pq

    from pipeline.export import build_train_batch
    from pipeline.layouts import save_padded, to_padded
    from warehouse.lake import Lake
    from warehouse.rounds import batch_names, read_batch

    lake = Lake(root)
    t_build = t_layout = 0.0
    n_tok = 0
    out = os.path.join(root, f"out-{layout}")
    for name in batch_names(lake, 0):
        traj, steps = read_batch(lake, "trajectories", 0, name), read_batch(lake, "steps", 0, name)
        adv = read_batch(lake, "advantages", 0, f"{name}.grpo")
        adv = adv.filter(pc.equal(adv.column("method"), "grpo"))
        t0 = time.perf_counter()
        batch = build_train_batch(traj, steps, adv)
        t_build += time.perf_counter() - t0
        n_tok += int(pc.sum(pc.list_value_length(batch.column("input_ids"))).as_py())
        t0 = time.perf_counter()
        if layout == "flat":
            pq.write_table(batch, f"{out}-{name}.parquet", compression="zstd")
        else:
            save_padded(to_padded(batch, layout), f"{out}-{name}.npz")
        t_layout += time.perf_counter() - t0
    q.put((layout, t_build, t_layout, n_tok, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--batch-groups", type=int, default=64)
    args = ap.parse_args()

    from flows.batch import process_credit_batch
    from pipeline.config import load_config
    from pipeline.synth import SynthSettings, iter_batches
    from warehouse.lake import Lake
    from warehouse.rounds import batch_names, write_round_parts

    s = SynthSettings(groups=args.groups, samples=args.samples, turns=args.turns, tokens=args.tokens,
                      batch_groups=args.batch_groups)
    root = tempfile.mkdtemp(prefix="interop-bench-")
    try:
        lake = Lake(root)
        t0 = time.perf_counter()
        write_round_parts(lake, 0, iter_batches(s, prefetch=True))
        cfg = load_config(None, [], lake=root, methods=["grpo"])
        for name in batch_names(lake, 0):
            process_credit_batch(lake, 0, name, ["grpo"], cfg)
        print(f"round {args.groups}x{args.samples}x{args.turns}x{args.tokens}: synth + grpo {time.perf_counter() - t0:.1f} s")
        ctx = mp.get_context("spawn")
        rows = []
        for layout in ("flat", "verl", "openrlhf", "skyrl"):
            q = ctx.Queue()
            p = ctx.Process(target=_export, args=(root, layout, q))
            p.start()
            rows.append(q.get())
            p.join()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    flat = rows[0]
    print("| layout | build flat batch (s) | layout + write (s) | total (s) | x flat | peak RSS (MiB) | x flat |")
    print("|---|---|---|---|---|---|---|")
    for layout, tb, tl, _n_tok, rss in rows:
        tot, ftot = tb + tl, flat[1] + flat[2]
        print(f"| {layout} | {tb:.2f} | {tl:.2f} | {tot:.2f} | {tot / ftot:.2f} | {rss:.0f} | {rss / max(flat[4], 1):.2f} |")
    print(f"tokens exported per layout: {rows[0][3]:,}")


if __name__ == "__main__":
    main()
