"""Benchmark: process_round_flow on a ~16M-token synthetic round with rule-based stages (detect, rules
annotate, credit for grpo, grpo+c3, grpo+iapo, tcpo_retro_hin, export, stats), next to the same plain
per-batch functions run without Prefect, in the same script.

Each mode runs in its own subprocess (a fresh copy of the round's trajectories/steps), so peak RSS is per
mode:
- bare-1:   the plain functions (flows/batch.py) batch after batch, then the stats, no Prefect;
- bare-2:   the same with 2 threads over batches (does the work itself release the GIL?);
- bare-2p:  the same in 2 worker processes (flows/workers.py's pool, a batch's stages per call, no Prefect):
            what two processes reach on this machine (the ceiling for flow-2 / flow-1);
- flow-1:   process_round_flow, thread runner, 1 worker (orchestration overhead = flow-1 / bare-1), its
            batch stages in a worker process (flow.processes=auto, the default);
- flow-2:   thread runner, 2 workers (speed-up = flow-1 / flow-2), the batch stages in 2 worker processes;
- flow-2n:  flow-2 with the run's own Prefect API server at normal priority during the stages (flow.api_idle=false;
            flow-2 runs it under SCHED_IDLE then, flows/api_priority.py);
- flow-2t, flow-1t: thread runner, 2 / 1 workers, stages in the flow's threads (flow.processes=false);
- rerun:    flow-2 again on its finished lake (every batch stage cached);
- ray-2, dask-2: (--ray) the process-based runners: a local Ray with 2 CPUs, a local Dask cluster with 2
            single-threaded worker processes.
The Prefect API (ephemeral) is started before the clock in flow modes; its start-up is reported apart.

    python bench/flows.py                       # 768 groups x 8 samples x 5 turns x 300 tokens ~ 16.5M tokens
    python bench/flows.py --groups 64 --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS_ENV = "CREDITFLOW_BENCH_METHODS"  # --methods: the parent sets it, each mode's process reads it
METHODS = (os.environ.get(METHODS_ENV) or "grpo,grpo+c3,grpo+iapo,tcpo_retro_hin").split(",")


def _config(lake: str, workers: int, runner: str = "threads", processes: str = "auto", api_idle: bool = True):
    from flows.config import load_config

    return load_config(
        None,
        ["flow.progress=false", f"flow.processes={processes}", f"flow.api_idle={api_idle}"],
        lake=lake,
        methods=METHODS,
        task_runner=runner,
        max_workers=workers,
    )


class TreeRSS:
    """Peak resident memory of this process and its descendants (the flow's worker processes), sampled every
    100 ms from /proc (each process's children and statm: a few small reads, where psutil's children() scans
    every process on the machine and cost ~1.5 s of CPU and GIL per run); Prefect's API server process is left
    out (it is not part of the work). Used in every mode, bare ones included, so each pays the same."""

    def __init__(self, interval: float = 0.1) -> None:
        import threading

        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._skip: dict[int, bool] = {}
        self._cpu: dict[int, tuple[float, str]] = {}  # last CPU reading and role of every descendant seen
        self._cpu0: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self, pid: int) -> list[int]:
        pids, todo = [], [pid]
        while todo:
            p = todo.pop()
            pids.append(p)
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{task}/children") as fh:
                        todo.extend(int(c) for c in fh.read().split())
            except OSError:  # a process that just ended
                pass
        return pids

    def _is_api(self, pid: int) -> bool:
        """Prefect's API server (uvicorn), from the process's command line (read once per process)."""
        if pid not in self._skip:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    self._skip[pid] = b"uvicorn" in fh.read()
            except OSError:
                return False
        return self._skip[pid]

    def _rss(self, pid: int) -> int:
        if self._is_api(pid):
            return 0
        try:
            with open(f"/proc/{pid}/statm") as fh:
                return int(fh.read().split()[1]) * self._page
        except OSError:
            return 0

    def _sample(self) -> None:
        me = os.getpid()
        pids = self._tree(me)
        self.peak = max(self.peak, sum(self._rss(p) for p in pids))
        for p in pids:
            if p != me and (c := _proc_cpu(p)) is not None:
                self._cpu[p] = (c, "api" if self._is_api(p) else "workers")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds spent during the block by this process, Prefect's API server and the worker processes
        (descendants sampled with the memory; one that ended between two samples loses < interval)."""
        out = {"self": sum(os.times()[:2]) - self._self0, "api": 0.0, "workers": 0.0}
        for pid, (cpu, role) in self._cpu.items():
            out[role] += cpu - self._cpu0.get(pid, 0.0)
        return {k: round(v, 2) for k, v in out.items()}

    def __enter__(self):
        self._sample()
        self._cpu0 = {p: c for p, (c, _) in self._cpu.items()}
        self._self0 = sum(os.times()[:2])
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) so far of one process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stats(lake) -> dict:
    from flows.summary import round_summary
    from warehouse.catalog import refresh

    refresh(lake)
    return round_summary(lake, 0)


