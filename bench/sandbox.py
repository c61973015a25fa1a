"""Benchmark the code verifier's sandbox: wall time per verified program, the bubblewrap sandbox (trainer.sandbox,
score decided in the caller) beside the old runner (a `python -I` subprocess with an audit hook, read from the
git history: the commit before its removal), in the same run on the same programs.

Workload: real LDB HumanEval repair data (data/real/ldb_code_repair): each task's final program against the
hidden HumanEval check() (some need the reference run: loops, random inputs, setup), and each debugging
iteration's program against LDB's visible given_tests. Repetitions interleave the two (ABBA order); figures are
min / median over repetitions of the mean per program. Also reported: where the two score differently, and
agreement of the visible-test scores with LDB's own execution feedback. Target: <= 2x the old runner.

    nice python bench/sandbox.py [--hidden 40 --visible 40 --reps 5] [--out bench/results/sandbox.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from _common import machine_note, peak_rss_mb  # noqa: E402

from pipeline.ingest.ldb import visible_pass_fraction  # noqa: E402
from pipeline.verifiers import VERIFIERS  # noqa: E402
from trainer import sandbox  # noqa: E402

OLD_FILES = ("pipeline/verifiers/code.py", "pipeline/verifiers/_sandbox_runner.py")


def old_verifier(tmp: Path):
    """The old code_tests from the last commit that had its runner (imported from a temporary folder)."""
    removed = subprocess.run(
        ["git", "log", "-1", "--format=%H", "--diff-filter=D", "--", OLD_FILES[1]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    base = f"{removed}^" if removed else "HEAD"
    for f in OLD_FILES:
        src = subprocess.run(["git", "show", f"{base}:{f}"], cwd=ROOT, capture_output=True, check=True).stdout
        (tmp / Path(f).name.replace("code.py", "old_code.py")).write_bytes(src)
    keep = VERIFIERS.get("code_tests")
    spec = importlib.util.spec_from_file_location("cf_old_code_verifier", tmp / "old_code.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)  # registers the old code_tests: put the new one back
    if keep is not None:
        VERIFIERS["code_tests"] = keep
    rev = subprocess.run(
        ["git", "rev-parse", "--short", base], cwd=ROOT, capture_output=True, text=True
    ).stdout
    return mod.code_tests, rev.strip()


def cases(n_hidden: int, n_visible: int, seed: int = 0) -> list[tuple[str, str, dict, float | None]]:
    path = ROOT / "data" / "real" / "ldb_code_repair" / "humaneval-gpt-3.5-turbo-0613.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    hidden = [
        (
            "hidden",
            r["solution"],
            {"test": r["test"], "entry_point": r["entry_point"], "prompt": r["prompt"], "id": r["task_id"]},
            None,
        )
        for r in rows
    ]
    visible = [
        (
            "visible",
            r["implementations"][i],
            {"tests": r["given_tests"], "id": f"{r['task_id']}#{i}"},
            visible_pass_fraction(r["given_tests"], r["test_feedback"][i]),
        )
        for r in rows
        for i in range(len(r["implementations"]))
    ]
    pick_h = hidden if n_hidden >= len(hidden) else rng.sample(hidden, n_hidden)
    pick_v = visible if n_visible >= len(visible) else rng.sample(visible, n_visible)
    return pick_h + pick_v


def timed(fn, work) -> tuple[list[float], list[float]]:
    """Seconds and score per program."""
    secs, scores = [], []
    for _, prog, meta, _ in work:
        t0 = time.perf_counter()
        scores.append(fn(prog, {k: v for k, v in meta.items() if k != "id"}).score)
        secs.append(time.perf_counter() - t0)
    return secs, scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=40)
    ap.add_argument("--visible", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sandbox.md"))
    args = ap.parse_args()
    problem = sandbox.sandbox_problem()
    if problem is not None:
        raise SystemExit(f"bubblewrap unavailable: {problem}")
    work = cases(args.hidden, args.visible)
    with tempfile.TemporaryDirectory() as tmp:
        old, rev = old_verifier(Path(tmp))
        new = sandbox.code_tests
        modes = {"old runner": old, "bwrap sandbox": new}
        per: dict[str, list[float]] = {m: [] for m in modes}
        per_kind: dict[str, dict[str, list[float]]] = {m: {"hidden": [], "visible": []} for m in modes}
        scores: dict[str, list[float]] = {}
        kinds = [w[0] for w in work]
        timed(new, work[:3])  # warm: the bwrap probe, imports
        timed(old, work[:3])
        for rep in range(args.reps):
            order = list(modes) if rep % 2 == 0 else list(reversed(modes))
            for m in order:
                secs, s = timed(modes[m], work)
                per[m].append(sum(secs) / len(secs))
                scores.setdefault(m, s)
                for kind in ("hidden", "visible"):
                    sub = [t for t, k in zip(secs, kinds, strict=True) if k == kind]
                    if sub:
                        per_kind[m][kind].append(sum(sub) / len(sub))
    o, n = per["old runner"], per["bwrap sandbox"]
    ratio_min, ratio_med = min(n) / min(o), statistics.median(n) / statistics.median(o)
    differ = [
        (w[2]["id"], a, b)
        for w, a, b in zip(work, scores["old runner"], scores["bwrap sandbox"], strict=True)
        if abs(a - b) > 1e-9
    ]
    vis = [(w, s) for w, s in zip(work, scores["bwrap sandbox"], strict=True) if w[0] == "visible"]
    vis_agree = sum(abs(s - w[3]) < 1e-9 for w, s in vis)
    vis_old = sum(
        abs(s - w[3]) < 1e-9 for w, s in zip(work, scores["old runner"], strict=True) if w[0] == "visible"
    )
    lines = [
        "# Code verifier sandbox: cost per verified program",
        "",
        f"`nice python bench/sandbox.py --hidden {args.hidden} --visible {args.visible} --reps {args.reps}`",
        "",
        machine_note(),
        "",
        f"{len(work)} real LDB programs ({sum(w[0] == 'hidden' for w in work)} final programs x HumanEval check(), "
        f"{sum(w[0] == 'visible' for w in work)} debugging iterations x LDB given_tests), verified one after "
        f"another; {args.reps} interleaved repetitions (ABBA). Old runner: git {rev} (`python -I` subprocess, "
        "audit hook, score computed in the child).",
        "",
        "| | min ms / program | median ms / program |",
        "|---|---|---|",
        f"| old runner | {min(o) * 1e3:.1f} | {statistics.median(o) * 1e3:.1f} |",
        f"| bwrap sandbox | {min(n) * 1e3:.1f} | {statistics.median(n) * 1e3:.1f} |",
        f"| ratio | {ratio_min:.2f}x | {ratio_med:.2f}x |",
        "",
        "By kind (median over repetitions, ms / program): "
        + ", ".join(
            f"{k}: old {statistics.median(per_kind['old runner'][k]) * 1e3:.1f}, "
            f"new {statistics.median(per_kind['bwrap sandbox'][k]) * 1e3:.1f}"
            for k in ("hidden", "visible")
            if per_kind["old runner"][k]
        )
        + " (every program runs in two sandboxes at once, the reference running the tests and the candidate's"
        " answering its calls, one relay round trip per call).",
        "",
        f"Target <= 2x: {'met' if ratio_med <= 2.0 else 'NOT met'} ({ratio_med:.2f}x median).",
        "",
        f"Scores: {len(work) - len(differ)} of {len(work)} programs score the same under both"
        + (
            "."
            if not differ
            else "; differing: " + ", ".join(f"{i} old {a:.3f} new {b:.3f}" for i, a, b in differ)
        ),
        f"Visible-test scores equal to LDB's own execution feedback: new {vis_agree} of {len(vis)}, "
        f"old {vis_old} of {len(vis)}.",
        f"Peak RSS of the benchmark process: {peak_rss_mb():.0f} MiB.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
