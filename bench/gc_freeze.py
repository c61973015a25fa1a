"""What freezing the heap saves (flows.runtime.freeze_heap, #36): `creditflow process` of a new round with
the cyclic collector's passes over the imports' objects (CREDITFLOW_GC_FREEZE=0, the code before) and without
them (the default), interleaved, in one run.

    python bench/gc_freeze.py --reps 4                       # a 12-batch round of gae and gdpo, no shared API
    python bench/gc_freeze.py --groups 64 --methods grpo      # a small round

Each repetition runs the real CLI in a fresh process on a round of its own (synthesised first, not timed), the
two settings alternating; CREDITFLOW_SHARED_API=0 by default (the Prefect API in the command's own process, as
with no server: --shared keeps the machine's shared API and warm runner instead). Figures: wall seconds and the
CPU seconds of the command and its children (the flow's worker processes), min / median; and, in the command's
own process, the full collections (generation 2) it ran and their milliseconds (a gc callback installed before
the CLI starts). Writes bench/results/gc_freeze.md (or --out)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import machine_note, report, uptime  # noqa: E402

# the command, with a gc callback that counts the full collections of its own process (written at exit)
DRIVER = """
import atexit, gc, json, sys, time
sys.path.insert(0, {root!r})
stats = {{"n": 0, "ms": 0.0}}
started = [0.0]
def count(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        stats["n"] += 1
        stats["ms"] += (time.perf_counter() - started[0]) * 1000
gc.callbacks.append(count)
atexit.register(lambda: open({out!r}, "w").write(json.dumps(stats)))
from flows.cli import app
app(sys.argv[1:])
"""


def run(lake: Path, round_: int, methods: str, freeze: bool, shared: bool, tmp: Path) -> dict:
    out = tmp / f"gc-{round_}.json"
    env = {**os.environ, "CREDITFLOW_GC_FREEZE": "1" if freeze else "0", "PYTHONPATH": str(ROOT)}
    if not shared:
        env["CREDITFLOW_SHARED_API"] = "0"
    code = DRIVER.format(root=str(ROOT), out=str(out))
    args = ["process", "--lake", str(lake), "--round", str(round_), "--methods", methods]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode:
        raise SystemExit(f"gc_freeze: process of round {round_} failed:\n{res.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    gc_stats = json.loads(out.read_text()) if out.exists() else {"n": 0, "ms": 0.0}
    return {"wall": wall, "cpu": cpu, "gen2_n": gc_stats["n"], "gen2_ms": gc_stats["ms"]}


def _cell(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(min(values))} / {fmt.format(statistics.median(values))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=4, help="rounds per setting")
    ap.add_argument("--groups", type=int, default=768)
    ap.add_argument("--batch-groups", type=int, default=64)
    ap.add_argument("--methods", default="gae,gdpo")
    ap.add_argument("--shared", action="store_true", help="use the machine's shared API (and warm runner)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gc_freeze.md"))
    args = ap.parse_args()
    start = uptime()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        lake = tmp / "lake"
        cli = [str(Path(sys.executable).parent / "creditflow")]  # the venv's command
        for r in range(2 * args.reps):
            made = subprocess.run(
                [
                    *cli,
                    "synth",
                    "--groups",
                    str(args.groups),
                    "--samples",
                    "8",
                    "--turns",
                    "5",
                    "--tokens",
                    "300",
                    "--batch-groups",
                    str(args.batch_groups),
                    "--out",
                    str(lake),
                    "--round",
                    str(r),
                    "--seed",
                    str(r),
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            if made.returncode:
                raise SystemExit(f"gc_freeze: synth failed:\n{made.stderr[-2000:]}")
        for r in range(2 * args.reps):
            freeze = (r % 2 == 0) == ((r // 2) % 2 == 0)  # alternating, the order swapped every other pair
            res = run(lake, r, args.methods, freeze, args.shared, tmp)
            runs[freeze].append(res)
            print(
                f"round {r} freeze={int(freeze)}: {res['wall']:.2f} s wall, {res['cpu']:.2f} s CPU, "
                f"{res['gen2_n']} full collections {res['gen2_ms']:.0f} ms",
                flush=True,
            )
    headers = ["", "collector over the imports (CREDITFLOW_GC_FREEZE=0)", "heap frozen (default)"]
    rows = [
        ["wall s", _cell([r["wall"] for r in runs[False]]), _cell([r["wall"] for r in runs[True]])],
        [
            "CPU s (command + workers)",
            _cell([r["cpu"] for r in runs[False]]),
            _cell([r["cpu"] for r in runs[True]]),
        ],
        [
            "full collections in the command's process",
            _cell([r["gen2_n"] for r in runs[False]], "{:.0f}"),
            _cell([r["gen2_n"] for r in runs[True]], "{:.0f}"),
        ],
        [
            "their ms",
            _cell([r["gen2_ms"] for r in runs[False]], "{:.0f}"),
            _cell([r["gen2_ms"] for r in runs[True]], "{:.0f}"),
        ],
    ]
    api = "the shared API" if args.shared else "CREDITFLOW_SHARED_API=0 (the API in the command's process)"
    intro = (
        f"`python bench/gc_freeze.py --reps {args.reps} --groups {args.groups} --methods {args.methods}`: "
        f"`creditflow process` of a new round ({args.groups} groups x 8 samples x 5 turns x ~300 tokens, batches "
        f"of {args.batch_groups} groups) per repetition, {api}, the two settings alternating. Load: `{start}` at "
        f"the start, `{uptime()}` at the end. {machine_note()} Cells: min / median of {args.reps}."
    )
    report(args.out, "Freezing the heap (bench/gc_freeze.py)", intro, headers, rows)


if __name__ == "__main__":
    main()
