"""Benchmark: the fixed cost of a `creditflow process` command as a user sees it, beside its per-token cost,
for this tree and for a baseline commit, in the same run (interleaved repetitions, min / median).

Per tree, each repetition times the real CLI in a fresh process:
- import:   `import <cli module>` (python -X importtime, the project's own modules and everything they pull);
- first:    process of a small synthetic round (every stage computes), Prefect's ephemeral API per command
            (CREDITFLOW_NO_SERVER=1);
- shared first: the same with no API up and none disabled, and a fresh Prefect database: a tree that shares
            one API per machine starts it here (the machine's first command ever: the API creates and migrates
            the database);
- cold:     the same on another new lake, the database kept, no API up (the first command after the shared API
            stopped unused, or after a reboot): issue 36's <= 5 s;
- new round, API up: process of another new small round with a server up (`creditflow server start`; what
            a tree that shares its API gives every command after the first): issue 36's <= 2 s;
- noop:     the same command again on the processed round: what a user waits for (a tree with the up-to-date
            check answers from the lake without starting Prefect);
- force:    (a tree with `process --force`) the no-op through the flow anyway, every batch stage cached: the
            flow's own fixed cost (Prefect's ephemeral API, task runs);
- server / server force: the same two with a managed Prefect server up (`creditflow server start`);
- big:      process of a larger round; per-token cost = (big - the flow's fixed cost) / its tokens.

Both trees make their lakes in one format (--format, CREDITFLOW_LAKE_FORMAT; default delta, the default of a
new lake since #25).

    python bench/fixed_cost.py                          # baseline: the commit before this session's work
    python bench/fixed_cost.py --baseline 865894d --reps 3
    python bench/fixed_cost.py --baseline 1d506bc --reps 5 --only server   # issue 36's rows only: a new small
                                    # round with no API up (cold), with an API up (through the warm runner
                                    # where the tree has one), and the no-op (no large round, no ephemeral API)

A tree with the warm runner (flows/warm.py) runs the rows with a server up in the runner's fork: their CPU adds
the command's CPU the runner reports ($CREDITFLOW_WARM_STATS) to the caller's, and a row per tree gives the split.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
METHODS = "grpo,grpo+c3,gae"


def cli_module(tree: Path) -> str:
    return "flows.cli" if (tree / "flows" / "cli.py").exists() else "pipeline.cli"


def has_force(tree: Path) -> bool:
    return '"--force"' in (tree / "flows" / "commands" / "process.py").read_text(encoding="utf-8")


CPU: dict[tuple[str, str], list[float]] = {}
WARM: dict[str, list[dict]] = {}  # per tree: the warm runner's record of each "server new" it ran


def timed(key: tuple[str, str], times: dict, tree: Path, args: list[str], env: dict[str, str]) -> None:
    """Wall and CPU (user + sys of the command and the children it waited for) of one CLI run."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    times.setdefault(key, []).append(run_cli(tree, args, env))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    CPU.setdefault(key, []).append(cpu)


