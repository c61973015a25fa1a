"""The plain per-batch work of a round, without Prefect: `run_stage` reads one batch of whole groups from the
lake, calls the stage's function (pipeline.stages.BatchStage: what it reads and writes is on the declaration),
writes its parts and a `stage_runs` row, and returns a small summary (a dict). The flow's tasks
(flows/process_round.py) call exactly this; the benchmarks run it bare."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pyarrow as pa
import pyarrow.compute as pc

from flows.caching import stage_cache_key
from flows.runtime import freeze_heap
from pipeline.config import Config
from pipeline.credit.process import (
    CREDIT,
    STATS,
    forget_credit_batches,
    keeping_credit_batches,
    kept_bytes,
    merge_statistics,
    statistics_from_json,
    statistics_methods,
    statistics_table,
)
from pipeline.stages import NO_IO, BatchStage, StageIO, StageOutput, execute, get_stage
from pipeline.stages import round_stages as round_stages
from schemas import TABLES, is_text
from warehouse.lake import Lake
from warehouse.rounds import batch_names, read_batch
from warehouse.runlog import flush_stage_runs, record_stage_runs, stage_run_row


def stage_io(config: Config) -> StageIO:
    """The effects an LLM stage gets: the shared OpenAI-compatible client, and a thread pool for its checks."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.counterfactual.stage import CounterfactualSettings
    from trainer import sandbox  # registers the `code_tests` verifier (it runs candidate code: trainer floor)
    from trainer.llm.client import LLMClient

    sandbox.configure(config=config)
    workers = config.settings(CounterfactualSettings).verify_workers

    def pool_map(fn, *iterables):
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(fn, *iterables))

    return StageIO(llm=LLMClient, map=pool_map)


# ---- the statistics pass's reads, kept for credit ------------------------------------------------------
# A method with a round statistic (gae, turn_ppo, gdpo) reads each batch twice: the statistics pass, then
# credit. Where both run in one process (flows.batch.round_statistics then run_stage: the plain path, the
# benchmarks), the statistics pass reads the steps columns credit reads too and keeps what it read, keyed by
# the part's identity (Lake.part_stat: path, size, mtime), and credit's read of the same part takes it from
# here (the very table when the columns are the same: credit then starts from the credit batch the statistics
# pass built, pipeline.credit.process.keeping_credit_batches; columns it lacks are read from disk); an entry
# is used once. A rewritten part has another identity: never served. Bounded: an entry that would take the
# kept bytes past CREDITFLOW_READ_CACHE_MB (unset: the default below; 0: off; 256 was the default before) is
# not kept (that batch is read again); a 64-group batch of 3.1M tokens keeps ~21 MB for gae. The flow
# (flows/process_round.py) keeps too where its statistics task and credit task of a batch run in the same
# process (the thread runner without worker processes), for the span of the round (`keeping_round`: what
# credit did not take is dropped when the round ends or fails). Measured (bench/results/credit.md, #36 "kept
# reads on by default"): the second read of the steps was 70-240 ms of a 2-batch gae round's 0.40-0.71 s. Off
# by default since the round of the issue's own scale (512 groups, 8 batches, bench/results/credit.md "#36 at
# the issue's scale"): a 256 MB bound kept 5 of 8 batches, the statistics pass then cost 1.22-1.86 s against
# 0.75-0.82 s (it reads credit's columns and builds credit batches) and credit saved only 0.2-0.4 s: a round's
# CPU 2.05-2.61 s kept, 1.76-1.88 s off, and ~300 MB more at peak. A round whose batches all fit (a small one)
# still gains ~0.1 s with it on. What made keeping dear there is the per-token lists (gae's critic values) the
# statistics pass then reads and holds for credit. So with CREDITFLOW_READ_CACHE_MB unset, a pass that reads
# nothing bulky itself (`_bulky`: per-token lists, nested columns, text) keeps what it reads plus credit's other
# columns, a few numbers a step (`_keep_plan`), within LIGHT_READ_CACHE_MB: a few MB a round. Credit then reads
# again only its bulky columns: nothing for GDPO (and it takes the credit batch the pass built), the critic
# values for gae, the contents for gigpo; turn_ppo's pass reads the values itself and keeps nothing.
READ_CACHE_ENV = "CREDITFLOW_READ_CACHE_MB"
READ_CACHE_MB = 0  # the default bound: off (but for reads of nothing bulky, LIGHT_READ_CACHE_MB)
LIGHT_READ_CACHE_MB = 64  # the default bound for reads of nothing bulky (a 512-group GDPO round keeps ~10 MB)
# part identity -> (what was read, whether every column, its bytes: counted once, not at every read)
_kept: dict[tuple, tuple[pa.Table, bool, int]] = {}
_owned: dict[
    tuple[str, int], set[int]
] = {}  # (lake URI, round) -> ids of the tables it kept (its batches' keys)
_rounds: dict[tuple[str, int], int] = {}  # the rounds a flow of this process runs with kept reads
_lock = threading.Lock()  # the flow's threads keep and take side by side


