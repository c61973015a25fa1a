"""Credit-engine benchmark: every estimator on a synthetic round, next to the Parquet I/O floor and the
per-trajectory Python reference (tests/test_credit_reference.py).

    taskset -c 0,1 python bench/credit.py [--groups 512 --samples 8 --turns 10 --tokens 400] [--lake DIR]
        [--double] [--baseline WORKTREE] [--reps 3]

Each measurement runs in its own subprocess (peak RSS = that process's ru_maxrss), processing the round batch
by batch with flows.batch.credit_batch, as `creditflow process` does. `--baseline` times the engine of another
checkout (e.g. `git worktree add /tmp/base HEAD~1`) interleaved with this one, on the same lake. The reference is timed
on a subsample of groups and extrapolated by assistant tokens. Results: bench/results/credit.md."""

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

METHODS = ["grpo", "dr_grpo", "rloo", "gdpo", "gae", "turn_ppo", "mt_grpo", "gigpo"]


def _use_root(root: str) -> None:
    """Import pipeline/, flows/, warehouse/ from `root` (this checkout, or a baseline worktree)."""
    sys.path.insert(0, str(Path(root).resolve()))


def make_round(lake_dir: Path, round_: int, groups: int, samples: int, turns: int, tokens: int) -> dict:
    from pipeline.synth import SynthSettings, iter_batches
    from warehouse.lake import Lake
    from warehouse.rounds import prefetched, write_round_parts

    os.environ["CREDITFLOW_LAKE_FORMAT"] = "parquet"  # the hive lake (a new lake's default is Delta)
    s = SynthSettings(
        groups=groups, samples=samples, turns=turns, tokens=tokens, round=round_, seed=round_, batch_groups=64
    )
    t0 = time.perf_counter()
    names = write_round_parts(Lake(lake_dir), round_, prefetched(iter_batches(s)))
    return {"batches": len(names), "seconds": time.perf_counter() - t0}


def worker_engine(lake_dir: Path, round_: int, method: str, batch_scope: bool = False) -> dict:
    """The user path: flows.batch.credit_batch per batch (read the steps columns the method needs +
    trajectories, build the context, estimate, write the advantages part and the stage_runs row). With
    `batch_scope`, a method whose statistics span the round by default takes them per batch (`scope: batch`:
    no statistics pass, the work of the code before #22)."""
    from flows.batch import credit_batch, round_batches
    from pipeline.config import Config
    from warehouse.lake import Lake

    lake = Lake(lake_dir)
    stages = {}
    if batch_scope:
        from pipeline.credit.registry import ESTIMATORS

        statistics = ESTIMATORS[method.split("+")[0]].batch_statistics
        stages = {statistics: {"scope": "batch"}} if statistics else {}
    cfg = Config(lake=str(lake_dir), methods=[method], stages=stages)
    import pipeline.credit  # noqa: F401  (import time is not processing time)

    # a method whose statistics span the round (gae, turn_ppo, gdpo) runs the statistics pass on the first
    # credit_batch (flows.batch.round_statistics): the parts of an earlier repetition must not spare it
    if getattr(lake, "format", "parquet") == "parquet":
        shutil.rmtree(lake.partition_dir("credit_stats", round_), ignore_errors=True)
    else:  # a Delta lake (--formats parquet,delta)
        lake.delete_parts("credit_stats", round_)
    t0 = time.perf_counter()
    tokens = 0
    for b in round_batches(lake, round_):
        tokens += credit_batch(lake, round_, b, [method], cfg)["tokens"]
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "rss_mb": peak_rss_mb()}