def run_cli(tree: Path, args: list[str], env: dict[str, str]) -> float:
    code = f"from {cli_module(tree)} import app; app()"
    t0 = time.perf_counter()
    out = subprocess.run(
        [PY, "-c", code, *args],
        cwd=tree,
        env={**env, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{tree.name}: {' '.join(args[:1])} failed: {out.stderr[-800:]}")
    return wall


def import_time(tree: Path, env: dict[str, str]) -> float:
    out = subprocess.run(
        [PY, "-X", "importtime", "-c", f"import {cli_module(tree)}"],
        cwd=tree,
        env={**env, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )
    last = [line for line in out.stderr.splitlines() if line.startswith("import time:")][-1]
    return int(last.split("|")[1]) / 1e6  # cumulative microseconds of the top-level import


def synth(tree: Path, lake: Path, groups: int, env: dict[str, str]) -> None:
    run_cli(
        tree,
        [
            "synth",
            "--groups",
            str(groups),
            "--samples",
            "4",
            "--turns",
            "4",
            "--tokens",
            "200",
            "--out",
            str(lake),
        ],
        env,
    )


def tokens_of(lake: Path) -> int:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    total = 0
    for part in (lake / "steps").rglob("*.parquet"):
        if "_delta_log" in part.parts:
            continue
        col = pq.read_table(part, columns=["token_ids"]).column("token_ids")
        total += int(pc.sum(pc.list_value_length(col)).as_py() or 0)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="865894d", help="commit to compare with (a git worktree of it)")
    ap.add_argument(
        "--this",
        default="HEAD",
        help="commit measured as 'this tree' (a worktree of it: other work in the checkout cannot change it "
        "mid-run); 'checkout' measures the checkout itself",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", type=int, default=8, help="groups of the small round")
    ap.add_argument("--big", type=int, default=256, help="groups of the large round")
    ap.add_argument("--format", default="delta", choices=["delta", "parquet"], help="format of the new lakes")
    ap.add_argument(
        "--only",
        choices=["all", "server"],
        default="all",
        help="server: only a new small round with `creditflow server start` up and the no-op after it",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fixed_cost.md"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cf-fixed-"))
    trees = {"baseline": work / "baseline", "this": ROOT if args.this == "checkout" else work / "this"}
    commits = {"baseline": args.baseline, "this": args.this}
    for name, tree in trees.items():
        if tree != ROOT:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(tree), commits[name]],
                check=True,
                capture_output=True,
            )
    shown = {
        name: subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", commits[name] if tree != ROOT else "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        + ("" if tree != ROOT else " + checkout")
        for name, tree in trees.items()
    }
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PYTHONPATH")}
    env.update(
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        CREDITFLOW_NO_SERVER="1",
        CREDITFLOW_CACHE=str(work / "cache"),
        CREDITFLOW_LAKE_FORMAT=args.format,
    )
    times: dict[tuple[str, str], list[float]] = {}
    big_tokens = 0

    def shown_rep(name: str) -> str:
        return ", ".join(
            f"{k[1]} {v[-1]:.2f}s" + (f" (CPU {CPU[k][-1]:.2f})" if k in CPU else "")
            for k, v in times.items()
            if k[0] == name
        )

    def cold_rows(name: str, tree: Path, proc: list[str], lakes: list[Path], es: dict[str, str]) -> None:
        """A new small round with no API up: first with a fresh Prefect database (the machine's first command
        ever: the API creates and migrates it), then on another new lake with that database kept (`cold`: the
        first command after the API stopped, e.g. 30 min unused, or after a reboot)."""
        for what, lake in zip(("shared first", "cold"), lakes, strict=True):
            try:
                timed((name, what), times, tree, [*proc, "--lake", str(lake)], es)
            finally:
                run_cli(tree, ["server", "stop"], es)  # the API the command left (a tree that shares one)

    def server_rows(
        name: str, tree: Path, proc: list[str], lake: Path, es: dict[str, str], cold: list[Path] | None = None
    ) -> None:
        """(`cold`: a new small round with no API up first: the machine's first command.) A new small round
        with a server up (through the warm runner where the tree has one: waited for after `server start`),
        then the same command again (the no-op, server up)."""
        es = {k: v for k, v in es.items() if k != "CREDITFLOW_NO_SERVER"}
        stats = Path(es["CREDITFLOW_CACHE"]) / "warm.jsonl"
        es = {**es, "CREDITFLOW_WARM_STATS": str(stats)}
        if cold is not None:
            cold_rows(name, tree, proc, cold, es)
        run_cli(tree, ["server", "start"], es)
        try:
            if (tree / "flows" / "warm.py").exists():
                sock = Path(es["CREDITFLOW_CACHE"]) / "services" / "runner" / "runner.sock"
                deadline = time.monotonic() + 180
                while not sock.exists() and time.monotonic() < deadline:
                    time.sleep(0.2)
            for what in ("server new", "server"):
                seen = len(stats.read_text().splitlines()) if stats.exists() else 0
                timed((name, what), times, tree, [*proc, "--lake", str(lake)], es)
                rows = (
                    [json.loads(x) for x in stats.read_text().splitlines()[seen:]] if stats.exists() else []
                )
                done = [r for r in rows if "exit" in r]
                if done:  # run by the warm runner: its command's CPU is not a child of this process
                    CPU[(name, what)][-1] += done[-1]["command_cpu_s"]
                    WARM.setdefault(f"{name}: {what}", []).append(done[-1])
        finally:
            run_cli(tree, ["server", "stop"], es)

    load0 = f"{os.getloadavg()[0]:.1f}"
    try:
        for rep in range(args.reps):
            order = list(trees) if rep % 2 == 0 else list(reversed(trees))
            for name in order:
                tree = trees[name]
                home = work / f"prefect-{name}-{rep}"
                e = {**env, "PREFECT_HOME": str(home)}
                small, big = work / f"{name}-{rep}-small", work / f"{name}-{rep}-big"
                small2, small3 = work / f"{name}-{rep}-small2", work / f"{name}-{rep}-small3"
                small4 = work / f"{name}-{rep}-small4"
                proc = ["process", "--round", "0", "--methods", METHODS]
                times.setdefault((name, "import"), []).append(import_time(tree, e))
                if args.only == "server":
                    synth(tree, small3, args.small, e)
                    synth(tree, small2, args.small, e)
                    synth(tree, small4, args.small, e)
                    server_rows(
                        name,
                        tree,
                        proc,
                        small3,
                        {**e, "CREDITFLOW_CACHE": str(work / f"cache-{name}-{rep}")},
                        cold=[small2, small4],
                    )
                    for lake in (small2, small3, small4):
                        shutil.rmtree(lake, ignore_errors=True)
                    print(f"rep {rep + 1} {name}: " + shown_rep(name), flush=True)
                    continue
                synth(tree, small, args.small, e)
                synth(tree, big, args.big, e)
                big_tokens = tokens_of(big)
                synth(tree, small2, args.small, e)
                synth(tree, small3, args.small, e)
                synth(tree, small4, args.small, e)
                timed((name, "first"), times, tree, [*proc, "--lake", str(small)], e)
                timed((name, "noop"), times, tree, [*proc, "--lake", str(small)], e)
                force = ["--force"] if has_force(tree) else []
                if force:
                    times.setdefault((name, "force"), []).append(
                        run_cli(tree, [*proc, "--lake", str(small), *force], e)
                    )
                times.setdefault((name, "big"), []).append(run_cli(tree, [*proc, "--lake", str(big)], e))
                es = {**e, "CREDITFLOW_CACHE": str(work / f"cache-{name}-{rep}")}  # no server recorded
                es.pop("CREDITFLOW_NO_SERVER")
                cold_rows(name, tree, proc, [small2, small4], es)
                run_cli(tree, ["server", "start"], es)
                try:
                    timed((name, "server new"), times, tree, [*proc, "--lake", str(small3)], es)
                    # the server's first sight of this lake (a flow run: its flow and task records)
                    run_cli(tree, [*proc, "--lake", str(small), *force], es)
                    timed((name, "server"), times, tree, [*proc, "--lake", str(small)], es)
                    if force:
                        times.setdefault((name, "server force"), []).append(
                            run_cli(tree, [*proc, "--lake", str(small), *force], es)
                        )
                finally:
                    run_cli(tree, ["server", "stop"], es)
                for lake in (small, small2, small3, small4, big):
                    shutil.rmtree(lake, ignore_errors=True)
                print(f"rep {rep + 1} {name}: " + shown_rep(name), flush=True)
    finally:
        for tree in trees.values():
            if tree != ROOT:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True
                )
        shutil.rmtree(work, ignore_errors=True)

    def cell(name: str, what: str) -> str:
        v, c = times.get((name, what)), CPU.get((name, what))
        if not v:
            return "-"
        cpu = f" (CPU {min(c):.2f} / {statistics.median(c):.2f})" if c else ""
        return f"{min(v):.2f} / {statistics.median(v):.2f}{cpu}"

    lines = [
        "# Fixed cost of `creditflow process` (bench/fixed_cost.py)",
        "",
        f"`python bench/fixed_cost.py --baseline {args.baseline} --reps {args.reps} --format {args.format}"
        f"{' --only server' if args.only == 'server' else ''}`; "
        f"methods {METHODS}; {args.format} lakes; "
        f"small round {args.small} groups"
        + (f", large round {args.big} groups ({big_tokens:,} tokens)" if args.only == "all" else "")
        + "; "
        f"load average at the start {load0} and at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        f"{' (--only server: the rows of a new small round with a server up; the others not run)' if args.only == 'server' else ''}. "
        f"Seconds, wall min / median of {args.reps} interleaved repetitions (order reversed every other one), "
        "each a fresh CLI process; CPU: user + sys of the command and its children.",
        "",
        f"| | baseline ({shown['baseline']}) | this tree ({shown['this']}) |",
        "|---|---|---|",
    ]
    for what, label in [
        ("import", "import of the CLI module"),
        ("first", "process, new small round, ephemeral API per command (CREDITFLOW_NO_SERVER=1)"),
        (
            "shared first",
            "process, new small round, no API up, "
            + (
                "fresh Prefect database (the machine's first command ever: the API creates and migrates it)"
                if args.only == "server"
                else "database made by the ephemeral rows before it"
            ),
        ),
        ("cold", "process, new small round, no API up, database kept (**cold**: issue 36's <= 5 s)"),
        ("server new", "process, new small round, an API up: **issue 36's <= 2 s**"),
        ("noop", "process again (round unchanged): **what a no-op costs**, no server"),
        ("server", "process again, `creditflow server start` up"),
        ("force", "process again through the flow (`--force`, all cached), ephemeral API"),
        ("server force", "process again through the flow (`--force`), server up"),
        ("big", "process, large round"),
    ]:
        if cell("baseline", what) != "-" or cell("this", what) != "-":  # --only server: its rows alone
            lines.append(f"| {label} | {cell('baseline', what)} | {cell('this', what)} |")

    def per_token(name: str) -> str:
        flow = times.get((name, "force")) or times.get((name, "noop"))  # the flow's fixed cost
        if not (times.get((name, "big")) and flow and big_tokens):
            return "-"
        return f"{(min(times[(name, 'big')]) - min(flow)) / big_tokens * 1e6:.2f}"

    for name in (f"{tree}: {what}" for tree in trees for what in ("server new", "server")):
        runs = WARM.get(name) or []
        if runs:

            def mm(key: str, runs: list[dict] = runs) -> str:
                values = [float(r[key]) for r in runs if r.get(key) is not None]
                return f"{min(values):.2f} / {statistics.median(values):.2f}" if values else "-"

            lines.append(
                f"| {name} via the warm runner ({len(runs)} of {args.reps}): the caller's CPU "
                f"{mm('client_cpu_s')}, the command's CPU in the runner {mm('command_cpu_s')}, the caller's "
                f"seconds before the hand-over {mm('client_s')} | | |"
            )
    if args.only == "all":
        lines.append(
            "| per-token cost: (large - the flow's no-op) / tokens, us "
            f"| {per_token('baseline')} | {per_token('this')} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
