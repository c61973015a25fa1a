"""Credit-engine benchmark: every estimator on a synthetic round, next to the Parquet I/O floor and the
per-trajectory Python reference (tests/test_credit_reference.py).

    taskset -c 0,1 python bench/credit.py [--groups 512 --samples 8 --turns 10 --tokens 400] [--lake DIR]
        [--double] [--baseline WORKTREE] [--reps 3]

Each measurement runs in its own subprocess (peak memory = its whole process tree's, sampled, or its own
high-water mark VmHWM where that is more: bench/_common.run_worker), processing the round as `creditflow process`
does: the statistics pass over every batch first (flows.batch.round_statistics) when a method takes a statistic
over the round, then flows.batch.credit_batch batch by batch with the round's statistics passed in. `--baseline` times the engine of another
checkout (e.g. `git worktree add /tmp/base HEAD~1`) interleaved with this one, on the same lake. The reference is timed
on a subsample of groups and extrapolated by assistant tokens. A second table sets each engine beside the durable
floor of the reads it made (`_its_floor`: its Parquet reads counted, the part written as the lake must, synced).
Results: bench/results/credit.md."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import emit, machine_note, md_table, peak_rss_mb, run_worker, uptime, write_md  # noqa: E402

METHODS = ["grpo", "dr_grpo", "rloo", "gdpo", "gae", "turn_ppo", "mt_grpo", "gigpo"]
STAGES_ENV = "CREDITFLOW_BENCH_STAGES"  # --stages: the parent sets it, every worker reads it


def _stages() -> dict:
    """The stage settings of every worker's config (`--stages`, JSON): e.g. {"gae": {"whiten": false}}."""
    return json.loads(os.environ.get(STAGES_ENV) or "{}")


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


def _credit_batch(lake, round_: int, batch: str, cfg, round_stats=None) -> dict:
    """The credit stage on one batch (flows pass the stage's declaration since #35; a checkout from before
    has flows.batch.credit_batch), with the round's statistics as the flow passes them."""
    import flows.batch as fb

    if hasattr(fb, "credit_batch"):
        return fb.credit_batch(lake, round_, batch, list(cfg.methods), cfg, round_stats=round_stats)
    from pipeline.stages import get_stage

    return fb.run_stage(lake, round_, batch, get_stage("credit"), cfg, round_stats=round_stats)


def _method_part(batch: str, method: str) -> str:
    """A method's part of a batch (pipeline.stages.method_part since #35; flows.batch.advantages_part before)."""
    import flows.batch as fb

    if hasattr(fb, "advantages_part"):
        return fb.advantages_part(batch, method)
    from pipeline.stages import method_part

    return method_part(batch, method)


def _warm_imports() -> None:
    """What every process of a round imports once, whatever it computes, done before the clock starts in the
    engine kinds of both checkouts alike: the credit package and the stage modules (the code before #35 loaded
    every stage package on its first settings lookup), and pandas, which pyarrow imports on its first
    `pa.array` (1.1 s here; the floor never calls it)."""
    import pyarrow as pa

    import pipeline.credit  # noqa: F401
    from pipeline.stages import load_stages

    load_stages()
    pa.array([0])


def _delta_commits(lake_dir: Path) -> int:
    """Commits in the lake's Delta logs (0 for a hive lake): the engine's commits per batch are the difference."""
    return sum(1 for _ in Path(lake_dir).glob("*/_delta_log/*.json"))


def worker_engine(lake_dir: Path, round_: int, method: str, batch_scope: bool = False) -> dict:
    """The user path, as the flow runs it: the statistics pass on every batch first where a method takes a
    statistic over the round (flows.batch.round_statistics), then flows.batch.credit_batch per batch with the
    round's statistics passed in (read the steps columns the method needs + trajectories, build the context,
    estimate, write the advantages part and the stage_runs row). With `batch_scope`, a method whose statistics
    span the round by default takes them per batch (`scope: batch`: no statistics pass, the work of the code
    before #22)."""
    import flows.batch as fb
    from flows.batch import round_batches, round_statistics
    from pipeline.config import Config
    from pipeline.credit.process import statistics_json
    from warehouse.lake import Lake

    lake = Lake(lake_dir)
    stages = {}
    if batch_scope:
        from pipeline.credit.registry import ESTIMATORS

        est = ESTIMATORS[method.split("+")[0]]
        stat = getattr(est, "statistics", None)  # RoundStatistics (#35), a settings name before
        statistics = stat.settings if stat is not None else getattr(est, "batch_statistics", None)
        stages = {statistics: {"scope": "batch"}} if statistics else {}
    cfg = Config(lake=str(lake_dir), methods=[method], stages=_stages() | stages)
    _warm_imports()
    # a method whose statistics span the round (gae, turn_ppo, gdpo) runs the statistics pass first: the parts
    # of an earlier repetition must not spare it
    if getattr(lake, "format", "parquet") == "parquet":
        shutil.rmtree(lake.partition_dir("credit_stats", round_), ignore_errors=True)
    else:  # a Delta lake (--formats parquet,delta)
        lake.delete_parts("credit_stats", round_)
    commits = _delta_commits(lake_dir)
    reads = _count_reads()
    t0, c0 = time.perf_counter(), time.process_time()
    batches = round_batches(lake, round_)
    stats = round_statistics(lake, round_, cfg, batches)
    round_stats = statistics_json(stats) if stats else None
    tokens = 0
    for b in batches:
        tokens += _credit_batch(lake, round_, b, cfg, round_stats)["tokens"]
    getattr(fb, "finish_round", lambda *_: 0)(lake, round_)  # the run log's spooled rows: one commit (Delta)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "commits_per_batch": (_delta_commits(lake_dir) - commits) / len(batches),
        # the Parquet reads of each input table per batch (a hive lake's: its floor reads as many)
        "reads_per_batch": {t: n / len(batches) for t, n in reads.items()},
        "tokens": tokens,
        "rss_mb": peak_rss_mb(),
    }


