"""Table formats for the lake on this round's workload (#25): hive Parquet (the old lake), Delta Lake (delta-rs,
`warehouse.delta_lake`) and Iceberg (pyiceberg with a SQL catalog on SQLite).

The workload of one round: a synthetic round's `steps` written as P parts, one write per part (what the flow's
batch stages do: each batch's output is one idempotent part write), then the part written again (a re-run),
then the whole round read back, one part read back, and the round replaced in one write (ingest). Formats
interleave within each repetition; min and median of the repetitions are printed, and the files on disk
counted. Local disk (object storage adds a round trip per request; see tests/test_lake_s3.py).

    nice .venv/bin/python bench/lake_formats.py [--groups 64] [--parts 16] [--reps 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine_note, md_table  # noqa: E402

from pipeline.synth import SynthSettings, generate  # noqa: E402
from warehouse.delta_lake import DeltaLake  # noqa: E402
from warehouse.lake import Lake  # noqa: E402
from warehouse.rounds import split_groups  # noqa: E402


class Hive:
    name = "hive Parquet"

    def __init__(self, root: Path):
        (root / "steps").mkdir(parents=True)
        self.lake = Lake(root)

    def write_part(self, part, table):
        self.lake.write_part("steps", 0, table, part=part)

    def replace(self, parts):
        self.lake.replace_partition("steps", 0, parts)

    def read_round(self):
        return self.lake.read("steps", 0)

    def read_part(self, part):
        return self.lake.read(
            "steps", 0, parts=[self.lake.partition_dir("steps", 0) / f"part-{part}.parquet"]
        )


class Delta(Hive):
    name = "Delta (delta-rs)"

    def __init__(self, root: Path):
        self.lake = DeltaLake(root)

    def read_part(self, part):
        return self.lake.read(
            "steps", 0, parts=[self.lake.partition_dir("steps", 0) / f"part-{part}.parquet"]
        )


class Iceberg:
    """Iceberg through pyiceberg: a SQL catalog (SQLite) and a table partitioned by round and part (identity);
    a part write is `overwrite(df, overwrite_filter=round == r AND _part == p)`."""

    name = "Iceberg (pyiceberg)"

    def __init__(self, root: Path):
        from pyiceberg.catalog.sql import SqlCatalog

        root.mkdir(parents=True)
        self.catalog = SqlCatalog("bench", uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}")
        self.catalog.create_namespace("lake")
        self.table = None

    def _frame(self, part, table):
        t = Lake._prepare(None, "steps", table)  # type: ignore[arg-type]  (validation only, no state)
        t = t.append_column("round", pa.array([0] * t.num_rows, pa.int32()))
        return t.append_column("_part", pa.array([part] * t.num_rows, pa.string()))

    def _ensure(self, schema):
        if self.table is None:
            self.table = self.catalog.create_table("lake.steps", schema=schema)
            with self.table.update_spec() as update:
                update.add_identity("round")
                update.add_identity("_part")

    def write_part(self, part, table):
        from pyiceberg.expressions import And, EqualTo

        data = self._frame(part, table)
        self._ensure(data.schema)
        self.table.overwrite(data, overwrite_filter=And(EqualTo("round", 0), EqualTo("_part", part)))

    def replace(self, parts):
        from pyiceberg.expressions import EqualTo

        data = pa.concat_tables([self._frame(p, t) for p, t in parts.items()])
        self._ensure(data.schema)
        self.table.overwrite(data, overwrite_filter=EqualTo("round", 0))

    def read_round(self):
        from pyiceberg.expressions import EqualTo

        self.table = self.catalog.load_table("lake.steps")
        return self.table.scan(row_filter=EqualTo("round", 0)).to_arrow()

    def read_part(self, part):
        from pyiceberg.expressions import And, EqualTo

        self.table = self.catalog.load_table("lake.steps")
        return self.table.scan(row_filter=And(EqualTo("round", 0), EqualTo("_part", part))).to_arrow()


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file())


def one(kind, root: Path, parts: dict[str, pa.Table]) -> dict:
    t0 = time.perf_counter()
    store = kind(root)
    for name, table in parts.items():
        store.write_part(name, table)
    t_parts = time.perf_counter() - t0
    first = next(iter(parts))
    t0 = time.perf_counter()
    store.write_part(first, parts[first])  # a re-run of one batch
    t_rewrite = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = store.read_round()
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    one_part = store.read_part(first)
    t_read_part = time.perf_counter() - t0
    rows = sum(t.num_rows for t in parts.values())
    assert back.num_rows == rows, (kind.name, back.num_rows, rows)
    assert one_part.num_rows == parts[first].num_rows
    assert pc.sum(pc.list_value_length(back.column("token_ids"))).as_py() > 0
    t0 = time.perf_counter()
    store.replace(parts)
    t_replace = time.perf_counter() - t0
    return {
        "parts_s": t_parts,
        "rewrite_s": t_rewrite,
        "read_s": t_read,
        "read_part_s": t_read_part,
        "replace_s": t_replace,
        "files": _files(root),
    }


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Delete operation did not match any records")
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--parts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lake_formats.md"))
    args = ap.parse_args()
    traj, steps = generate(SynthSettings(groups=args.groups, samples=8, turns=6, tokens=64, seed=0))
    batches = split_groups(traj, steps, max(1, args.groups // args.parts))
    parts = {f"b{i:05d}": b[1] for i, b in enumerate(batches)}
    mb = sum(t.nbytes for t in parts.values()) / 1e6
    kinds = [Hive, Delta, Iceberg]
    results: dict[str, list[dict]] = {k.name: [] for k in kinds}
    for rep in range(args.reps):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            root = Path(tempfile.mkdtemp(prefix="cf-lakefmt-"))
            try:
                results[kind.name].append(one(kind, root / "lake", parts))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    import inspect

    here = Path(__file__).resolve().parents[1]

    def loc(text: str) -> int:
        return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))

    code = {
        "hive Parquet": f"warehouse/lake.py: {loc((here / 'warehouse/lake.py').read_text())} lines",
        "Delta (delta-rs)": f"warehouse/delta_lake.py: {loc((here / 'warehouse/delta_lake.py').read_text())} lines "
        "(part API, empty parts, versions, URIs, migration)",
        "Iceberg (pyiceberg)": f"{loc(inspect.getsource(Iceberg))} lines here (part writes/reads only; no versions, "
        "URIs, catalog service)",
    }
    base = statistics.median(r["parts_s"] for r in results["hive Parquet"])
    rows = []
    for name, runs in results.items():

        def mm(key, runs=runs):
            vals = [r[key] for r in runs]
            return f"{min(vals):.3f} / {statistics.median(vals):.3f}"

        med_parts = statistics.median(r["parts_s"] for r in runs)
        rows.append(
            [
                name,
                mm("parts_s"),
                f"{mb / med_parts:.1f}",
                f"{med_parts / base:.2f}x",
                mm("rewrite_s"),
                mm("read_s"),
                mm("read_part_s"),
                mm("replace_s"),
                runs[-1]["files"],
                code[name],
            ]
        )
    lines = [
        "# Lake table formats on one round (bench/lake_formats.py)",
        "",
        f"steps of {args.groups} groups x 8 samples, {len(parts)} parts ({mb:.1f} MB in Arrow), "
        f"{args.reps} interleaved repetitions, min / median seconds, local disk.",
        machine_note(),
        "",
        *md_table(
            [
                "format",
                f"{len(parts)} part writes (s)",
                "MB/s (median)",
                "vs hive",
                "1 part rewrite (s)",
                "round read (s)",
                "1 part read (s)",
                "round replace (s)",
                "files after",
                "code",
            ],
            rows,
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