def _cache_budget(light: bool = False) -> int:
    """The kept reads' bound in bytes: CREDITFLOW_READ_CACHE_MB where set, else READ_CACHE_MB, or
    LIGHT_READ_CACHE_MB for reads of nothing bulky (`light`, `_bulky`)."""
    raw = os.environ.get(READ_CACHE_ENV)
    default = LIGHT_READ_CACHE_MB if light else READ_CACHE_MB
    try:
        return int(float(raw if raw is not None else default) * 2**20)
    except ValueError:
        return 0


_SHORT_TEXT = ("traj_id", "role")  # the steps' short strings: a step's keys


def _bulky(columns: list[str]) -> list[str]:
    """The steps columns among `columns` that make a read big: the per-token lists (token_ids, logprobs, values),
    the other nested ones (tool calls) and free text (a step's content); not the numbers, flags and a step's
    short keys."""
    schema = TABLES["steps"].schema
    return [
        c
        for c in columns
        if c in schema.names
        and c not in _SHORT_TEXT
        and (pa.types.is_nested(t := schema.field(c).type) or is_text(t))
    ]


def _keep_plan(own: list[str] | None, config: Config, keep_reads: bool) -> tuple[list[str] | None, int]:
    """What the statistics pass reads of the steps (`own`: the columns the stage itself reads) and the bound it
    keeps its reads within (0: keeps nothing).
    With CREDITFLOW_READ_CACHE_MB set: credit's columns too, within that bound (the very reads credit asks for:
    served whole). Unset (the default): where the pass itself reads nothing bulky (`_bulky`: per-token lists,
    text), credit's other columns too (a few numbers a step), within LIGHT_READ_CACHE_MB: credit reads again only
    its bulky columns (gae's critic values, gigpo's contents), or nothing (GDPO); a pass that reads per-token
    lists (turn_ppo's values) keeps nothing."""
    if not keep_reads or own is None:
        return own, 0
    wanted = get_stage(CREDIT).columns(config) or []
    if os.environ.get(READ_CACHE_ENV) is not None:
        budget = _cache_budget()
    else:
        budget = _cache_budget(light=not _bulky(own))
        wanted = [c for c in wanted if c not in _bulky(wanted)]
    if budget and _used() < budget:  # credit's columns too, in its order
        return [*wanted, *(c for c in own if c not in wanted)], budget
    return own, budget


def _used() -> int:
    return sum(n for _, _, n in list(_kept.values())) + kept_bytes()


def _part_key(lake: Lake, table: str, round_: int, batch: str) -> tuple:
    return (lake.uri, table, int(round_), *lake.part_stat(table, round_, batch))


def _read(
    lake: Lake,
    table: str,
    round_: int,
    batch: str,
    columns: list[str] | None = None,
    keep: bool = False,
    budget: int = 0,
) -> pa.Table:
    """read_batch of trajectories / steps, through the statistics pass's kept reads: `keep` keeps this read
    (the statistics pass) while the kept bytes stay within `budget`; otherwise a kept read of the same part is
    used (and dropped)."""
    # kept reads off (no budget): no part identity to take (a Delta lake's costs ~1 ms)
    key = _part_key(lake, table, round_, batch) if ((keep and budget > 0) or _kept) else None
    with _lock:
        hit = not keep and key in _kept and (columns is not None or _kept[key][1])
        got = _kept.pop(key)[0] if key is not None and hit else None
    if got is not None:
        if columns is None or got.column_names == columns:  # the very table (credit's kept batch: its key)
            return got
        missing = [c for c in columns if c not in got.column_names]
        if missing:
            extra = read_batch(lake, table, round_, batch, columns=missing)
            if extra.num_rows != got.num_rows:  # not the same part after all: read it whole
                return read_batch(lake, table, round_, batch, columns=columns)
            for name in missing:
                got = got.append_column(extra.schema.field(name), extra.column(name))
        return got.select(columns)
    out = read_batch(lake, table, round_, batch, columns=columns)
    if key is not None and keep and key[-2] >= 0:
        with _lock:
            if _used() + (nbytes := out.nbytes) <= budget:
                _kept[key] = (out, columns is None, nbytes)
                _owned.setdefault((lake.uri, int(round_)), set()).add(id(out))
    return out