def _count_reads() -> dict[str, int]:
    """From now on in this process, the reads of the steps' and the trajectories' Parquet files, by table (the
    folder above a part's round folder): a hive lake's reads go through `pq.ParquetFile.read`. The engine reads
    a batch's steps once where the statistics pass keeps its read for credit, twice where it does not (gae's
    pass reads the value moments, credit the values); its floor reads as many (`_its_floor`)."""
    import pyarrow.parquet as pq

    counts = {"steps": 0, "trajectories": 0}
    init, read = pq.ParquetFile.__init__, pq.ParquetFile.read

    def counting_init(self, source, *args, **kwargs):
        init(self, source, *args, **kwargs)
        self._bench_table = Path(source).parent.parent.name if isinstance(source, (str, Path)) else None

    def counting_read(self, *args, **kwargs):
        table = getattr(self, "_bench_table", None)
        if table in counts:
            counts[table] += 1
        return read(self, *args, **kwargs)

    pq.ParquetFile.__init__ = counting_init
    pq.ParquetFile.read = counting_read
    return counts


def worker_compute(lake_dir: Path, round_: int, method: str) -> dict:
    """The engine without I/O, what the reference does: from Arrow tables in memory (read first, not timed)
    to the per-token advantages (context, estimate, advantages table), in steady state (after one warm-up call)."""
    from flows.batch import round_batches
    from pipeline.config import Config
    from pipeline.credit.process import process_batch
    from pipeline.credit.registry import method_step_columns
    from warehouse.lake import Lake
    from warehouse.rounds import read_batch

    lake, cfg = Lake(lake_dir), Config(lake=str(lake_dir), methods=[method], stages=_stages())
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
    reads) + the trajectories, write the method's advantages part with the lake's writer options. Each batch's
    part is written twice, in turn first: plainly (the floor of the earlier runs) and durably, as the lake's
    atomic write must (a temporary file, synced, renamed, its folder synced: `parts["durable"]`), both into a
    folder in the lake's root (the engine's file system). Each read is timed apart (`parts`), so the floor of
    the reads an engine made (`_its_floor`) adds the statistics pass's reads only where the engine made them."""
    import pyarrow.parquet as pq

    from flows.batch import round_batches
    from pipeline.credit.registry import method_step_columns
    from warehouse.lake import Lake, write_options
    from warehouse.tempfiles import fsync_dir

    lake = Lake(lake_dir)
    cols = method_step_columns([method])
    stats_cols = _statistics_columns(method)
    if getattr(lake, "format", "parquet") == "delta":
        return _delta_floor(lake, round_, method, cols, stats_cols)
    kinds = ("steps", "trajectories", "stats_steps", "stats_trajectories", "write", "durable")
    clock = {k: [0.0, 0.0] for k in kinds}  # {what: [wall s, CPU s]}

    def timed(what: str, fn, *args, **kwargs) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        fn(*args, **kwargs)
        clock[what][0] += time.perf_counter() - t0
        clock[what][1] += time.process_time() - c0

    def plain(adv, folder: Path) -> None:
        pq.write_table(adv, folder / "adv.parquet", **write_options(adv.schema))

    def durable(adv, folder: Path) -> None:
        tmp = folder / ".tmp-adv.parquet"
        with open(tmp, "wb") as fh:
            pq.write_table(adv, fh, **write_options(adv.schema))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, folder / "durable.parquet")
        fsync_dir(folder)

    with tempfile.TemporaryDirectory(dir=lake_dir, prefix=".bench-floor-") as tmp:
        folder = Path(tmp)
        for i, b in enumerate(round_batches(lake, round_)):
            adv = pq.read_table(
                lake.partition_dir("advantages", round_) / f"part-{_method_part(b, method)}.parquet"
            )
            steps = lake.partition_dir("steps", round_) / f"part-{b}.parquet"
            traj = lake.partition_dir("trajectories", round_) / f"part-{b}.parquet"
            reads: list[tuple[str, list | None, Path]] = [
                ("steps", cols, steps),
                ("trajectories", None, traj),
            ]
            if stats_cols is not None:  # the statistics pass's own read of the batch
                reads += [("stats_steps", stats_cols, steps), ("stats_trajectories", None, traj)]
            turn = 1 if i % 2 == 0 else -1  # each in turn first (a batch's first read costs more)
            for what, columns, path in reads[::turn]:
                timed(what, pq.read_table, path, columns=columns)
            for what, write in [("write", plain), ("durable", durable)][::turn]:
                timed(what, write, adv, folder)
            del adv
    (seconds, cpu), (stats_s, stats_cpu) = (
        [sum(clock[k][j] for k in keys) for j in (0, 1)]
        for keys in (("steps", "trajectories", "write"), ("stats_steps", "stats_trajectories"))
    )
    out = _floor_result(seconds, cpu, stats_s, stats_cpu, cols)
    return out | {"parts": clock}