def worker_compute(lake_dir: Path, round_: int, method: str) -> dict:
    """The engine without I/O, what the reference does: from Arrow tables in memory (read first, not timed)
    to the per-token advantages (context, estimate, advantages table), in steady state (after one warm-up call)."""
    from flows.batch import round_batches
    from pipeline.config import Config
    from pipeline.credit.process import process_batch
    from pipeline.credit.registry import method_step_columns
    from warehouse.lake import Lake
    from warehouse.rounds import read_batch

    lake, cfg = Lake(lake_dir), Config(lake=str(lake_dir), methods=[method])
    batches = round_batches(lake, round_)
    # one untimed call first: the process's one-off costs (lazy imports, the heap's first growth) are not
    # per-token work, and the reference is timed after its own imports too
    process_batch(
        read_batch(lake, "trajectories", round_, batches[0]),
        read_batch(lake, "steps", round_, batches[0], columns=method_step_columns([method])),
        [method],
        cfg,
        round_=round_,
    )
    seconds = 0.0
    for b in batches:
        traj = read_batch(lake, "trajectories", round_, b)
        steps = read_batch(lake, "steps", round_, b, columns=method_step_columns([method]))
        t0 = time.perf_counter()
        process_batch(traj, steps, [method], cfg, round_=round_)
        seconds += time.perf_counter() - t0
    return {"seconds": seconds}


def worker_floor(lake_dir: Path, round_: int, method: str) -> dict:
    """pyarrow only: read the steps columns the method needs (registry.method_step_columns, what credit_batch
    reads) + the trajectories, write the method's advantages part with the lake's writer options."""
    import pyarrow.parquet as pq

    from flows.batch import advantages_part, round_batches
    from pipeline.credit.registry import method_step_columns
    from warehouse.lake import Lake, write_options

    lake = Lake(lake_dir)
    cols = method_step_columns([method])
    if getattr(lake, "format", "parquet") == "delta":
        return _delta_floor(lake, round_, method, cols)
    seconds = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for b in round_batches(lake, round_):
            adv = pq.read_table(
                lake.partition_dir("advantages", round_) / f"part-{advantages_part(b, method)}.parquet"
            )
            t0 = time.perf_counter()
            pq.read_table(lake.partition_dir("steps", round_) / f"part-{b}.parquet", columns=cols)
            pq.read_table(lake.partition_dir("trajectories", round_) / f"part-{b}.parquet")
            pq.write_table(adv, Path(tmp) / "adv.parquet", **write_options(adv.schema))
            seconds += time.perf_counter() - t0
            del adv
    return {"seconds": seconds, "rss_mb": peak_rss_mb(), "columns": cols}


def _delta_floor(lake, round_: int, method: str, cols: list[str]) -> dict:
    """The floor of a Delta lake: delta-rs + pyarrow only: the same columns read from the Delta tables' datasets
    (filtered to the round and the batch's part), the advantages part written by one Delta commit with the lake's
    writer options."""
    import pyarrow.dataset as pads
    from deltalake import DeltaTable, write_deltalake

    from flows.batch import advantages_part, round_batches

    try:  # the lake's Parquet options for delta-rs (zstd, dictionaries for string columns only)
        from warehouse.delta_lake import writer_properties
    except ImportError:  # a baseline checkout from before them: delta-rs's defaults
        writer_properties = None

    def part(table: str, name: str, columns=None):
        ds = DeltaTable(lake.table_uri(table)).to_pyarrow_dataset()
        flt = (pads.field("round") == round_) & (pads.field("_part") == name)
        return ds.to_table(columns=columns, filter=flt)

    seconds = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for b in round_batches(lake, round_):
            adv = part("advantages", advantages_part(b, method))
            t0 = time.perf_counter()
            part("steps", b, cols)
            part("trajectories", b)
            write_deltalake(
                f"{tmp}/adv",
                adv,
                mode="overwrite",
                predicate=f"round = {round_}",
                partition_by=["round", "_part"],
                writer_properties=writer_properties(adv.schema) if writer_properties else None,
            )
            seconds += time.perf_counter() - t0
            del adv
    return {"seconds": seconds, "rss_mb": peak_rss_mb(), "columns": cols}