def child(mode: str, lake_dir: str) -> dict:
    from flows.batch import run_batch_plain
    from flows.runtime import tune_allocator
    from warehouse.lake import Lake
    from warehouse.rounds import batch_names

    tune_allocator()  # as the CLI and the flow do, for the bare modes too
    import warehouse.catalog  # noqa: F401  (DuckDB: imported before the clock in every mode, as the CLI does)

    lake = Lake(lake_dir)
    out: dict = {"mode": mode}
    if mode.startswith("bare"):
        workers = int(mode.split("-")[1].rstrip("p"))
        cfg = _config(lake_dir, workers)
        batches = batch_names(lake, 0)
        from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

        if mode.endswith("p"):  # worker processes, started (and their imports done) before the clock
            import multiprocessing as mp

            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(
                ["flows.batch", "pipeline.credit", "pipeline.export", "pipeline.stages"]
            )
            procs = ProcessPoolExecutor(workers, mp_context=ctx, initializer=tune_allocator)
            list(procs.map(time.sleep, [0.2] * workers))
        t0 = time.perf_counter()
        with TreeRSS() as tree:
            if workers == 1:
                for b in batches:
                    run_batch_plain(lake, 0, b, cfg)
            elif mode.endswith("p"):  # a whole batch's stages per call, no Prefect
                list(
                    procs.map(
                        run_batch_plain,
                        [lake] * len(batches),
                        [0] * len(batches),
                        batches,
                        [cfg] * len(batches),
                    )
                )
                procs.shutdown()
            else:
                with ThreadPoolExecutor(workers) as pool:
                    list(pool.map(lambda b: run_batch_plain(lake, 0, b, cfg), batches))
            summary = _stats(lake)
        out["wall_s"] = time.perf_counter() - t0
        out["cpu_s"] = tree.cpu_seconds()
        out["tree_rss_mb"] = tree.peak / 2**20
    else:
        from prefect import flow

        from flows.run import run_process

        @flow
        def warmup() -> int:
            return 1

        runner = {"ray-2": "ray", "dask-2": "dask"}.get(mode) or (
            "processes" if mode.endswith("p") else "threads"
        )
        workers = int(mode.split("-")[1].rstrip("tpn"))
        cfg = _config(
            lake_dir,
            workers,
            runner,
            "false" if mode.endswith("t") else "auto",
            api_idle=not mode.endswith("n"),
        )
        from flows.run import prepare
        from flows.runners import worker_api

        t0 = time.perf_counter()
        imports = prepare(
            cfg
        )  # as `creditflow process` does first: worker processes and imports with the API
        with worker_api(cfg):  # the settings `creditflow process` gives its own API
            warmup()  # starts the ephemeral API
        imports.join()
        out["api_startup_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with TreeRSS() as tree:
            summary = run_process(cfg, 0, quiet=True)
        out["wall_s"] = time.perf_counter() - t0
        out["cpu_s"] = tree.cpu_seconds()
        out["tree_rss_mb"] = tree.peak / 2**20
        out["cached"] = sum(r["cached"] for r in summary["this_run"].values())
        out["stage_tasks"] = sum(r["batches"] for r in summary["this_run"].values())
    out["stage_seconds"] = {s: e["seconds"] for s, e in summary["stages"].items()}
    out["tokens"] = summary["tokens"]
    out["batches"] = summary["batches"]
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["children_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return out


def _copy_round(base: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for table in ("trajectories", "steps"):
        shutil.copytree(base / table, dest / table)


def _same_outputs(a: Path, b: Path) -> bool:
    """The same parts with the same data in both lakes (through the Lake API: hive files or Delta parts)."""
    from warehouse.lake import Lake

    la, lb = Lake(a), Lake(b)
    for table in ("advantages", "train_batch", "spans", "nodes", "edges"):
        pa_, pb_ = la.parts(table, 0), lb.parts(table, 0)
        if [p.name for p in pa_] != [p.name for p in pb_]:
            return False
        for x, y in zip(pa_, pb_, strict=True):
            if not la.read(table, 0, parts=[x]).equals(lb.read(table, 0, parts=[y])):
                return False
    return bool(la.parts("advantages", 0))


def run_child(mode: str, lake: Path, home: Path, baseline: Path | None = None) -> dict:
    """One mode in a fresh process; `baseline`: a `base:` mode runs that checkout's bench/flows.py (its code)."""
    script = Path(__file__)
    if mode.startswith("base:"):
        mode, script = mode[5:], (baseline or ROOT) / "bench" / "flows.py"
    env = {
        **os.environ,
        "PYTHONPATH": str(
            script.parents[1]
        ),  # its worker processes too import that checkout, not the installed one
        "CREDITFLOW_NO_SERVER": "1",  # each mode's own API, started before the clock (no shared API)
        "PREFECT_HOME": str(home),
        "PREFECT_LOGGING_LEVEL": "ERROR",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run(
        [sys.executable, str(script), "--child", mode, "--lake", str(lake)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--lake")
    ap.add_argument("--groups", type=int, default=768)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--batch-groups", type=int, default=64)
    ap.add_argument(
        "--ray",
        action="store_true",
        help="also run the process-based runners: Ray (2 CPUs), Dask (2 workers)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode (the best wall time is kept)")
    ap.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="seconds each run waits after its sync: a round that starts after the machine sat idle (on a virtual "
        "machine that hands free memory back to its host, as between a user's rounds)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "flows.md"))
    ap.add_argument("--quick", action="store_true", help="do not write the results file")
    ap.add_argument("--modes", default=None, help="comma-separated subset of the modes (with --quick)")
    ap.add_argument(
        "--double",
        action="store_true",
        help="also run every mode on a round of twice the groups, interleaved with the round's runs (each "
        "repetition runs both sizes back to back, the order alternating), and print the 2x / 1x ratios of "
        "wall time, CPU and tree memory (with --quick)",
    )
    ap.add_argument(
        "--methods",
        default=None,
        help="comma-separated method chains instead of the default (e.g. grpo,gae,turn_ppo,gdpo: "
        "with the statistics pass); a `base:` mode's checkout needs this option too",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout (e.g. a `git worktree` of the code before a change): `base:<mode>` modes run its "
        "bench/flows.py, interleaved with this one's",
    )
    args = ap.parse_args()
    if args.methods:
        os.environ[METHODS_ENV] = args.methods
        METHODS[:] = args.methods.split(",")
    if args.child:
        print(json.dumps(child(args.child, args.lake)))
        return

    from pipeline.synth import SynthSettings, iter_batches
    from warehouse.lake import Lake
    from warehouse.rounds import write_round_parts

    work = Path(tempfile.mkdtemp(prefix="bench-flows-"))
    try:
        base = work / "base"
        settings = SynthSettings(
            groups=args.groups,
            samples=args.samples,
            turns=args.turns,
            tokens=args.tokens,
            batch_groups=args.batch_groups,
        )
        t0 = time.perf_counter()
        write_round_parts(Lake(base), 0, iter_batches(settings))
        synth_s = time.perf_counter() - t0
        sizes = [("1x", base)]
        if args.double:
            base2 = work / "base-2x"
            settings2 = dataclasses.replace(settings, groups=2 * args.groups)
            write_round_parts(Lake(base2), 0, iter_batches(settings2))
            sizes.append(("2x", base2))
        double: dict[tuple[str, str], list[dict]] = {}
        modes = ["bare-1", "bare-2", "bare-2p", "flow-1", "flow-2", "flow-2n", "flow-1t", "flow-2t"] + (
            ["ray-2", "dask-2"] if args.ray else []
        )
        if args.modes:
            modes = args.modes.split(",")
        results: dict[str, dict] = {}
        walls: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(args.repeat):  # interleaved, so a slow spell of the machine hits every mode alike
            for mode in modes if rep % 2 == 0 else modes[::-1]:  # every other rep reversed: drift cancels
                for size, src in sizes if rep % 2 == 0 else sizes[::-1]:
                    lake = work / (mode if size == "1x" else f"{mode}-{size}")
                    _copy_round(src, lake)
                    # the previous run's writes (~1 GB of parts at 16M tokens) land before this run's clock
                    os.sync()
                    time.sleep(args.idle)
                    r = run_child(mode, lake, work / f"home-{mode}", args.baseline)
                    double.setdefault((mode, size), []).append(r)
                    if size == "1x":
                        walls[mode].append(r["wall_s"])
                        if mode not in results or r["wall_s"] < results[mode]["wall_s"]:
                            results[mode] = r
                    cpu = r.get("cpu_s", {})
                    print(
                        f"[{rep + 1}/{args.repeat}] {mode:8s} {size} {r['wall_s']:8.2f} s  "
                        f"peak RSS {r['peak_rss_mb']:7.0f} MB  tree RSS {r.get('tree_rss_mb') or 0:7.0f} MB  "
                        f"CPU s: self {cpu.get('self', 0):.1f} api {cpu.get('api', 0):.1f} "
                        f"workers {cpu.get('workers', 0):.1f}",
                        flush=True,
                    )
        if args.double:
            print("\n".join(double_table(modes, double)), flush=True)
        if args.modes:
            return
        results["rerun"] = run_child("flow-2", work / "flow-2", work / "home-flow-2")
        print(
            f"rerun    {results['rerun']['wall_s']:8.2f} s  cached {results['rerun']['cached']}", flush=True
        )
        same = _same_outputs(work / "bare-1", work / "flow-2")
        same_ray = (
            _same_outputs(work / "flow-2", work / "ray-2") and _same_outputs(work / "flow-2", work / "dask-2")
            if args.ray
            else None
        )
        report = render(args, settings, synth_s, results, walls, same, same_ray)
        print(report)
        if not args.quick:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(report)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def double_table(modes: list[str], runs: dict[tuple[str, str], list[dict]]) -> list[str]:
    """The 2x round against the round, per mode: wall, CPU (flow + API + workers) and tree memory, min / median
    of the repetitions and their ratios (the issue's bar: within 2.1x the time and 1.2x the memory)."""
    import statistics

    def cpu(r: dict) -> float:
        return sum(r.get("cpu_s", {}).values())

    def pair(xs: list[float], fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(min(xs))} / {fmt.format(statistics.median(xs))}"

    def ratio(a: list[float], b: list[float]) -> str:
        return f"{min(a) / min(b):.2f} / {statistics.median(a) / statistics.median(b):.2f}"

    lines = [
        "| mode | 1x wall s | 2x wall s | 2x / 1x wall | 1x CPU s | 2x CPU s | 2x / 1x CPU | 1x tree MB | 2x tree MB "
        "| 2x / 1x memory |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        one, two = runs.get((mode, "1x"), []), runs.get((mode, "2x"), [])
        if not one or not two:
            continue
        w1, w2 = [r["wall_s"] for r in one], [r["wall_s"] for r in two]
        c1, c2 = [cpu(r) for r in one], [cpu(r) for r in two]
        m1, m2 = max(r.get("tree_rss_mb") or 0 for r in one), max(r.get("tree_rss_mb") or 0 for r in two)
        lines.append(
            f"| {mode} | {pair(w1)} | {pair(w2)} | {ratio(w2, w1)} | {pair(c1, '{:.1f}')} | {pair(c2, '{:.1f}')} "
            f"| {ratio(c2, c1)} | {m1:.0f} | {m2:.0f} | {m2 / m1 if m1 else 0:.2f} |"
        )
    return lines


def _paired(walls: dict[str, list[float]], a: str, b: str) -> float:
    """Median over repetitions of wall(a) / wall(b), each pair run back to back (the machine's slow spells
    hit both)."""
    import statistics

    return statistics.median(x / y for x, y in zip(walls[a], walls[b], strict=True))


def render(
    args,
    settings,
    synth_s: float,
    r: dict[str, dict],
    walls: dict[str, list[float]],
    same: bool,
    same_ray: bool | None,
) -> str:
    import statistics

    tokens = r["bare-1"]["tokens"]
    rows = []
    for mode, res in r.items():
        tree = res.get("tree_rss_mb")
        cpu_s = res.get("cpu_s", {})
        runs = " / ".join(f"{w:.2f}" for w in walls.get(mode, []))
        rows.append(
            f"| {mode} | {res['wall_s']:.2f} | {runs} | {tokens / res['wall_s'] / 1e6:.2f} | "
            f"{res['peak_rss_mb']:.0f} | {f'{tree:.0f}' if tree else ''} | "
            f"{cpu_s.get('self', 0):.1f} / {cpu_s.get('api', 0):.1f} / {cpu_s.get('workers', 0):.1f} | "
            f"{res.get('api_startup_s', 0):.1f} | {res.get('cached', '')} |"
        )
    overhead = r["flow-1"]["wall_s"] / r["bare-1"]["wall_s"] - 1
    overhead_paired = _paired(walls, "flow-1", "bare-1") - 1
    speed_flow = r["flow-1"]["wall_s"] / r["flow-2"]["wall_s"]
    speed_flow_paired = _paired(walls, "flow-1", "flow-2")
    speed_ceiling = r["bare-1"]["wall_s"] / r["bare-2p"]["wall_s"]
    speed_ceiling_paired = _paired(walls, "bare-1", "bare-2p")
    pairs = " / ".join(f"{a / b:.2f}" for a, b in zip(walls["flow-1"], walls["flow-2"], strict=True))
    speed_medians = statistics.median(walls["flow-1"]) / statistics.median(walls["flow-2"])
    idle_gain = r["flow-2n"]["wall_s"] / r["flow-2"]["wall_s"]
    idle_gain_paired = _paired(walls, "flow-2n", "flow-2")
    idle_pairs = " / ".join(
        f"{a:.2f}/{b:.2f}" for a, b in zip(walls["flow-2n"], walls["flow-2"], strict=True)
    )
    speed_normal_api = _paired(walls, "flow-1", "flow-2n")
    speed_bare = r["bare-1"]["wall_s"] / r["bare-2"]["wall_s"]
    speed_threads = r["flow-1t"]["wall_s"] / r["flow-2t"]["wall_s"]
    overhead_threads = r["flow-1t"]["wall_s"] / r["bare-1"]["wall_s"] - 1
    stage_rows = []
    for stage, secs in r["bare-1"]["stage_seconds"].items():
        stage_rows.append(
            f"| {stage} | {secs:.2f} | {r['bare-2p']['stage_seconds'].get(stage, 0):.2f} | "
            f"{r['flow-1']['stage_seconds'].get(stage, 0):.2f} | "
            f"{r['flow-2']['stage_seconds'].get(stage, 0):.2f} |"
        )
    cpu = platform.processor() or platform.machine()
    load = os.getloadavg()
    lines = [
        "# process_round_flow benchmark (bench/flows.py)",
        "",
        f"Round: `creditflow synth` {settings.groups} groups x {settings.samples} samples x {settings.turns} turns x "
        f"{settings.tokens} tokens = **{tokens / 1e6:.1f}M tokens**, {r['bare-1']['batches']} batches of "
        f"{settings.batch_groups} groups (synth + write {synth_s:.1f} s). Methods: {', '.join(METHODS)} with "
        "detect (C3 rules), annotate (IAPO rules), credit, export (train_batch) and stats.",
        f"Machine: {os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}; load average at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (other jobs share this machine: absolute times are noisy).",
        "",
        f"Each mode ran {args.repeat} time(s), interleaved with the others (every other repetition in reverse "
        "order); the table keeps each mode's fastest run. "
        "peak RSS: the mode's process (ru_maxrss); tree RSS: it plus its worker processes, sampled every 100 ms.",
        "",
        "| mode | wall s (fastest) | every run, in order | M tokens/s | peak RSS MB | tree RSS MB | "
        "CPU s: flow / API / workers | API start-up s | cached stage tasks |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- **Orchestration overhead** (flow-1 vs bare-1, same work, one worker): **{overhead * 100:+.1f}%** "
        f"fastest against fastest, {overhead_paired * 100:+.1f}% the median of the back-to-back pairs (target < 15%); "
        f"with the stages in the flow's thread (flow-1t) {overhead_threads * 100:+.1f}%. The flow adds per stage "
        "task: a Prefect task run (three state events to the API server, a subprocess that shares the CPUs), the "
        "cache key (stat of the input parts, settings JSON, source hash) and the cache record.",
        f"- **Thread runner, 2 workers vs 1**: **{speed_flow:.2f}x** fastest against fastest, "
        f"{speed_flow_paired:.2f}x the median of the pairs ({pairs}; flow-1 / flow-2, the default: stages in "
        f"worker processes; target >= 1.6x), {speed_medians:.2f}x the ratio of the medians. The machine's own ceiling, the bare functions in 2 processes against "
        f"1 (bare-2p): {speed_ceiling:.2f}x fastest against fastest, {speed_ceiling_paired:.2f}x the median of the "
        f"pairs. Stages in the threads (flow-1t / flow-2t): {speed_threads:.2f}x; "
        f"bare functions on 2 threads {speed_bare:.2f}x.",
        f"- **The own API server idle during the stages** (flow-2) against normal priority (flow-2n): flow-2n / "
        f"flow-2 {idle_gain:.2f}x fastest against fastest, {idle_gain_paired:.2f}x the median of the pairs "
        f"(flow-2n/flow-2 s: {idle_pairs}); flow-1 / flow-2n (2 vs 1 workers without it): "
        f"{speed_normal_api:.2f}x the median of the pairs. With one worker a CPU is spare and the server is left "
        "at normal priority (flow-1 is the same either way).",
        f"- **Re-run of the finished round**: {r['rerun']['wall_s']:.2f} s, {r['rerun']['cached']} of "
        f"{r['rerun']['stage_tasks']} stage tasks served from the cache, nothing rewritten.",
        f"- Outputs of flow-2 and bare-1 identical (every advantages / train_batch / spans / nodes / edges part): "
        f"**{same}**"
        + (f"; Ray and Dask runners vs threads identical: **{same_ray}**" if same_ray is not None else "")
        + ".",
        "",
        "Stage seconds (sum over batches of each stage's wall time, from `stage_runs`):",
        "",
        "| stage | bare-1 | bare-2p | flow-1 | flow-2 |",
        "|---|---|---|---|---|",
        *stage_rows,
        "",
        "Reading the figures:",
        "",
        "- Two threads on two cores: the stages hold the GIL most of the time (detect's rules and the IAPO rule "
        "annotator are Python; credit and export convert between Arrow, NumPy and Python in many small steps), "
        "so two of them side by side each take much longer (bare-2 column) and threads alone reach ~1.3-1.5x. "
        "With flow.processes (auto: on with the thread runner) each thread-runner worker hands its batch stage to a "
        "worker process (forkserver, pipeline preloaded; the worker reads and writes the lake itself, only paths, "
        "the config and the summary cross over) while Prefect orchestrates from the threads. Each stage is one "
        "task mapped over the batches, batch b's task waiting on batch b's previous stage (its `upstream` future); "
        "the processes modes (flow-Np) run the same tasks on Prefect's ProcessPoolTaskRunner.",
        "- Process-based runners avoid the GIL but pay a start-up (local Ray ~10-15 s, a local Dask cluster a few "
        "seconds, both inside the wall time here) and a pickled round trip per task; on a 16M-token round on 2 "
        "cores they do not beat the thread runner. They are for more cores or several machines (a shared lake "
        "path); peak RSS of the flow process is lower with them since the batches are processed in the workers.",
        "- The Prefect API start-up (ephemeral server, a few seconds to ~20 s on a loaded 2-core machine) is paid "
        "once per `creditflow process` invocation and is not in the wall times; with PREFECT_API_URL set (a "
        "running `prefect server start`) it is zero.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