def _its_floor(engine: dict, floor: dict, cpu: bool) -> float | None:
    """The durable floor of the reads `engine` made, from one floor run's parts (wall or CPU): the method's
    steps columns and the trajectories read, the part written durably, plus the statistics pass's read of the
    steps (of the trajectories) where the engine read them twice a batch. None: no parts (a Delta floor) or no
    read counts (a Delta engine)."""
    reads, parts = engine.get("reads_per_batch"), floor.get("parts")
    if not reads or not parts or not reads.get("steps"):
        return None
    j = 1 if cpu else 0
    total = parts["steps"][j] + parts["trajectories"][j] + parts["durable"][j]
    if reads["steps"] > 1.5:
        total += parts["stats_steps"][j]
    if reads.get("trajectories", 0) > 1.5:
        total += parts["stats_trajectories"][j]
    return total


def _ratio_its_floor(engine: list[dict] | None, floor: list[dict] | None, cpu: bool = False) -> str:
    """engine / the durable floor of its reads (`_its_floor`), min / min and median / median."""
    if not engine or not floor:
        return "-"
    fl = [v for f in floor if (v := _its_floor(engine[0], f, cpu)) is not None]
    if len(fl) < len(floor):
        return "-"
    en = [r["cpu_s" if cpu else "seconds"] for r in engine]
    return f"{min(en) / min(fl):.2f} / {statistics.median(en) / statistics.median(fl):.2f}"


def _reads(engine: list[dict] | None) -> str:
    """The engine's reads of a batch's steps and trajectories files (hive)."""
    reads = engine[0].get("reads_per_batch") if engine else None
    return f"{reads['steps']:g}, {reads['trajectories']:g}" if reads else "-"


def _statistics_columns(method: str) -> list[str] | None:
    """The steps columns the statistics pass reads for `method` (empty: it reads the trajectories and no steps
    column, GDPO's default; None: the method takes no statistic over the round, or a checkout without the
    pass)."""
    from pipeline.config import Config

    try:
        from pipeline.credit.process import statistics_methods
        from pipeline.credit.registry import statistics_step_columns
    except ImportError:
        return None
    names = statistics_methods(Config(methods=[method], stages=_stages()))
    return statistics_step_columns(names) if names else None


def _floor_result(seconds: float, cpu: float, stats_s: float, stats_cpu: float, cols: list[str]) -> dict:
    """The floor's figures; with a statistics pass, also the two-read floor (`seconds2`, `cpu_s2`): the floor
    plus the statistics pass's own read of its columns and the trajectories, what a method whose advantages
    depend on the whole round reads at the least when it holds no batch between its passes (memory flat in the
    round's size)."""
    out = {"seconds": seconds, "cpu_s": cpu, "rss_mb": peak_rss_mb(), "columns": cols}
    if stats_s:
        out |= {"seconds2": seconds + stats_s, "cpu_s2": cpu + stats_cpu}
    return out