def worker_reference(lake_dir: Path, round_: int, method: str, sample_groups: int) -> dict:
    """The per-trajectory reference on the first `sample_groups` groups of the first batch."""
    import pyarrow.compute as pc

    sys.path.insert(0, str(ROOT / "tests"))
    import test_credit_reference as ref

    from flows.batch import round_batches
    from warehouse.lake import Lake
    from warehouse.rounds import read_batch

    lake = Lake(lake_dir)
    b = round_batches(lake, round_)[0]
    traj = read_batch(lake, "trajectories", round_, b)
    groups = pc.unique(traj.column("group_id")).slice(0, sample_groups)
    traj = traj.filter(pc.is_in(traj.column("group_id"), value_set=groups))
    steps = read_batch(lake, "steps", round_, b)
    steps = steps.filter(pc.is_in(steps.column("traj_id"), value_set=traj.column("traj_id")))
    is_asst = pc.equal(steps.column("role"), "assistant")
    tokens = int(pc.sum(pc.list_value_length(steps.filter(is_asst).column("token_ids"))).as_py())
    t0 = time.perf_counter()
    trajs, by_traj, grp = ref.load(traj, steps)
    result = {
        "grpo": lambda: ref.ref_grpo(trajs, by_traj, grp),
        "dr_grpo": lambda: ref.ref_grpo(trajs, by_traj, grp, by_std=False),
        "rloo": lambda: ref.ref_rloo(trajs, by_traj, grp),
        "gdpo": lambda: ref.ref_gdpo(trajs, by_traj, grp),
        "gae": lambda: ref.ref_gae(trajs, by_traj),
        "turn_ppo": lambda: ref.ref_turn_ppo(trajs, by_traj),
        "mt_grpo": lambda: ref.ref_mt_grpo(trajs, by_traj, grp),
        "gigpo": lambda: ref.ref_gigpo(trajs, by_traj, grp),
    }[method]()
    out = result[0] if isinstance(result, tuple) else result
    ref.token_layout(trajs, by_traj, out)  # the per-token advantages, as the engine produces
    return {"seconds": time.perf_counter() - t0, "assistant_tokens": tokens}


def sub(*args: str) -> dict:
    return run_worker(__file__, *args)


