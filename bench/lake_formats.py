"""Table formats for the lake on this round's workload (#25): hive Parquet (the old lake), Delta Lake (delta-rs,
`warehouse.delta_lake`) and Iceberg (pyiceberg with a SQL catalog on SQLite).

The workload of one round: a synthetic round's `steps` written as P parts, one write per part (what the flow's
batch stages do: each batch's output is one idempotent part write), then the part written again (a re-run),
then the whole round read back, one part read back, and the round replaced in one write (ingest). Formats
interleave within each repetition; min and median of the repetitions are printed, and the files on disk
counted. Local disk (object storage adds a round trip per request; see tests/test_lake_s3.py).

Second workload (`--process`, on by default): what a user runs, on a new lake of each format (hive through
CREDITFLOW_LAKE_FORMAT=parquet, Delta by default): `creditflow synth` then `creditflow process --methods
grpo,gae,turn_ppo`, each a fresh CLI process (Prefect's ephemeral API included, the same for both); formats
interleaved, min / median of the repetitions, and the flow's own per-stage seconds (its run log) beside.

    nice .venv/bin/python bench/lake_formats.py [--groups 64] [--parts 16] [--reps 3]
        [--process-groups 128] [--process-batch-groups 16] [--no-process]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
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


CLI = Path(sys.executable).parent / "creditflow"
PROCESS_METHODS = "grpo,gae,turn_ppo"
FORMATS = {"hive Parquet": "parquet", "Delta (delta-rs)": "delta"}


def _cli(env: dict, *args: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run([str(CLI), *args], env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"creditflow {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return took, out.stdout


def one_process(fmt: str, root: Path, groups: int, batch_groups: int) -> dict:
    """synth + process on a new lake of format `fmt`, each a CLI run; the flow's per-stage seconds."""
    env = {**os.environ, "CREDITFLOW_LAKE_FORMAT": fmt, "CREDITFLOW_NO_SERVER": "1", "COLUMNS": "200"}
    lake = str(root / "lake")
    synth_s, _ = _cli(
        env, "synth", "--out", lake, "--groups", str(groups), "--batch-groups", str(batch_groups)
    )
    process_s, shown = _cli(
        env,
        "process",
        "--lake",
        lake,
        "--round",
        "0",
        "--methods",
        PROCESS_METHODS,
        "--set",
        "flow.progress=false",
    )
    flow = re.search(r"wall seconds\W+([0-9.]+)", shown)
    assert flow, shown[-2000:]
    store = Lake(lake)
    assert store.format == fmt, (store.format, fmt)
    runs = store.read("stage_runs", 0)
    stages: dict[str, float] = {}
    for stage, sec in zip(runs.column("stage").to_pylist(), runs.column("seconds").to_pylist(), strict=True):
        stages[stage] = stages.get(stage, 0.0) + (sec or 0.0)
    adv = store.read("advantages", 0, columns=["method"])
    return {
        "synth_s": synth_s,
        "process_s": process_s,
        "flow_s": float(flow.group(1)),
        "stages": stages,
        "rows": adv.num_rows,
        "batches": len(store.parts("trajectories", 0)),
        "files": _files(root / "lake"),
    }


def process_section(args) -> list[str]:
    results: dict[str, list[dict]] = {name: [] for name in FORMATS}
    names = list(FORMATS)
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            root = Path(tempfile.mkdtemp(prefix="cf-lakeproc-"))
            try:
                results[name].append(
                    one_process(FORMATS[name], root, args.process_groups, args.process_batch_groups)
                )
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(name, {k: v for k, v in results[name][-1].items() if k != "stages"}, flush=True)
    rows_seen = {r["rows"] for runs in results.values() for r in runs}
    assert len(rows_seen) == 1, f"the formats' advantages differ in rows: {rows_seen}"
    keys = ("synth_s", "process_s", "flow_s")
    base = {k: statistics.median(r[k] for r in results["hive Parquet"]) for k in keys}
    stage_names = sorted({s for runs in results.values() for r in runs for s in r["stages"]})
    rows = []
    for name, runs in results.items():

        def mm(key, runs=runs):
            vals = [r[key] for r in runs]
            return f"{min(vals):.2f} / {statistics.median(vals):.2f}"

        med = {k: statistics.median(r[k] for r in runs) for k in keys}
        stage_med = [f"{statistics.median(r['stages'].get(s, 0.0) for r in runs):.2f}" for s in stage_names]
        rows.append(
            [
                name,
                mm("synth_s"),
                f"{med['synth_s'] / base['synth_s']:.2f}x",
                mm("process_s"),
                f"{med['process_s'] / base['process_s']:.2f}x",
                mm("flow_s"),
                f"{med['flow_s'] / base['flow_s']:.2f}x",
                *stage_med,
                runs[-1]["files"],
            ]
        )
    first = next(iter(results.values()))[-1]
    return [
        "",
        "## A round through the CLI: `creditflow synth` + `creditflow process` on a new lake of each format",
        "",
        f"`creditflow synth --groups {args.process_groups} --batch-groups {args.process_batch_groups}` "
        f"({first['batches']} batches, 8 samples x 5 turns x ~200 tokens) then `creditflow process --methods "
        f"{PROCESS_METHODS}` ({first['rows']:,} advantages rows), each a fresh CLI process with Prefect's "
        f"ephemeral API (CREDITFLOW_NO_SERVER=1); hive through CREDITFLOW_LAKE_FORMAT=parquet, Delta the "
        f"default. {args.reps} interleaved repetitions, min / median seconds. process: the whole CLI run; flow "
        "run: the flow's own `wall seconds` (the round's body, after the CLI's imports and the API's start-up); "
        "stage columns: the flow's run-log seconds summed over batches (median).",
        "",
        *md_table(
            [
                "format",
                "synth (s)",
                "vs hive",
                "process (s)",
                "vs hive",
                "flow run (s)",
                "vs hive",
                *[f"{s} (s)" for s in stage_names],
                "files after",
            ],
            rows,
        ),
    ]


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Delete operation did not match any records")
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--parts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--process-groups", type=int, default=128)
    ap.add_argument("--process-batch-groups", type=int, default=16)
    ap.add_argument("--no-process", dest="process", action="store_false", help="only the table workload")
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

    delta = sorted((here / "warehouse").glob("delta_*.py"))  # the Delta backend, split by #35
    code = {
        "hive Parquet": f"warehouse/lake.py: {loc((here / 'warehouse/lake.py').read_text())} lines",
        "Delta (delta-rs)": f"warehouse/delta_*.py: {sum(loc(p.read_text()) for p in delta)} lines "
        "(part API, empty parts, generations, versions, URIs, store options, migration)",
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
    if args.process:
        lines += process_section(args)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