def _delta_floor(lake, round_: int, method: str, cols: list[str], stats_cols: list[str] | None) -> dict:
    """The floor of a Delta lake: delta-rs + pyarrow only. Each table's Delta log is read once per round (in the
    timed region: the engine reads it too), the batch's data files are taken from its add actions (the part's
    name, or the name tagged with its generation for an ingest table) and read with pyarrow directly, as hive
    parts are; the advantages part the engine wrote is written again, by one Delta commit into the lake's own
    advantages table with the lake's writer options (the same rows and the same table history as the engine's
    commit: a commit into an empty table cost less). (Before #36's
    last pass the floor opened the table and filtered a pyarrow dataset for every read: 1.2-2x the hive floor,
    looser than the engine's own path.)"""
    from urllib.parse import unquote

    import pyarrow as pa
    import pyarrow.parquet as pq
    from deltalake import DeltaTable, write_deltalake

    from flows.batch import round_batches

    try:  # the lake's Parquet options for delta-rs (zstd, dictionaries for string columns only)
        from warehouse.delta_store import writer_properties
    except ImportError:  # a checkout from before #35's split of warehouse/delta_lake.py
        try:
            from warehouse.delta_lake import writer_properties
        except ImportError:  # a baseline checkout from before them: delta-rs's defaults
            writer_properties = None
    try:  # the interval the lake checkpoints its tables at
        from warehouse.delta_lake import CHECKPOINT_EVERY
    except ImportError:  # a checkout from before it was named
        CHECKPOINT_EVERY = 50

    files: dict[str, dict[str, list[str]]] = {}

    def part_files(table: str) -> dict[str, list[str]]:
        """{part name less its generation: its data files} of the table's round (the log read once)."""
        if table not in files:
            acts = DeltaTable(lake.table_uri(table)).get_add_actions(flatten=True)  # (an arro3 table)
            acts = pa.RecordBatchReader.from_stream(acts).read_all().to_pydict()
            by: dict[str, list[str]] = {}
            for path, r, name in zip(
                acts["path"], acts["partition.round"], acts["partition._part"], strict=True
            ):
                if int(r) == round_:
                    by.setdefault(name.split(".gen-")[0], []).append(path)
            files[table] = by
        return files[table]

    def part(table: str, name: str, columns=None) -> pa.Table:
        paths = sorted(part_files(table)[name])
        return pa.concat_tables(
            [pq.read_table(lake.root / table / unquote(p), columns=columns) for p in paths]
        )

    seconds = cpu = stats_s = stats_cpu = 0.0
    for b in round_batches(lake, round_):
        adv = part("advantages", _method_part(b, method))  # (its log read untimed: the floor writes it)
        if stats_cols is not None:  # the statistics pass's own read of the batch (timed apart)
            t0, c0 = time.perf_counter(), time.process_time()
            part("steps", b, [c for c in stats_cols if c != "round"])
            part("trajectories", b)
            stats_s += time.perf_counter() - t0
            stats_cpu += time.process_time() - c0
        n = adv.num_rows  # the partition columns, which the data files do not hold
        adv = adv.append_column("round", pa.array([round_] * n, pa.int32()))
        adv = adv.append_column("_part", pa.array([_method_part(b, method)] * n, pa.string()))
        t0, c0 = time.perf_counter(), time.process_time()
        part("steps", b, [c for c in cols if c != "round"])
        part("trajectories", b)
        write_deltalake(  # the engine's part again, into the lake's own table: the same rows, the same
            # table history (a delta-rs commit costs more the more files the table holds)
            lake.table_uri("advantages"),
            adv,
            mode="overwrite",
            predicate=f"round = {round_} AND _part = '{_method_part(b, method)}'",
            partition_by=["round", "_part"],
            schema_mode="merge",
            configuration={"delta.checkpointInterval": str(CHECKPOINT_EVERY)},
            writer_properties=writer_properties(adv.schema) if writer_properties else None,
        )
        seconds += time.perf_counter() - t0
        cpu += time.process_time() - c0
        del adv
    return _floor_result(seconds, cpu, stats_s, stats_cpu, cols)


