"""What writing a round's advantages costs, by how it is written, and what reading the files back costs.

    python bench/credit.py --lake /tmp/b/lake --methods grpo,gae --reps 1 --no-compute --out /tmp/b/x.md  # the lake
    python bench/write_costs.py --lake /tmp/b/lake --methods grpo,gae --reps 5

Each method's advantages parts of round 0 (one per batch) are read once, then written every way below into a
scratch folder beside the lake (the same filesystem): the lake's own write (`Lake.write_parts` of a hive lake:
validation, a temporary file, fsync, rename, the folder's fsync), the same with fsync made a no-op (what the
lake adds to pyarrow, durability aside), a plain `pq.write_table` with the lake's writer options (bench/credit.py's
I/O floor: the baseline of every row), and plain writes with lz4 and with no compression in place of the lake's
zstd. The ways are interleaved within a repetition, their order alternating, with the page cache flushed
(os.sync) before each, so no write pays for another's dirty pages. Then the files each way wrote are read back
(`pq.read_table`, every column). Cells: min / median over the repetitions, ms per round (all its parts); sizes in
MB. Writes the table to bench/results/write_costs.md (or --out)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine_note, report, uptime  # noqa: E402

sys.path.insert(0, str(ROOT))

WAYS = (
    ("lake", "Lake.write_parts (durable: fsync, rename, folder fsync)"),
    ("lake_nosync", "Lake.write_parts, fsync a no-op"),
    ("plain", "plain pq.write_table, the lake's options (the floor)"),
    ("lz4", "plain, lz4 in place of zstd"),
    ("none", "plain, no compression"),
)


def _cell(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lake", required=True, help="a hive lake made by bench/credit.py --lake")
    ap.add_argument("--methods", default="grpo,gae")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/write_costs.md"))
    args = ap.parse_args()

    from flows.runtime import tune_allocator

    tune_allocator()  # as every process of a round
    import pyarrow.parquet as pq

    from flows.batch import round_batches
    from pipeline.stages import method_part
    from warehouse.lake import FORMAT_ENV, Lake, write_options

    src = Lake(args.lake)
    if src.format != "parquet":
        raise SystemExit("write_costs: a hive lake (bench/credit.py --lake DIR writes one)")
    methods = [m for m in args.methods.split(",") if m]
    batches = round_batches(src, 0)
    parts: dict[str, dict[str, object]] = {}
    for m in methods:
        parts[m] = {}
        for b in batches:
            path = src.partition_dir("advantages", 0) / f"part-{method_part(b, m)}.parquet"
            if not path.exists():
                raise SystemExit(
                    f"write_costs: no advantages of {m} in {args.lake} (bench/credit.py --methods {m})"
                )
            parts[m][method_part(b, m)] = pq.read_table(path)

    scratch = Path(tempfile.mkdtemp(prefix="write-costs-", dir=Path(args.lake).resolve().parent))
    os.environ[FORMAT_ENV] = "parquet"  # the scratch lake: hive, as the source
    real_fsync = os.fsync

    def plain(folder: Path, **extra) -> Callable[[str], None]:
        def write(m: str) -> None:
            for name, t in parts[m].items():
                pq.write_table(t, folder / f"part-{name}.parquet", **{**write_options(t.schema), **extra})

        return write

    def lake_write(lake: Lake, sync: bool) -> Callable[[str], None]:
        def write(m: str) -> None:
            if not sync:
                os.fsync = lambda fd: None  # the lake calls os.fsync at each write; restored below
            try:
                for name, t in parts[m].items():  # a part at a time, as the engine writes a batch's
                    lake.write_parts("advantages", 0, {name: t})
            finally:
                os.fsync = real_fsync

        return write

    folders = {k: scratch / k for k, _ in WAYS}
    for f in folders.values():
        f.mkdir()
    lakes = {k: Lake(folders[k]) for k in ("lake", "lake_nosync")}
    fns = {
        "lake": lake_write(lakes["lake"], True),
        "lake_nosync": lake_write(lakes["lake_nosync"], False),
        "plain": plain(folders["plain"]),
        "lz4": plain(folders["lz4"], compression="lz4"),
        "none": plain(folders["none"], compression="none"),
    }

    def files(way: str, m: str) -> list[Path]:
        folder = lakes[way].partition_dir("advantages", 0) if way in lakes else folders[way]
        return [folder / f"part-{name}.parquet" for name in parts[m]]

    start = uptime()
    write: dict[tuple[str, str], list[float]] = {}
    read: dict[tuple[str, str], list[float]] = {}
    order = [k for k, _ in WAYS]
    try:
        for rep in range(args.reps):
            for m in methods:
                for way in order if rep % 2 == 0 else order[::-1]:
                    os.sync()
                    t0 = time.perf_counter()
                    fns[way](m)
                    write.setdefault((m, way), []).append((time.perf_counter() - t0) * 1000)
                for way in order if rep % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    for path in files(way, m):
                        pq.read_table(path)
                    read.setdefault((m, way), []).append((time.perf_counter() - t0) * 1000)
            print(f"[{rep + 1}/{args.reps}]", flush=True)
        sizes = {(m, w): sum(p.stat().st_size for p in files(w, m)) / 1e6 for m in methods for w in order}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    headers = ["way"]
    for m in methods:
        headers += [f"{m}: write ms", f"{m}: x floor", f"{m}: MB", f"{m}: read ms"]
    rows = []
    for way, label in WAYS:
        row = [label]
        for m in methods:
            w, base = write[(m, way)], write[(m, "plain")]
            ratio = f"{min(w) / min(base):.2f} / {statistics.median(w) / statistics.median(base):.2f}"
            row += [_cell(w), ratio, f"{sizes[(m, way)]:.1f}", _cell(read[(m, way)])]
        rows.append(row)
    intro = (
        __doc__.split("\n\n", 2)[2].split("\n\nWrites")[0].replace("\n", " ")
        + f"\n\nLake: `{args.lake}`, {len(batches)} parts a method; {args.reps} repetitions. Load: `{start}` at "
        f"the start, `{uptime()}` at the end. {machine_note()}"
    )
    report(args.out, "What writing the advantages costs, by how (bench/write_costs.py)", intro, headers, rows)


if __name__ == "__main__":
    main()