def _forget_kept(lake_uri: str | None = None, round_: int | None = None) -> None:
    """Drop the kept reads and the credit batches built from them: of round `round_` of `lake_uri` (its flow
    ending, `keeping_round`), else of every round no flow of this process is running (a plain statistics pass
    starting: what an earlier one kept and no credit used is not held on to)."""
    with _lock:
        if lake_uri is None:
            drop = [k for k in {*_owned, *((u, r) for u, _, r, *_ in _kept)} if k not in _rounds]
        else:
            drop = [(lake_uri, int(round_ or 0))]
        tables = {t for k in drop for t in _owned.pop(k, set())}
        for key in [k for k in _kept if (k[0], k[2]) in drop]:
            del _kept[key]
    if lake_uri is None and not _rounds:
        forget_credit_batches()
    else:
        forget_credit_batches(tables)


@contextmanager
def keeping_round(lake: Lake, round_: int) -> Iterator[None]:
    """Within: the flow's statistics tasks of this round keep their reads and credit batches for its credit tasks
    (`keeps_round`); at the end (or on an error) whatever credit did not take is dropped: nothing is held past
    the round (a cached credit task, a failed one)."""
    key = (lake.uri, int(round_))
    with _lock:
        _rounds[key] = _rounds.get(key, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _rounds[key] -= 1
            last = not _rounds[key]
            if last:
                del _rounds[key]
        if last:
            _forget_kept(*key)


def forget_round(lake_uri: str, round_: int) -> None:
    """Drop what round `round_` of the lake keeps: a statistics task that finished after its round's stages
    ended (the flow failed while it ran) calls it, so nothing it kept is held past the round."""
    _forget_kept(lake_uri, round_)


def keeps_round(lake_uri: str, round_: int) -> bool:
    """Whether a flow of this process runs round `round_` of the lake with kept reads (`keeping_round`)."""
    return (lake_uri, int(round_)) in _rounds


def _tokens(steps: pa.Table, own: list[str] | None = None) -> int:
    """The batch's tokens, as far as the stage read them (0 for a stage that reads neither n_tokens nor
    token_ids: a statistics pass whose statistics read no tokens, `RoundStatistics.tokens`). `own`: the columns
    the stage itself reads (None: every column), where it read more for credit (the kept reads)."""
    names = [c for c in steps.column_names if own is None or c in own]
    if "n_tokens" in names:
        return int(pc.sum(steps.column("n_tokens")).as_py() or 0)
    if "token_ids" not in names:
        return 0
    return int(pc.sum(pc.list_value_length(steps.column("token_ids"))).as_py() or 0)


# ---- plain per-batch work (what the flow's tasks call; the benchmark's bare baseline) --------------------

STAGE_NOTE = "creditflow stage: "  # flows.cli.error_line's one line names the stage and batch from it


def stage_note(stage: BatchStage, batch: str) -> str:
    """The note a stage's error carries out of its task (or a statistics pass over several batches): which
    stage failed, on which batch."""
    return f"{STAGE_NOTE}{stage.name} on batch {batch}"


@dataclasses.dataclass
class _Done:
    """A batch stage's work before its writes: the parts to write ({table: {part: table}}), how much it read
    (the summary's counts: not the tables, which a pass over several batches must not hold) and its notes."""

    parts: dict[str, dict[str, pa.Table]]
    trajectories: int
    steps: int
    tokens: int
    rows: dict[str, int]
    out: StageOutput
    seconds: float  # reading and computing


def _compute(
    lake: Lake,
    round_: int,
    batch: str,
    stage: BatchStage,
    config: Config,
    cache_key: str | None,
    round_stats: dict[str, list[float]] | None,
    keep_reads: bool,
) -> _Done:
    """run_stage less its writes: read the batch's inputs, call the stage's function, lay out its parts."""
    t0 = time.perf_counter()
    own = stage.columns(config)
    columns, budget = _keep_plan(own, config, keep_reads)
    traj = _read(lake, "trajectories", round_, batch, keep=keep_reads, budget=budget)
    steps = _read(lake, "steps", round_, batch, columns=columns, keep=keep_reads, budget=budget)
    with _lock:
        held = [t for t, _, _ in _kept.values()]
    kept = keep_reads and any(t is steps for t in held) and any(t is traj for t in held)  # both: its key
    inputs = {key: read_batch(lake, table, round_, part) for table, part, key in stage.reads(batch, config)}
    if stage.round_statistics:
        if round_stats is not None:
            inputs[STATS] = statistics_table(statistics_from_json(round_stats), round_)
        elif statistics_methods(config):
            inputs[STATS] = statistics_table(round_statistics(lake, round_, config), round_)
    io = stage_io(config) if stage.calls_llm(config) else NO_IO
    with keeping_credit_batches() if kept else nullcontext():  # the statistics pass's batch, kept for credit
        out = execute(stage.fn(traj, steps, config, inputs, io=io), io)  # an LLM stage's requests: sent here
    source = None
    if stage.records_source:
        source = cache_key or stage_cache_key(lake, round_, batch, stage, config)
    rows: dict[str, int] = {}
    parts: dict[str, dict[str, pa.Table]] = {}  # a table's parts of this batch (one per method): one write
    for table, part, key in stage.writes(batch, config.methods):
        result = out.tables[key]
        if source is not None:
            result = result.set_column(
                result.schema.get_field_index("source"),
                "source",
                pa.array([source] * result.num_rows, pa.string()),
            )
        parts.setdefault(table, {})[part] = result
        rows[table] = rows.get(table, 0) + result.num_rows
    seconds = time.perf_counter() - t0
    return _Done(parts, traj.num_rows, steps.num_rows, _tokens(steps, own), rows, out, seconds)


def _summary(stage: str, batch: str, seconds: float, done: _Done) -> dict:
    """A batch stage's summary (what its task returns; its run-log row, `_run_row`)."""
    summary = {
        "stage": stage,
        "batch": batch,
        "seconds": seconds,
        "trajectories": done.trajectories,
        "steps": done.steps,
        "tokens": done.tokens,
        "rows_out": done.rows,
        "notes": dict(done.out.notes or {}),
        "warnings": list(done.out.warnings or []),
    }
    if done.out.failures:  # an LLM stage's requests that failed for good, by cause (flows.run: degradation)
        summary["failures"] = dict(done.out.failures)
    return summary


def _run_row(round_: int, summary: dict, cache_key: str | None) -> dict[str, pa.Table]:
    """The summary's row of the lake's run log (`stage_runs`), {its part: the row}."""
    stage, batch = summary["stage"], summary["batch"]
    fields = ("seconds", "trajectories", "steps", "tokens", "rows_out", "notes", "warnings")
    row = stage_run_row(round_, stage, batch, cache_key=cache_key, **{k: summary[k] for k in fields})
    return {f"{stage}.{batch}": row}


def run_stage(
    lake: Lake | str,
    round_: int,
    batch: str,
    stage: BatchStage,
    config: Config,
    cache_key: str | None = None,
    round_stats: dict[str, list[float]] | None = None,
    keep_reads: bool = False,
) -> dict:
    """One batch stage on one batch, from its declaration: read its inputs, call its function, write its outputs
    as parts named like the batch (per method: `<batch>.<method>`). `round_stats`: the round's merged moments
    (`process.statistics_json`) for a stage that reads them, as the flow passes them; None: read (or made)
    here from the lake. A flow task passes the lake's URI and the stage (to a worker process by name,
    `BatchStage.__reduce__`). `keep_reads`: keep the trajectories and steps read (with the steps columns credit
    reads too) and the credit batch the stage builds, for credit in this process (the statistics pass:
    `round_statistics`)."""
    freeze_heap()  # the process's imports, out of the collector's passes (once per process)
    t0 = time.perf_counter()
    lake = Lake(lake) if isinstance(lake, str) else lake
    done = _compute(lake, round_, batch, stage, config, cache_key, round_stats, keep_reads)
    for table, parts in done.parts.items():
        lake.write_parts(table, round_, parts)
    summary = _summary(stage.name, batch, time.perf_counter() - t0, done)
    # after its parts: the run log describes what is on disk
    record_stage_runs(lake, round_, _run_row(round_, summary, cache_key))
    return summary


def statistics_pass(lake: Lake, round_: int, sources: dict[str, str], config: Config) -> dict[str, pa.Table]:
    """The statistics pass over several batches at once (a plain caller's `round_statistics`): each batch's
    rows computed as run_stage computes them (its reads kept for credit in this process, `_read`), then every
    batch's part written in one `write_parts` (one Delta commit for the round, not one per batch: 8-15 ms
    each), then each batch's run-log row, its seconds its own work plus its share of the write. `sources`:
    {batch: the statistics stage's cache key for it}. Returns {batch: its part as the lake stores it}, not
    read back. Memory: a batch's rows are a few moments; what each pass read is dropped (or kept within the
    budget) as before."""
    freeze_heap()
    stage = get_stage(STATS)
    done: dict[str, _Done] = {}
    for b, key in sources.items():
        try:
            done[b] = _compute(lake, round_, b, stage, config, key, None, True)
        except Exception as exc:  # the batch it failed on (one error line, flows.cli.error_line)
            exc.add_note(stage_note(stage, b))
            raise
    t0 = time.perf_counter()
    lake.write_parts(STATS, round_, {b: d.parts[STATS][b] for b, d in done.items()})
    share = (time.perf_counter() - t0) / max(len(done), 1)
    rows: dict[str, pa.Table] = {}
    for b, d in done.items():
        rows |= _run_row(round_, _summary(stage.name, b, d.seconds + share, d), sources[b])
    record_stage_runs(lake, round_, rows)  # one write_parts on hive, spooled on Delta
    return {b: TABLES[STATS].conform(d.parts[STATS][b]) for b, d in done.items()}


def current_statistics(lake: Lake, round_: int, batch: str, config: Config) -> tuple[pa.Table, str]:
    """A batch's `credit_stats` part and what it must have been computed from to be current (the statistics
    stage's cache key: its input parts, the settings it reads, its code); the part is current when every row's
    `source` is that key."""
    return read_batch(lake, STATS, round_, batch), stage_cache_key(
        lake, round_, batch, get_stage(STATS), config
    )


def is_current(part: pa.Table, source: str) -> bool:
    return part.num_rows > 0 and set(part.column("source").to_pylist()) == {source}


def round_statistics(lake: Lake, round_: int, config: Config, batches: list[str] | None = None) -> dict:
    """The round's merged moments from every batch's `credit_stats` part, in batch order. A batch without a
    current part (`current_statistics`) gets the statistics pass first (`statistics_pass`: those batches'
    parts in one write), so a plain caller of the credit stage gets the round's statistics too; that pass keeps
    what it read for credit in this process (`_read`)."""
    if not statistics_methods(config):
        return {}
    batches = round_batches(lake, round_) if batches is None else batches
    if not keeps_round(lake.uri, round_):  # the flow's barrier keeps what its statistics tasks kept
        _forget_kept()
    parts: dict[str, pa.Table] = {}
    missing: dict[str, str] = {}
    for b in batches:
        part, source = current_statistics(lake, round_, b, config)
        if is_current(part, source):
            parts[b] = part
        else:  # computed below, every missing batch's part in one write (what it wrote, not read back)
            missing[b] = source
    if missing:
        parts |= statistics_pass(lake, round_, missing, config)
    return merge_statistics(pa.concat_tables([parts[b].select(["key", "n", "mean", "m2"]) for b in batches]))


def finish_round(lake: Lake, round_: int) -> int:
    """What a round's plain caller does after its last stage: commit the run log's spooled rows (one commit
    on a Delta lake, warehouse.runlog.flush_stage_runs; the flow's summary does it at the round's end).
    Returns the rows committed."""
    return flush_stage_runs(lake, round_)


def run_batch_plain(lake: Lake, round_: int, batch: str, config: Config) -> list[dict]:
    """Every stage on one batch, in order, without Prefect (credit takes the round's statistics from the lake,
    running the statistics pass on the batches that lack it)."""
    return [run_stage(lake, round_, batch, stage, config) for stage in round_stages(config)]


def round_batches(lake: Lake, round_: int) -> list[str]:
    names = batch_names(lake, round_)
    if not names:
        raise FileNotFoundError(f"round {round_} has no trajectories in {lake.root}")
    return names