def _long_batch(trajectories: int, tokens: int, turns: int, seed: int = 0):
    """A batch of `trajectories` trajectories of `tokens` assistant tokens each, in `turns` assistant steps
    (critic values on every token, one reward per trajectory): verl's (bs, response_length) batch with every
    token in the response mask, as trajectories and steps tables."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    per_step = tokens // turns
    n_steps = trajectories * turns
    traj_ids = pa.array([f"t{i:05d}" for i in range(trajectories)], pa.string())
    trajs = pa.table(
        {
            "traj_id": traj_ids,
            "group_id": pa.array([f"g{i // 16:04d}" for i in range(trajectories)], pa.string()),
            "reward": pa.array(rng.normal(size=trajectories)),
        }
    )
    offsets = pa.array(np.arange(n_steps + 1, dtype=np.int32) * per_step)
    values = rng.normal(size=n_steps * per_step).astype(np.float32)
    steps = pa.table(
        {
            "traj_id": traj_ids.take(pa.array(np.repeat(np.arange(trajectories), turns))),
            "step_idx": pa.array(np.tile(np.arange(turns, dtype=np.int32), trajectories)),
            "role": pa.array(["assistant"] * n_steps, pa.string()),
            "turn": pa.array(np.tile(np.arange(1, turns + 1, dtype=np.int32), trajectories)),
            "is_error": pa.array(np.zeros(n_steps, dtype=bool)),
            "verifier_score": pa.nulls(n_steps, pa.float64()),
            "token_ids": pa.ListArray.from_arrays(offsets, pa.array(np.zeros(n_steps * per_step, np.int32))),
            "values": pa.ListArray.from_arrays(offsets, pa.array(values)),
        }
    )
    return trajs, steps


def worker_verl(size: str, method: str, reps: int, gamma: float, lam: float) -> dict:
    """verl's compute_gae_advantage_return beside our estimator on the same batch (`size`: TRAJxTOKENS), compute
    only, interleaved (verl, ours, verl, ours, ...), the fastest of `reps` each. verl gets its padded tensors
    (rewards on each row's last token, the values, an all-ones response mask) built before its clock starts;
    ours: `estimate` is run_methods on a built context (the estimator and the contract checks), `from Arrow`
    is process_batch from the Arrow tables (context, estimate, advantages table)."""
    import numpy as np
    import torch

    import pipeline.credit as credit
    from pipeline.config import Config
    from pipeline.credit.process import process_batch
    from pipeline.credit.registry import run_methods

    core = _import_verl()
    n_traj, n_tok = (int(x) for x in size.split("x"))
    trajs, steps = _long_batch(n_traj, n_tok, turns=8)
    settings = {"gamma": gamma, "lam": lam}
    cfg = Config(methods=[method], stages={"gae": settings, "turn_ppo": settings})
    values = torch.from_numpy(
        np.asarray(steps.column("values").combine_chunks().values).reshape(n_traj, n_tok).copy()
    )
    rewards = torch.zeros(n_traj, n_tok)
    rewards[:, -1] = torch.from_numpy(np.asarray(trajs.column("reward")).astype(np.float32))
    mask = torch.ones(n_traj, n_tok)
    # the credit batch (#35), or a --baseline tree's CreditContext; both take these keywords
    batch_type = getattr(credit, "CreditBatch", None) or credit.CreditContext
    ctx = batch_type.from_arrow(trajs, steps, config=cfg)
    # warm-up: the first call's one-off costs, both ways (a first process_batch took 0.45 s against 0.03 s
    # after for turn_ppo: its arrays landing on memory this VM had never touched)
    run_methods(ctx, [method])
    process_batch(trajs, steps, [method], cfg)
    times: dict[str, list[float]] = {"verl": [], "estimate": [], "arrow": []}
    for _ in range(reps):
        # ours first: torch's OpenMP threads keep spinning for a while after verl's call returns, which slowed
        # whatever ran right after it (an estimate 3x its own time in an earlier order)
        t0 = time.perf_counter()
        run_methods(ctx, [method])
        times["estimate"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        process_batch(trajs, steps, [method], cfg)
        times["arrow"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        core.compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=lam)
        times["verl"].append(time.perf_counter() - t0)
        time.sleep(0.5)  # untimed: let torch's OpenMP threads stop spinning before the next repetition's ours
    out = {k: min(v) for k, v in times.items() if v}
    out |= {f"{k}_median": statistics.median(v) for k, v in times.items() if v}
    out |= {"tokens": n_traj * n_tok, "torch_threads": torch.get_num_threads(), "rss_mb": peak_rss_mb()}
    return out


def _import_verl():
    """verl.trainer.ppo.core_algos (verl 0.9 imports it without its GPU-only modules)."""
    import importlib

    return importlib.import_module("verl.trainer.ppo.core_algos")


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


def _pair(runs: list[dict] | None, key: str = "seconds", fmt: str = "{:.2f}") -> str:
    """min / median of a measurement's repetitions."""
    if not runs:
        return "-"
    vals = [r[key] for r in runs]
    return f"{fmt.format(min(vals))} / {fmt.format(statistics.median(vals))}"


def _ratio(a: list[dict] | None, b: list[dict] | None, key: str = "seconds", key_b: str | None = None) -> str:
    """a / b of the fastest runs and of the medians (b's `key_b` where given: the two-read floor)."""
    if not a or not b or (key_b is not None and key_b not in b[0]):
        return "-"
    va, vb = [r[key] for r in a], [r[key_b or key] for r in b]
    return f"{min(va) / min(vb):.2f} / {statistics.median(va) / statistics.median(vb):.2f}"


def _paired(a: list[dict] | None, b: list[dict] | None, key: str = "seconds") -> str:
    """The median of a / b over the repetitions, each a run beside its b run of the same repetition (a slow
    spell of the machine hits both)."""
    if not a or not b:
        return "-"
    return f"{statistics.median(x[key] / y[key] for x, y in zip(a, b, strict=True)):.2f}"


def _over_parts(engine: list[dict] | None, floor: list[dict] | None, compute: list[dict] | None) -> str:
    """engine / (I/O floor + compute), min over min sums and median over median sums: what the engine spends
    beyond reading, writing and computing (its per-batch fixed costs). The two-read floor where the method has
    a statistics pass."""
    if not engine or not floor or not compute:
        return "-"
    key = "seconds2" if "seconds2" in floor[0] else "seconds"
    fl, co, en = (
        [r[k] for r in runs] for runs, k in ((floor, key), (compute, "seconds"), (engine, "seconds"))
    )
    low = min(en) / (min(fl) + min(co))
    mid = statistics.median(en) / (statistics.median(fl) + statistics.median(co))
    return f"{low:.2f} / {mid:.2f}"


def _peak(runs: list[dict] | None) -> str:
    return f"{max(r['tree_peak_mb'] for r in runs):.0f}" if runs else "-"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=512)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--lake", type=Path, default=None)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ref-groups", type=int, default=8)
    p.add_argument("--reps", type=int, default=3, help="runs per measurement, interleaved")
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a worktree of the code before this change (git worktree add DIR REV): every measurement of this "
        "checkout is taken for it too, in the same interleaved repetitions",
    )
    p.add_argument(
        "--formats",
        default="parquet",
        help="parquet,delta: also time the engine and its floor on a Delta copy of the lake (interleaved)",
    )
    p.add_argument("--double", action="store_true", help="also a round of twice the groups (time and memory)")
    p.add_argument("--no-compute", action="store_true", help="skip the compute-only cells (a loaded machine)")
    p.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="seconds every cell waits after its sync: a round that starts after the machine sat idle (on a "
        "virtual machine that hands free memory back to its host, the memory a fresh worker takes is then new to "
        "the host again, as between a user's rounds; back to back, a cell reuses what the last one freed)",
    )
    p.add_argument(
        "--verl",
        default="",
        help="TRAJxTOKENS (e.g. 1024x16384): time verl's compute_gae_advantage_return beside gae and turn_ppo "
        "on that batch, compute only (needs verl installed: .ci/install-frameworks)",
    )
    p.add_argument(
        "--stages",
        default="",
        help='stage settings for every worker, JSON (e.g. \'{"gae": {"whiten": false}}\'): both sides run them',
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
        if kind.startswith("verl:"):  # verl:REPS:GAMMA:LAM, LAKE = the batch size
            _, reps, gamma, lam = kind.split(":")
            emit(worker_verl(lake_dir, method, int(reps), float(gamma), float(lam)))
            return
        fn = {"engine": worker_engine, "floor": worker_floor, "compute": worker_compute}.get(kind)
        res = (
            fn(Path(lake_dir), int(round_), method)
            if fn
            else worker_reference(Path(lake_dir), int(round_), method, args.ref_groups)
        )
        emit(res)
        return
    _use_root(str(ROOT))
    if args.stages:
        try:
            json.loads(args.stages)
        except ValueError as exc:
            sys.exit(f"bench/credit.py: --stages is not JSON: {exc}")
        os.environ[STAGES_ENV] = args.stages  # every worker's config (run_worker passes the environment)
    load_at_start = uptime()
    print(load_at_start, flush=True)

    lake_dir = args.lake or Path(tempfile.mkdtemp(prefix="creditflow-bench-"))
    if args.lake is None:  # a lake of its own (a few GB at 512 groups): removed at exit, its Delta copy too
        atexit.register(shutil.rmtree, lake_dir.parent / f"{lake_dir.name}-delta", True)
        atexit.register(shutil.rmtree, lake_dir, True)
    methods = [m for m in args.methods.split(",") if m]
    rounds = [(0, args.groups)] + ([(1, 2 * args.groups)] if args.double else [])
    for r, g in rounds:
        if not (lake_dir / "steps" / f"round={r}").exists():
            info = make_round(lake_dir, r, g, args.samples, args.turns, args.tokens)
            print(f"round {r}: {g} groups synthesised in {info['seconds']:.1f} s", flush=True)
    formats = [f for f in args.formats.split(",") if f]
    delta_dir = lake_dir.parent / f"{lake_dir.name}-delta"
    if "delta" in formats and not (delta_dir / "steps" / "_delta_log").exists():
        try:
            from warehouse.delta_migrate import migrate
        except ImportError:  # a checkout from before #35's split of warehouse/delta_lake.py
            from warehouse.delta_lake import migrate

        t0 = time.perf_counter()
        migrate(lake_dir, delta_dir)
        print(f"Delta copy {delta_dir}: {time.perf_counter() - t0:.1f} s", flush=True)
    os.sync()  # the rounds just written: their writeback must not land inside the first measurement
    asst, total = assistant_tokens(lake_dir, 0)
    asst2 = assistant_tokens(lake_dir, 1)[0] if args.double else 0
    roots = {"after": ROOT} | ({"before": args.baseline} if args.baseline else {})

    rows, verl_rows, own_rows = [], [], []
    for m in methods:
        # (label, kind, root, lake, round): every one run `reps` times, interleaved (a slow spell of this shared
        # machine hits the engine, its floor and the code before alike)
        def rep_cells(sides: list[str]) -> list[tuple]:
            cells = []
            for side in sides:
                root = roots[side]
                cells += [(f"{side} engine", "engine", root, lake_dir, 0)]
                if not args.no_compute:
                    cells += [(f"{side} compute", "compute", root, lake_dir, 0)]
                if "delta" in formats:
                    cells += [(f"{side} delta", "engine", root, delta_dir, 0)]
                if args.double:
                    cells += [(f"{side} 2x", "engine", root, lake_dir, 1)]
            # the floors write the advantages parts the engine wrote (so they run after it)
            cells.insert(1, ("floor", "floor", ROOT, lake_dir, 0))
            if "delta" in formats:
                cells += [("delta floor", "floor", ROOT, delta_dir, 0)]
            return cells

        runs: dict[str, list[dict]] = {c[0]: [] for c in rep_cells(list(roots))}
        # the sides' order alternates: neither side always runs first, or right after a write
        for rep in range(args.reps):
            for label, kind, root, lake, round_ in rep_cells(list(roots)[:: 1 if rep % 2 == 0 else -1]):
                os.sync()  # the last cell's writes land before this cell's clock
                time.sleep(args.idle)
                res = sub("--root", str(root), "--worker", kind, str(lake), str(round_), m)
                runs[label].append(res)
        ref_s = 0.0
        if not args.no_compute:
            rf = sub("--ref-groups", str(args.ref_groups), "--worker", "reference", str(lake_dir), "0", m)
            ref_s = rf["seconds"] * asst / max(rf["assistant_tokens"], 1)
        g = runs.get
        row = [m]
        for side in roots:
            row += [_pair(g(f"{side} engine")), _ratio(g(f"{side} engine"), g("floor"))]
            row += [_ratio(g(f"{side} engine"), g("floor"), key_b="seconds2")]
            row += [_ratio(g(f"{side} engine"), g("floor"), key="cpu_s")]
            row += [_ratio(g(f"{side} engine"), g("floor"), key="cpu_s", key_b="cpu_s2")]
        row += [_pair(g("floor"))]
        if "delta" in formats:
            for side in roots:
                row += [_pair(g(f"{side} delta")), _ratio(g(f"{side} delta"), g("delta floor"))]
                row += [_ratio(g(f"{side} delta"), g("delta floor"), key_b="seconds2")]
                row += [_ratio(g(f"{side} delta"), g("delta floor"), key="cpu_s")]
                row += [_ratio(g(f"{side} delta"), g("delta floor"), key="cpu_s", key_b="cpu_s2")]
            row += [_pair(g("delta floor"))]
            row += [
                f"{statistics.median(r['commits_per_batch'] for r in runs[f'{side} delta']):.2f}"
                for side in roots
            ]
        if not args.no_compute:
            row += [_pair(g(f"{side} compute")) for side in roots]
            row += [_over_parts(g(f"{side} engine"), g("floor"), g(f"{side} compute")) for side in roots]
            row += [f"{ref_s / min(r['seconds'] for r in runs['after compute']):.0f}"]
        for side in roots:
            row += [_peak(g(f"{side} engine"))]
        if args.double:
            for side in roots:
                row += [
                    _pair(g(f"{side} 2x")),
                    _ratio(g(f"{side} 2x"), g(f"{side} engine"))
                    + f" / {_paired(g(f'{side} 2x'), g(f'{side} engine'))}",
                    _peak(g(f"{side} 2x")),
                    f"{max(r['tree_peak_mb'] for r in runs[f'{side} 2x']) / max(r['tree_peak_mb'] for r in runs[f'{side} engine']):.2f}",
                ]
        print("| " + " | ".join(row) + " |", flush=True)
        rows.append(row)
        own = [m]
        for side in roots:
            own += [_reads(g(f"{side} engine"))]
            own += [_ratio_its_floor(g(f"{side} engine"), g("floor"), cpu) for cpu in (False, True)]
        own_rows.append(own)
    headers = ["method"]
    for side in roots:
        headers += [
            f"{side}: wall s",
            f"{side}: x floor",
            f"{side}: x two-read floor",
            f"{side}: x floor CPU",
            f"{side}: x two-read floor CPU",
        ]
    headers += ["I/O floor s"]
    if "delta" in formats:
        for side in roots:
            headers += [
                f"Delta {side}: wall s",
                f"Delta {side}: x floor",
                f"Delta {side}: x two-read floor",
                f"Delta {side}: x floor CPU",
                f"Delta {side}: x two-read floor CPU",
            ]
        headers += ["Delta I/O floor s"]
        headers += [f"Delta {side}: commits per batch" for side in roots]
    if not args.no_compute:
        headers += [f"{side}: compute s (no I/O)" for side in roots]
        headers += [f"{side}: x (floor + compute)" for side in roots] + ["reference / compute (after)"]
    headers += [f"{side}: peak MB (tree)" for side in roots]
    if args.double:
        for side in roots:
            headers += [
                f"{side} 2x round: wall s",
                f"{side} 2x / 1x time (min, median, paired)",
                f"{side} 2x: peak MB",
                f"{side} 2x / 1x memory",
            ]

    if args.verl:
        # (method, gamma, lam): verl's defaults (algorithm.gamma = lam = 1, gae's too: the telescoped path), a
        # discounted gae (the recursion), and turn_ppo at its defaults, verl timed with the same gamma and lam
        configs = [("gae", 1.0, 1.0), ("gae", 0.99, 0.95), ("turn_ppo", 0.99, 0.9)]
        vruns: dict[tuple, list[dict]] = {}
        for _ in range(args.reps):
            for m, gamma, lam in configs:
                for side, root in roots.items():
                    kind = f"verl:1:{gamma}:{lam}"
                    res = sub("--root", str(root), "--worker", kind, args.verl, "0", m)
                    vruns.setdefault((m, gamma, lam, side), []).append(res)
        for m, gamma, lam in configs:
            row = [m, f"{gamma} / {lam}"]
            verl_all = [r for side in roots for r in vruns[(m, gamma, lam, side)]]
            verl_s, verl_med = (
                min(r["verl"] for r in verl_all),
                statistics.median(r["verl"] for r in verl_all),
            )
            row += [f"{verl_s:.2f} / {verl_med:.2f}"]
            for side in roots:
                rs = vruns[(m, gamma, lam, side)]
                for key in ("estimate", "arrow"):  # min / median over the workers; the ratios of each
                    lo, mid = min(r[key] for r in rs), statistics.median(r[key] for r in rs)
                    row += [f"{lo:.3f} / {mid:.3f}", f"{verl_s / lo:.1f} / {verl_med / mid:.1f}"]
            print("| " + " | ".join(row) + " |", flush=True)
            verl_rows.append(row)
    own_headers = ["method"]
    for side in roots:
        own_headers += [
            f"{side}: reads a batch (steps, trajectories)",
            f"{side}: x its durable floor",
            f"{side}: x its durable floor CPU",
        ]
    verl_headers = ["method", "gamma / lam", "verl s min / median"]
    for side in roots:
        verl_headers += [
            f"{side}: estimate s min / median",
            f"{side}: verl / estimate",
            f"{side}: from Arrow s min / median",
            f"{side}: verl / from Arrow",
        ]

    load_at_end = uptime()
    base = f" `{args.baseline}`" if args.baseline else ""
    lines = [
        "# Credit engine benchmark",
        "",
        f"Round: {args.groups} groups x {args.samples} samples x {args.turns} turns x ~{args.tokens} tokens "
        f"(pipeline/synth.py, kind=mixed): {asst:,} assistant tokens, {total:,} tokens in all"
        + (f"; the 2x round: {asst2:,} assistant tokens" if args.double else "")
        + ". Batches of 64 groups, processed as `creditflow process` does: the statistics pass over every batch "
        "first where the method takes a statistic over the round (gae, turn_ppo, gdpo), then "
        "flows.batch.credit_batch per batch with the round's statistics (read the steps columns the method needs "
        "+ trajectories, build the context, estimate, write the advantages part and the stage_runs row)."
        + (f" Stage settings of every worker (`--stages`): `{args.stages}`." if args.stages else ""),
        "",
        f"Load: `{load_at_start}` at the start, `{load_at_end}` at the end (a machine shared with other agents: "
        "every figure of a row comes from the same interleaved repetitions). " + machine_note(),
        "",
        f'Cells: min / median of {args.reps} repetitions, each its own subprocess; "before" is the code of the '
        f'baseline worktree{base}, "after" this checkout, interleaved cell by cell on the same lake, the sides\' '
        "order alternating from one repetition to the next, each cell after a sync"
        + (f" and {args.idle:g} s idle (`--idle`)" if args.idle else "")
        + ". x floor: "
        "engine / I/O floor (min / min, median / median); x floor CPU: the same of the timed region's CPU time (time.process_time: every thread of the worker; less sensitive to the load than wall time). Delta commits per batch: the entries the engine's timed region added to the Delta logs, over the batches (median). Peak MB (tree): the most of the worker's process tree "
        "(summed resident sets sampled every 20 ms, or the worker's own VmHWM where more; bench/_common.py), the "
        "largest over the repetitions. Both checkouts' engine workers import what every process of a round "
        "imports once (the credit and stage modules, pandas through pyarrow's first pa.array) before the clock "
        "starts.",
        "",
        "I/O floor: pyarrow only, read the steps columns the method needs (`registry.method_step_columns`) + the "
        "trajectories, write the method's advantages part with the lake's writer options (Delta: delta-rs, one "
        "commit per part). Compute: the engine from the same Arrow tables in memory (no I/O), after one untimed "
        "warm-up call. x (floor + compute): engine / (floor + compute), the two-read floor where the method has a "
        "statistics pass: what the engine spends beyond its I/O and its arithmetic (1.00: nothing). Reference: "
        "the per-trajectory Python oracle of tests/test_credit_reference.py, timed on "
        f"{args.ref_groups} groups and extrapolated to the round by assistant tokens. Two-read floor (the methods "
        "with a statistics pass: gae, turn_ppo, gdpo): the floor plus the statistics pass's own read of its steps "
        "columns (`registry.statistics_step_columns`) and the trajectories, what a method whose advantages depend "
        "on the whole round must read at the least when it holds no batch between its two passes, i.e. with memory "
        "flat in the round's size; x two-read floor (wall) and x two-read floor CPU are the engine against it.",
        "",
        *md_table(headers, rows),
        "",
        "**Against the durable floor of its reads** (hive; min / min, median / median): the floor's reads of "
        "what the engine read (the method's steps columns and the trajectories, and the statistics pass's read "
        "of the steps, or of the trajectories, only where the engine read that file twice a batch: counted in "
        "the engine's worker, `pq.ParquetFile.read`), and the advantages part written as the lake must write "
        "it, atomic and durable (a temporary file, synced, renamed, its folder synced; the floor above writes "
        "it without a sync, and so do a Delta lake's writes).",
        "",
        *md_table(own_headers, own_rows),
    ]
    if verl_rows:
        lines += [
            "",
            f"## GAE and turn_ppo beside verl's compute_gae_advantage_return ({args.verl}, compute only)",
            "",
            f"A batch of {args.verl.replace('x', ' trajectories x ')} assistant tokens (8 assistant steps each, "
            "critic values on every token), verl's function on its padded tensors (rewards on the last token, "
            "an all-ones response mask) with the same gamma and lam, interleaved with ours in each worker "
            "(verl, ours, verl, ours), the fastest of each. estimate: run_methods on a built context (the "
            "estimator with the contract checks); from Arrow: process_batch from the Arrow tables (context, "
            "estimate, advantages table). verl's column pools its runs in both workers.",
            "",
            *md_table(verl_headers, verl_rows),
        ]
    write_md(args.out, lines)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
