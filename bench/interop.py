"""Benchmark the export layouts: the synthetic round (default 512 groups x 8 samples x 10 turns x 400 tokens,
~16M assistant tokens) processed with grpo batch by batch, then exported per batch in each layout: flat
(build_train_batch + Parquet zstd, what `train_batch` parts are) vs verl / openrlhf / skyrl as each framework
reads them today (build_train_batch + to_padded + save_padded, an uncompressed .npz). Each run is its own
subprocess (time and peak RSS); --reps interleaved repetitions, min and median; `--baseline WORKTREE` times
another checkout the same way, in the same repetitions.

    taskset -c 0,1 python bench/interop.py [--groups 512 ...] [--lake DIR] [--baseline WORKTREE] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import emit, machine_note, md_table, peak_rss_mb, run_worker, write_md  # noqa: E402

LAYOUTS = ("flat", "verl", "openrlhf", "skyrl")


def worker_export(root: str, layout: str) -> dict:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.export import build_train_batch
    from pipeline.layouts import to_padded
    from warehouse.exports import save_padded
    from warehouse.lake import Lake
    from warehouse.rounds import batch_names, read_batch

    lake = Lake(root)
    t_build = t_layout = 0.0
    n_tok = n_bytes = 0
    out = tempfile.mkdtemp(prefix=f"export-{layout}-", dir=root)
    try:
        for name in batch_names(lake, 0):
            traj, steps = read_batch(lake, "trajectories", 0, name), read_batch(lake, "steps", 0, name)
            adv = read_batch(lake, "advantages", 0, f"{name}.grpo")
            t0 = time.perf_counter()
            batch = build_train_batch(traj, steps, adv)
            t_build += time.perf_counter() - t0
            n_tok += int(pc.sum(pc.list_value_length(batch.column("input_ids"))).as_py())
            t0 = time.perf_counter()
            path = os.path.join(out, f"{name}.{'parquet' if layout == 'flat' else 'npz'}")
            if layout == "flat":
                pq.write_table(batch, path, compression="zstd")
            else:
                save_padded(to_padded(batch, layout), path)
            t_layout += time.perf_counter() - t0
            n_bytes += os.path.getsize(path)
            os.remove(path)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {
        "build": t_build,
        "layout": t_layout,
        "seconds": t_build + t_layout,
        "tokens": n_tok,
        "mb": n_bytes / 1e6,
        "rss_mb": peak_rss_mb(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--batch-groups", type=int, default=64)
    ap.add_argument("--lake", type=Path, default=None, help="a lake whose round 0 has grpo advantages parts")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline", type=Path, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "interop.md"))
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=2, metavar=("LAKE", "LAYOUT"))
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, str(Path(args.root).resolve()))
        emit(worker_export(*args.worker))
        return
    sys.path.insert(0, str(ROOT))
    from flows.batch import run_stage
    from pipeline.config import Config
    from pipeline.stages import get_stage
    from pipeline.synth import SynthSettings, iter_batches
    from warehouse.lake import Lake
    from warehouse.rounds import batch_names, prefetched, write_round_parts

    lake_dir = args.lake or Path(tempfile.mkdtemp(prefix="interop-bench-"))
    lake = Lake(lake_dir)
    if not (lake_dir / "steps" / "round=0").exists():
        s = SynthSettings(
            groups=args.groups,
            samples=args.samples,
            turns=args.turns,
            tokens=args.tokens,
            batch_groups=args.batch_groups,
        )
        write_round_parts(lake, 0, prefetched(iter_batches(s)))
    cfg = Config(lake=str(lake_dir), methods=["grpo"])
    for name in batch_names(lake, 0):
        if not lake.has_part("advantages", 0, f"{name}.grpo"):
            run_stage(lake, 0, name, get_stage("credit"), cfg)

    codes = ((("before", args.baseline),) if args.baseline else ()) + (("after", ROOT),)
    # interleaved repetitions: each rep runs every (layout, code) once, so load that comes and goes hits them
    # alike; per (code, layout) the fastest and the median run, and per rep the ratio to that rep's flat run
    runs: dict[tuple[str, str], list[dict]] = {(c, lay): [] for c, _ in codes for lay in LAYOUTS}
    for _ in range(args.reps):
        for lay in LAYOUTS:
            for c, root in codes:
                runs[(c, lay)].append(
                    run_worker(__file__, "--root", str(root), "--worker", str(lake_dir), lay)
                )
    res = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items()}
    rows = []
    for c, _ in codes:
        flat = res[(c, "flat")]
        for lay in LAYOUTS:
            r = res[(c, lay)]
            secs = [x["seconds"] for x in runs[(c, lay)]]
            ratio = [
                x["seconds"] / f["seconds"] for x, f in zip(runs[(c, lay)], runs[(c, "flat")], strict=True)
            ]
            rows.append(
                [
                    c,
                    lay,
                    f"{r['build']:.2f}",
                    f"{r['layout']:.2f}",
                    f"{r['seconds']:.2f}",
                    f"{statistics.median(secs):.2f}",
                    f"{r['seconds'] / flat['seconds']:.2f}",
                    f"{statistics.median(ratio):.2f}",
                    f"{r['mb']:,.0f}",
                    f"{r['rss_mb']:.0f}",
                    f"{r['rss_mb'] / flat['rss_mb']:.2f}",
                ]
            )
            print(rows[-1], flush=True)
    lines = [
        "# Export layouts vs flat (bench/interop.py)",
        "",
        f"Round: {args.groups} groups x {args.samples} samples x {args.turns} turns x ~{args.tokens} tokens "
        f"({res[('after', 'flat')]['tokens']:,} tokens exported per layout), processed with grpo per batch of "
        f"{args.batch_groups} groups, exported per batch in each layout. Flat = build_train_batch + Parquet (zstd); "
        "padded = build_train_batch + to_padded + save_padded (uncompressed .npz).",
        machine_note()
        + f" Each run is its own subprocess; {args.reps} interleaved repetitions (each runs every layout of every"
        " code once); build / layout columns are of the fastest run.",
        "",
        *md_table(
            [
                "code",
                "layout",
                "build flat batch s",
                "layout + write s",
                "total s (min)",
                "total s (median)",
                "x flat (min / min)",
                "x flat (median of same-rep ratios)",
                "MB written",
                "peak RSS MiB",
                "RSS x flat",
            ],
            rows,
        ),
    ]
    write_md(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