def assistant_tokens(lake_dir: Path, round_: int) -> tuple[int, int]:
    import duckdb

    path = f"{lake_dir}/steps/round={round_}/*.parquet"
    a, t = duckdb.sql(
        f"SELECT sum(len(token_ids)) FILTER (WHERE role = 'assistant'), sum(len(token_ids)) "
        f"FROM read_parquet('{path}')"
    ).fetchall()[0]
    return int(a), int(t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=512)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--lake", type=Path, default=None)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ref-groups", type=int, default=8)
    p.add_argument(
        "--reps", type=int, default=3, help="runs per measurement (interleaved); the table shows the fastest"
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a worktree of the code before this change (git worktree add DIR REV): its engine is "
        "timed in the same run, interleaved with this checkout's",
    )
    p.add_argument(
        "--formats",
        default="parquet",
        help="parquet,delta: also time the engine and its floor on a Delta copy of the lake (interleaved)",
    )
    p.add_argument(
        "--baseline-formats",
        default="parquet",
        help="the lake formats the --baseline engine is timed on (parquet, delta or both; delta needs --formats "
        "parquet,delta)",
    )
    p.add_argument("--double", action="store_true", help="also run a round of twice the groups (RSS growth)")
    p.add_argument(
        "--batch-scope",
        action="store_true",
        help="also time this checkout's engine with scope=batch (no round statistics pass: the work of the code "
        "before #22), min / median beside the engine's and the baseline's",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "credit.md")
    p.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    p.add_argument("--worker", nargs=4, metavar=("KIND", "LAKE", "ROUND", "METHOD"))
    args = p.parse_args()
    if args.worker:
        _use_root(args.root)
        try:  # what the CLI and the flows do at start (flows/runtime.py), for every kind of worker alike
            from flows.runtime import tune_allocator

            tune_allocator()
        except ImportError:  # a baseline checkout from before it existed
            pass
        kind, lake_dir, round_, method = args.worker
        fn = {
            "engine": worker_engine,
            "engine-batch-scope": lambda lake, r, m: worker_engine(lake, r, m, batch_scope=True),
            "floor": worker_floor,
            "compute": worker_compute,
        }.get(kind)
        res = (
            fn(Path(lake_dir), int(round_), method)
            if fn
            else worker_reference(Path(lake_dir), int(round_), method, args.ref_groups)
        )
        emit(res)
        return
    _use_root(str(ROOT))

    lake_dir = args.lake or Path(tempfile.mkdtemp(prefix="creditflow-bench-"))
    methods = [m for m in args.methods.split(",") if m]
    rounds = [(0, args.groups)] + ([(1, 2 * args.groups)] if args.double else [])
    for r, g in rounds:
        if not (lake_dir / "steps" / f"round={r}").exists():
            info = make_round(lake_dir, r, g, args.samples, args.turns, args.tokens)
            print(f"round {r}: {g} groups synthesised in {info['seconds']:.1f} s", flush=True)
    formats = [f for f in args.formats.split(",") if f]
    delta_dir = lake_dir.parent / f"{lake_dir.name}-delta"
    if "delta" in formats and not (delta_dir / "steps" / "_delta_log").exists():
        from warehouse.delta_lake import migrate

        t0 = time.perf_counter()
        migrate(lake_dir, delta_dir)
        print(f"Delta copy {delta_dir}: {time.perf_counter() - t0:.1f} s", flush=True)
    os.sync()  # the rounds just written: their writeback must not land inside the first measurement
    asst, total = assistant_tokens(lake_dir, 0)

    def best_of(m: str, kinds: list[tuple]) -> list[dict]:
        """The fastest of `reps` runs of each (kind, root[, lake]), interleaved (engine, floor, compute, engine,
        ...), so a slow spell of this shared machine hits the engine and its floor alike; each with the median
        of its runs' seconds (`median_s`)."""
        runs: list[list[dict]] = [[] for _ in kinds]
        for _ in range(args.reps):
            for i, (kind, root, *lake) in enumerate(kinds):
                where = str(lake[0] if lake else lake_dir)
                runs[i].append(sub("--root", str(root), "--worker", kind, where, "0", m))
        return [
            {**min(r, key=lambda x: x["seconds"]), "median_s": statistics.median(x["seconds"] for x in r)}
            for r in runs
        ]

    headers = [
        "method",
        "wall s",
        "assistant tok/s",
        "peak RSS MB",
        "I/O floor s",
        "x floor",
        "reference s (extrap.)",
        "x faster than ref",
        "engine compute s (no I/O)",
        "ref / compute",
    ]
    base_formats = [f for f in args.baseline_formats.split(",") if f] if args.baseline else []
    if "delta" not in formats:
        base_formats = [f for f in base_formats if f != "delta"]
    if "parquet" in base_formats:
        headers[1:1] = ["before: wall s", "before: x floor"]
    if args.double:
        headers += ["2x round: wall s", "2x round: peak RSS MB"]
    if "delta" in formats:
        headers += ["hive wall s min / median", "Delta: wall s min / median", "Delta: I/O floor s"]
        headers += ["Delta / hive wall min / median"]
        if "delta" in base_formats:
            headers += ["Delta before: wall s min / median", "Delta before / hive min / median"]
    if args.batch_scope:
        headers += ["wall s min / median", "scope=batch: wall s min / median"]
        headers += ["before: wall s min / median"] if "parquet" in base_formats else []
    rows = []
    for m in methods:
        kinds = [("engine", ROOT), ("floor", ROOT), ("compute", ROOT)]
        if "delta" in formats:
            kinds += [("engine", ROOT, delta_dir), ("floor", ROOT, delta_dir)]
        if "parquet" in base_formats:
            kinds += [("engine", args.baseline)]
        if "delta" in base_formats:  # the baseline's Delta engine on the same Delta copy
            kinds += [("engine", args.baseline, delta_dir)]
        if args.batch_scope:
            kinds += [("engine-batch-scope", ROOT)]
        e, f, cpu, *rest = best_of(m, kinds)
        batch_scope = rest.pop() if args.batch_scope else None
        de, df = (rest[0], rest[1]) if "delta" in formats else (None, None)
        rest = rest[2:] if "delta" in formats else rest
        base = rest.pop(0) if "parquet" in base_formats else None
        base_delta = rest.pop(0) if "delta" in base_formats else None
        rf = sub("--ref-groups", str(args.ref_groups), "--worker", "reference", str(lake_dir), "0", m)
        ref_s = rf["seconds"] * asst / max(rf["assistant_tokens"], 1)
        row = [
            m,
            f"{e['seconds']:.2f}",
            f"{asst / e['seconds']:,.0f}",
            f"{e['rss_mb']:.0f}",
            f"{f['seconds']:.2f}",
            f"{e['seconds'] / f['seconds']:.2f}",
            f"{ref_s:.0f}",
            f"{ref_s / e['seconds']:.0f}",
            f"{cpu['seconds']:.2f}",
            f"{ref_s / cpu['seconds']:.0f}",
        ]
        if base:
            row[1:1] = [f"{base['seconds']:.2f}", f"{base['seconds'] / f['seconds']:.2f}"]
        if args.double:
            e2 = sub("--worker", "engine", str(lake_dir), "1", m)
            row += [f"{e2['seconds']:.2f}", f"{e2['rss_mb']:.0f}"]
        if de is not None:

            def pair(a: dict, b: dict | None = None) -> str:  # seconds (b None) or a / b, min / median
                if b is None:
                    return f"{a['seconds']:.2f} / {a['median_s']:.2f}"
                return f"{a['seconds'] / b['seconds']:.2f} / {a['median_s'] / b['median_s']:.2f}"

            row += [pair(e), pair(de), f"{df['seconds']:.2f}", pair(de, e)]
            if base_delta is not None:
                row += [pair(base_delta), pair(base_delta, e)]
        if batch_scope is not None:
            row += [f"{x['seconds']:.2f} / {x['median_s']:.2f}" for x in (e, batch_scope, base) if x]
        print("| " + " | ".join(row) + " |", flush=True)
        rows.append(row)
    lines = [
        "# Credit engine benchmark",
        "",
        f"Round: {args.groups} groups x {args.samples} samples x {args.turns} turns x ~{args.tokens} tokens "
        f"(pipeline/synth.py, kind=mixed): {asst:,} assistant tokens, {total:,} tokens in all; "
        f"batches of 64 groups, processed one by one with flows.batch.credit_batch, the path `creditflow process` "
        f"runs (read the steps columns the method needs + trajectories, build the context, estimate, write the "
        f"advantages part and the stage_runs row).",
        machine_note()
        + f" Each cell is its own subprocess (peak RSS = its ru_maxrss); times are the fastest of "
        f"{args.reps} runs, engine / floor / compute interleaved.",
        "",
        "I/O floor: pyarrow only, read the steps columns the method needs (`registry.method_step_columns`, what "
        "credit_batch reads) + the trajectories, write the method's advantages part with the lake's writer options "
        "(zstd). Reference: the per-trajectory Python oracle of tests/test_credit_reference.py (load + method + "
        f"per-token layout), timed on {args.ref_groups} groups of the first batch and **extrapolated** to the round "
        "by assistant tokens. Engine compute: the engine from the same Arrow tables in memory (no I/O), after one "
        "untimed warm-up call (the process's one-off imports and first heap growth).",
        "",
        *md_table(headers, rows),
    ]
    if "delta" in formats:
        lines += [
            "",
            "Delta columns (`--formats parquet,delta`): the same round converted to a Delta lake "
            "(`warehouse.delta_lake.migrate`), its engine and floor timed in the same interleaved repetitions as the "
            "hive ones; the Delta floor is delta-rs + pyarrow (the batch's columns read from the Delta datasets, the "
            "advantages part written as one Delta commit).",
        ]
    write_md(args.out, lines)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
