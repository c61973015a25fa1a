"""Does the credit help learning? GRPO against each paper's method on its own small task, through the real
loop (issue 27).

    nice .venv/bin/python bench/learning.py                      # the full CPU benchmark (~60 min on 2 cores)
    nice .venv/bin/python bench/learning.py --quick              # smoke: 1 seed, 3 rounds, 2 arms per env
    .venv/bin/python bench/learning.py --seeds 5 --rounds 30 --jobs 2 --envs c3_search iapo_service

Every (env, arm, seed) run is one `creditflow loop --config FILE` in its own process and its own lake: collect
(the tiny policy's rollouts, local backend) -> `process` (detectors, annotators, every configured method) ->
export -> `train` -> the next round's policy. An arm trains on one method chain; nothing else differs: the
same seed gives every arm the same initial tiny model (`loop.tiny_seed`), the same task order and the same
sampling seeds (`collect.seed`), so round 0 is identical across arms and the per-seed differences are paired.

Curves: the success rate of round r = the share of that round's collected episodes with reward 1 (the policy
P_r, sampled at temperature 1: on-policy, no separate evaluation). Per arm: the mean over seeds with a 95%
t-interval, the area under the curve (the mean success over rounds), and the first round at which the
3-round moving average reaches the success level (`--level`); per seed, the arm minus GRPO (paired), with
its mean, 95% t-interval and the count of seeds it won. Per env, one diagnostic of the behaviour the method
targets (C3: wasted turns per episode; TCPO: plan turns per episode; IAPO: tool errors + invalid actions per
episode).

Results: markdown to --results (bench/results/learning.md by default; --quick writes nothing there unless
given), the raw curves as JSON next to the runs (--out). The GPU form is bench/learning_gpu.sh.

Issue 32 found that these three environments have almost no credit problem (an oracle with the true turn values
barely beats GRPO there): they stay as probes. The environments with a credit problem, the oracle arm, each
paper's own baseline, held-out evaluation and the power computation are bench/learning_credit.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_BENCH = str(Path(__file__).resolve().parent)
sys.path.insert(0, _BENCH)
from _common import ROOT, machine_note  # noqa: E402
from _common import md_table as _md_lines  # noqa: E402

# bench/trainer.py and bench/flows.py would shadow the packages of the same names
sys.path[:] = [p for p in sys.path if p not in (_BENCH, "")]

# env -> (arms: the GRPO baseline first, then the paper's method and its variants; turn budget; diagnostic)
ENVS: dict[str, dict] = {
    "c3_search": {"arms": ["grpo", "grpo+c3"], "paper": "C3", "diag": "wasted turns / episode"},
    "tcpo_refine": {
        "arms": ["grpo", "tcpo", "tcpo_retro_hin", "delta_reward", "turn_reward"],
        "quick_arms": ["grpo", "tcpo"],
        "paper": "TCPO",
        "diag": "plan turns / episode",
    },
    "iapo_service": {"arms": ["grpo", "grpo+iapo"], "paper": "IAPO", "diag": "errors / episode"},
}

# t_{0.975, df} for the 95% intervals (df = seeds - 1)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t975(df: int) -> float:
    return T975.get(df, 1.96 if df > 30 else 2.1)


def config_for(env: str, arm: str, seed: int, run_dir: Path, a: argparse.Namespace) -> dict:
    """The loop config of one run (the same for every arm but the method)."""
    return {
        "lake": str(run_dir / "lake"),
        "methods": [arm],
        "batch_groups": 64,
        "max_workers": 1,
        "flow": {"progress": False, "processes": False},
        "llm": llm_for(arm, run_dir, a),
        "stages": {
            "loop": {
                "rounds": a.rounds,
                "env": env,
                "prompts": a.prompts,
                "samples": a.samples,
                "model": a.model,
                "backend": a.backend,
                "tiny_tokenizer": "env",
                "tiny_hidden": a.hidden,
                "tiny_layers": 2,
                "tiny_heads": 2,
                "tiny_seed": seed,
                "tiny_format_steps": a.format_steps,
                "keep_checkpoints": 1,
            },
            "collect": {
                "temperature": 1.0,
                "top_p": 1.0,
                "max_new_tokens": a.max_new_tokens,
                "max_context": 512,
                "seed": seed,
                "threads": 1,
            },
            "train": {
                "lr": a.lr,
                "mini_batch_seqs": a.mini_batch,
                "token_budget": 8192,
                "epochs": a.epochs,
                "seed": seed,
            },
            # TCPO's counterfactual stage samples M alternatives per selected turn of the M = 4 / L = 5 budget
            # from the rollout policy (llm_for); --no-cf-server: each selected turn falls back to hindsight
            "tcpo": {"M": 4, "L": 5},
            "counterfactual": {"max_tokens": a.max_new_tokens},
        },
    }


CF_ARMS = ("tcpo", "tcpo_random_cf", "tcpo_all_cf")  # arms whose chain samples counterfactuals


def llm_for(arm: str, run_dir: Path, a: argparse.Namespace) -> dict:
    """The server TCPO's counterfactual stage samples from: --endpoint, else the bench's own policy server
    (trainer.policy_server: `model` = the run's loop workdir, so it serves P_r, the policy that collected)."""
    if a.endpoint:
        return {"endpoints": list(a.endpoint), "cache": False}
    if arm.split("+")[0] in CF_ARMS and a.cf_url:
        return {
            "endpoints": [a.cf_url],
            "model": str(run_dir / "lake" / "_loop"),
            "cache": False,
            "concurrency": 4,
            "timeout_s": 60.0,
        }
    return {}


def apply_sets(cfg: dict, sets: list[str] | None) -> dict:
    """--set stage.key=value overrides (YAML values) into the run config's stages."""
    import yaml

    for item in sets or []:
        key, _, value = item.partition("=")
        stage, _, name = key.partition(".")
        if not stage or not name or not _:
            raise SystemExit(f"--set {item!r}: expected stage.key=value")
        cfg["stages"].setdefault(stage, {})[name] = yaml.safe_load(value)
    return cfg


def run_dir_of(env: str, arm: str, seed: int, a: argparse.Namespace) -> Path:
    return Path(a.out) / env / arm.replace("+", "_") / f"seed{seed}"


def prepare_run(env: str, arm: str, seed: int, a: argparse.Namespace) -> Path:
    """The run's folder with its loop config (a fresh folder unless --resume)."""
    import yaml

    run_dir = run_dir_of(env, arm, seed, a)
    if run_dir.exists() and not a.resume:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(apply_sets(config_for(env, arm, seed, run_dir, a), a.set), sort_keys=False)
    )
    return run_dir


def finish_run(env: str, arm: str, seed: int, run_dir: Path, rc: int, wall: float) -> dict:
    res = {"env": env, "arm": arm, "seed": seed, "rc": rc, "wall_s": round(wall, 1), "dir": str(run_dir)}
    if rc != 0:
        log = run_dir / "loop.log"
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        print(f"[learning] {env} {arm} seed {seed}: loop failed (rc {rc})\n{tail}", file=sys.stderr)
        return res
    res.update(read_curves(run_dir / "lake", env))
    res.update(read_speed(run_dir))
    print(
        f"[learning] {env:13s} {arm:13s} seed {seed}: {wall:6.1f}s  success "
        + " ".join(f"{x:.2f}" for x in res["success"]),
        flush=True,
    )
    return res


def run_cli(env: str, arm: str, seed: int, a: argparse.Namespace) -> dict:
    """One run as `creditflow loop --config FILE` in its own process (--via cli)."""
    run_dir = prepare_run(env, arm, seed, a)
    cmd = [
        str(Path(sys.executable).with_name("creditflow")),
        "loop",
        "--config",
        str(run_dir / "config.yaml"),
    ]
    t0 = time.perf_counter()
    with open(run_dir / "loop.log", "w") as log:
        rc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(), check=False
        ).returncode
    return finish_run(env, arm, seed, run_dir, rc, time.perf_counter() - t0)


def collect_existing(jobs: list[tuple[str, str, int]], a: argparse.Namespace) -> list[dict]:
    """--report-only: the results of the runs already done under --out (runs without result.json left out)."""
    results = []
    for job in jobs:
        d = run_dir_of(*job, a)
        if (d / "result.json").exists():
            info = json.loads((d / "result.json").read_text())
            results.append(finish_run(*job, d, info["rc"], info["wall_s"]))
    return results


def run_workers(jobs: list[tuple[str, str, int]], a: argparse.Namespace) -> list[dict]:
    """--via function: `jobs` spread over --jobs worker processes, each running its runs one after another
    through the loop's public function (flows.round_loop.run_loop, what `creditflow loop` calls), so Python,
    torch and Prefect's API start once per worker instead of once per run."""
    dirs = {job: prepare_run(*job, a) for job in jobs}
    procs = []
    for k in range(min(a.jobs, len(jobs))):
        mine = [str(dirs[job]) for job in jobs[k :: a.jobs]]
        log = open(Path(a.out) / f"worker{k}.log", "w")  # noqa: SIM115 - closed after the wait
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *mine]
        procs.append(
            (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()), log)
        )
    for proc, log in procs:
        proc.wait()
        log.close()
    results = []
    for job in jobs:
        done = dirs[job] / "result.json"
        info = json.loads(done.read_text()) if done.exists() else {"rc": -1, "wall_s": 0.0}
        results.append(finish_run(*job, dirs[job], info["rc"], info["wall_s"]))
    return results


def worker(run_dirs: list[str]) -> int:
    """Run each folder's loop config in this process (see run_workers); result.json per run."""
    import traceback

    import torch

    torch.set_num_threads(1)  # one core per worker: --jobs workers share the machine's cores
    import trainer.loop  # noqa: F401 - registers the loop / collect settings, as the CLI does
    import trainer.train  # noqa: F401
    from flows.config import load_config
    from flows.round_loop import run_loop

    for d in map(Path, run_dirs):
        t0 = time.perf_counter()
        with open(d / "loop.log", "w") as log:

            def say(msg: str, log=log) -> None:
                print(msg, file=log, flush=True)

            try:
                run_loop(load_config(d / "config.yaml"), log=say)
                rc = 0
            except Exception:  # noqa: BLE001 - one failed run is reported, the others still run
                log.write(traceback.format_exc())
                rc = 1
        wall = time.perf_counter() - t0
        (d / "result.json").write_text(json.dumps({"rc": rc, "wall_s": wall}))
        print(f"[worker] {d}: rc {rc} in {wall:.1f}s", flush=True)
    return 0


def read_curves(lake_dir: Path, env: str) -> dict:
    """Per round: success rate, mean reward, the env's diagnostic; train_metrics rows recorded."""
    from warehouse.lake import Lake

    lake = Lake(lake_dir)
    succ, reward, diag, steps = [], [], [], []
    for r in lake.rounds("trajectories"):
        t = lake.read("trajectories", r, columns=["reward", "reward_components"]).to_pylist()
        rw = [row["reward"] for row in t]
        comps = [dict(row["reward_components"] or []) for row in t]
        succ.append(sum(x >= 1.0 - 1e-9 for x in rw) / len(rw))
        reward.append(sum(rw) / len(rw))
        if env == "c3_search":
            d = [c.get("invalid", 0.0) + c.get("repeats", 0.0) for c in comps]
        elif env == "tcpo_refine":
            d = [c.get("plans", 0.0) for c in comps]
        else:
            d = [c.get("errors", 0.0) + c.get("invalid", 0.0) for c in comps]
        diag.append(sum(d) / len(d))
    for r in lake.rounds("train_metrics"):
        steps.append(lake.read("train_metrics", r, columns=["step"]).num_rows)
    cf = {"ok": 0, "failed": 0}
    for r in lake.rounds("counterfactuals"):
        for status in lake.read("counterfactuals", r, columns=["status"]).column("status").to_pylist():
            cf["ok" if status == "ok" else "failed"] += 1
    return {"success": succ, "reward": reward, "diag": diag, "train_steps": steps, "counterfactuals": cf}


def read_speed(run_dir: Path) -> dict:
    """Throughput of the run: trainer tokens/s (train_metrics: trained tokens / optimizer-step seconds) and
    collect tokens/s (the loop log's generated tokens / collect seconds, model load included)."""
    import re

    from warehouse.lake import Lake

    lake = Lake(run_dir / "lake")
    tok = sec = 0.0
    for r in lake.rounds("train_metrics"):
        t = lake.read("train_metrics", r, columns=["tokens", "seconds"])
        tok += sum(t.column("tokens").to_pylist())
        sec += sum(t.column("seconds").to_pylist())
    log = (run_dir / "loop.log").read_text(errors="replace")
    found = re.findall(r"collected \d+ episodes \((\d+) tokens, mean reward [-\d.]+\) in ([\d.]+)s", log)
    gen = sum(int(a) for a, _ in found)
    gen_s = sum(float(b) for _, b in found)
    return {
        "train_tokens": int(tok),
        "train_tokens_per_s": round(tok / sec, 1) if sec else None,
        "collect_tokens_per_s": round(gen / gen_s, 1) if gen_s else None,
    }


def count_params(results: list[dict]) -> int:
    """Parameters of the policy (from the first run's newest checkpoint), for the MFU."""
    from safetensors import safe_open

    for r in results:
        ckpts = sorted(Path(r["dir"]).glob("lake/_loop/ckpt-round*/*.safetensors"))
        if ckpts:
            n = 0
            with safe_open(str(ckpts[-1]), "pt") as f:
                for k in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                    n += math.prod(f.get_slice(k).get_shape())
            return n
    return 0


def md_table(headers, rows) -> str:
    return "\n".join(_md_lines(headers, rows))


# ---- statistics ------------------------------------------------------------------------------------------
def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, t975(n - 1) * sd / math.sqrt(n)


def auc(curve: list[float]) -> float:
    """Normalised area under the curve: the trapezoid area over rounds / (rounds - 1) (= the mean success)."""
    if len(curve) < 2:
        return curve[0] if curve else float("nan")
    return sum((a + b) / 2 for a, b in zip(curve, curve[1:], strict=False)) / (len(curve) - 1)


def rounds_to(curve: list[float], level: float, window: int = 3) -> int | None:
    """First round whose trailing moving average (window rounds) reaches `level`; None: never."""
    for r in range(len(curve)):
        lo = max(0, r - window + 1)
        if sum(curve[lo : r + 1]) / (r + 1 - lo) >= level and r + 1 >= min(window, len(curve)):
            return r
    return None


def sign_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test p-value (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * p)


def fmt(m: float, h: float, d: int = 3) -> str:
    return f"{m:.{d}f}" if math.isnan(h) else f"{m:.{d}f} ± {h:.{d}f}"


def summarise(results: list[dict], a: argparse.Namespace) -> str:
    ok = [r for r in results if r["rc"] == 0]
    out = []
    for env, spec in ENVS.items():
        runs = [r for r in ok if r["env"] == env]
        if not runs:
            continue
        arms = [arm for arm in arms_of(env, a) if any(r["arm"] == arm for r in runs)]
        by = {(r["arm"], r["seed"]): r for r in runs}
        seeds = sorted({r["seed"] for r in runs})
        out.append(f"\n### {env} ({spec['paper']})\n")
        rows = []
        R = min(len(r["success"]) for r in runs)
        for arm in arms:
            ss = [by[(arm, s)] for s in seeds if (arm, s) in by]
            au = [auc(r["success"][:R]) for r in ss]
            fin = [sum(r["success"][R - 3 : R]) / len(r["success"][R - 3 : R]) for r in ss]
            rt = [rounds_to(r["success"][:R], a.level) for r in ss]
            dg = [sum(r["diag"][R - 3 : R]) / len(r["diag"][R - 3 : R]) for r in ss]
            rw = [sum(r["reward"][R - 3 : R]) / len(r["reward"][R - 3 : R]) for r in ss]
            reached = [x for x in rt if x is not None]
            rows.append(
                [
                    arm,
                    len(ss),
                    fmt(*mean_ci([r["success"][0] for r in ss])),
                    fmt(*mean_ci(au)),
                    fmt(*mean_ci(fin)),
                    (
                        f"{sum(reached) / len(reached):.1f} ({len(reached)}/{len(rt)})"
                        if reached
                        else f"never (0/{len(rt)})"
                    ),
                    fmt(*mean_ci(rw)),
                    fmt(*mean_ci(dg)),
                    f"{sum(r['wall_s'] for r in ss) / len(ss):.0f}",
                ]
            )
        out.append(
            md_table(
                [
                    "arm",
                    "seeds",
                    "success round 0",
                    f"AUC (mean success, rounds 0-{R - 1})",
                    "success, last 3 rounds",
                    f"rounds to {a.level:.0%} (seeds reaching)",
                    "mean reward, last 3 rounds",
                    f"{spec['diag']}, last 3 rounds",
                    "wall s / run",
                ],
                rows,
            )
        )
        base = arms[0]
        prow = []
        for arm in arms[1:]:
            pairs = [(by[(arm, s)], by[(base, s)]) for s in seeds if (arm, s) in by and (base, s) in by]
            d_auc = [auc(x["success"][:R]) - auc(y["success"][:R]) for x, y in pairs]
            d_fin = [sum(x["success"][R - 3 : R]) / 3 - sum(y["success"][R - 3 : R]) / 3 for x, y in pairs]
            wins = sum(d > 1e-12 for d in d_auc)
            losses = sum(d < -1e-12 for d in d_auc)
            m, h = mean_ci(d_auc)
            verdict = (
                "n/a (1 seed)"
                if math.isnan(h)
                else ("better" if m - h > 0 else "worse" if m + h < 0 else "no difference (CI spans 0)")
            )
            prow.append(
                [
                    f"{arm} − {base}",
                    len(pairs),
                    fmt(m, h),
                    fmt(*mean_ci(d_fin)),
                    f"{wins}/{len(pairs)}",
                    f"{sign_p(wins, losses):.3f}",
                    " ".join(f"{d:+.3f}" for d in d_auc),
                    verdict,
                ]
            )
        out.append("\nPaired by seed (same initial model, tasks and sampling seeds; round 0 identical):\n")
        out.append(
            md_table(
                [
                    "comparison",
                    "pairs",
                    "Δ AUC (95% CI)",
                    "Δ success last 3",
                    "seeds won",
                    "sign test p",
                    "Δ AUC per seed",
                    "verdict",
                ],
                prow,
            )
        )
        out.append("\nMean success per round (over seeds):\n")
        curve_rows = []
        for arm in arms:
            ss = [by[(arm, s)] for s in seeds if (arm, s) in by]
            curve_rows.append(
                [arm, " ".join(f"{sum(r['success'][i] for r in ss) / len(ss):.2f}" for i in range(R))]
            )
        out.append(md_table(["arm", f"rounds 0-{R - 1}"], curve_rows))
    speed = [r for r in ok if r.get("train_tokens_per_s")]
    if speed:
        n_params = a.n_params
        rows = []
        for env in ENVS:
            rs = [r for r in speed if r["env"] == env]
            if not rs:
                continue
            tps = sum(r["train_tokens_per_s"] for r in rs) / len(rs)
            cps = [r["collect_tokens_per_s"] for r in rs if r.get("collect_tokens_per_s")]
            mfu = (
                f"{6 * n_params * tps / (a.peak_tflops * 1e12):.2%}"
                if a.peak_tflops and n_params
                else "n/a (no --peak-tflops)"
            )
            rows.append([env, len(rs), f"{tps:,.0f}", f"{sum(cps) / len(cps):,.0f}" if cps else "n/a", mfu])
        out.append(
            f"\nThroughput ({a.model}, {n_params:,} parameters, backend {a.backend}; mean over runs):\n"
        )
        out.append(
            md_table(
                [
                    "env",
                    "runs",
                    "trainer tokens/s",
                    "collect tokens/s (load incl.)",
                    "trainer MFU (6·N·tokens/s)",
                ],
                rows,
            )
        )
    failed = [r for r in results if r["rc"] != 0]
    if failed:
        out.append(
            "\nFailed runs: "
            + ", ".join(f"{r['env']}/{r['arm']}/seed{r['seed']} (rc {r['rc']})" for r in failed)
        )
    return "\n".join(out)


def arms_of(env: str, a: argparse.Namespace) -> list[str]:
    spec = ENVS[env]
    return spec.get("quick_arms", spec["arms"][:2]) if a.quick or a.pairs_only else spec["arms"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke: 1 seed, 3 rounds, 2 arms per env")
    p.add_argument("--pairs-only", action="store_true", help="per env only GRPO and the paper's main method")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="accelerator peak (dense bf16) for the trainer's MFU"
    )
    p.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    p.add_argument("--arms", nargs="+", default=None, help="only these arms (method chains)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--seed0", type=int, default=0, help="first seed")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="groups per round")
    p.add_argument("--samples", type=int, default=16, help="group size")
    p.add_argument("--hidden", type=int, default=32, help="tiny model hidden size")
    p.add_argument(
        "--format-steps",
        type=int,
        default=150,
        help="format-prior steps of the fresh tiny model (loop.tiny_format_steps)",
    )
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--epochs", type=int, default=2, help="passes over each round's batch")
    p.add_argument("--mini-batch", type=int, default=32, help="trajectories per optimizer step")
    p.add_argument("--level", type=float, default=0.8, help="success level for rounds-to-level")
    p.add_argument("--model", default="tiny", help="tiny | smollm2 | a checkpoint folder (GPU form)")
    p.add_argument("--backend", default="local", choices=["local", "vllm", "auto"])
    p.add_argument("--max-new-tokens", type=int, default=1, help="1: one word per action (the env tokenizer)")
    p.add_argument("--endpoint", action="append", help="OpenAI-compatible server for TCPO's counterfactuals")
    p.add_argument(
        "--no-cf-server",
        dest="cf_server",
        action="store_false",
        help="no policy server for TCPO's counterfactuals (they fall back to hindsight)",
    )
    p.add_argument(
        "--via",
        choices=["function", "cli"],
        default="function",
        help="function: --jobs worker processes call the loop's run_loop for their runs in turn; "
        "cli: one `creditflow loop --config` process per run (Python, torch and Prefect start per run)",
    )
    p.add_argument("--set", action="append", help="stage.key=value for every run's config, e.g. tcpo.mu=3")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    p.add_argument(
        "--report-only", action="store_true", help="summarise the finished runs under --out (run nothing)"
    )
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    p.add_argument("--out", default=str(ROOT / "bench" / "_learning"), help="run folders (lakes, logs)")
    p.add_argument("--resume", action="store_true", help="keep existing run folders (the loop resumes)")
    p.add_argument(
        "--results",
        default=None,
        help="markdown results file (default: bench/results/learning.md; none for --quick)",
    )
    a = p.parse_args(argv)
    if a.worker:
        return worker(a.worker)
    if a.quick:
        a.seeds, a.rounds = 1, 3
    if a.results is None and not a.quick:
        a.results = str(ROOT / "bench" / "results" / "learning.md")
    jobs = [
        (env, arm, seed)
        for seed in range(a.seed0, a.seed0 + a.seeds)
        for env in a.envs
        for arm in arms_of(env, a)
        if a.arms is None or arm in a.arms
    ]
    print(
        f"[learning] {len(jobs)} runs ({a.seeds} seeds x arms), {a.rounds} rounds each, {a.jobs} at a time",
        flush=True,
    )
    a.cf_url = None
    server = None
    if a.report_only:
        a.cf_server = False
    if a.cf_server and not a.endpoint and any(arm.split("+")[0] in CF_ARMS for _, arm, _ in jobs):
        from trainer.policy_server import PolicyServer

        base = None
        if a.model == "smollm2":
            from trainer.llm.service import default_model_dir

            base = default_model_dir()
        elif a.model != "tiny":
            base = Path(a.model)
        server = PolicyServer(base=base).start()
        a.cf_url = server.url
        print(f"[learning] policy server for TCPO's counterfactuals at {server.url}", flush=True)
    t0 = time.perf_counter()
    try:
        if a.report_only:
            results = collect_existing(jobs, a)
        elif a.via == "cli":
            with ThreadPoolExecutor(max_workers=a.jobs) as pool:
                results = list(pool.map(lambda j: run_cli(*j, a), jobs))
        else:
            results = run_workers(jobs, a)
    finally:
        if server is not None:
            server.stop()
    wall = time.perf_counter() - t0
    a.n_params = count_params(results)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "curves.json").write_text(json.dumps(results, indent=1))
    cmd = "python bench/learning.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (
        f"Command: `nice {cmd.strip()}`  \n"
        f"{len(results)} of {len(jobs)} runs done, {a.seeds} seeds ({a.seed0}..{a.seed0 + a.seeds - 1}), {a.rounds} rounds x "
        f"{a.prompts} groups x {a.samples} samples = {a.rounds * a.prompts * a.samples} episodes per run; "
        f"tiny Llama hidden {a.hidden}, 2 layers, word tokenizer over the env's vocabulary; lr {a.lr}, "
        f"{a.mini_batch} trajectories per optimizer step, {a.epochs} epochs; format prior {a.format_steps} steps; "
        f"total wall {wall / 60:.1f} min with {a.jobs} runs in parallel (sum of run walls "
        f"{sum(r['wall_s'] for r in results) / 60:.1f} min).  \n{machine_note()}\n"
    )
    text = header + summarise(results, a)
    print(text)
    if a.results:
        Path(a.results).parent.mkdir(parents=True, exist_ok=True)
        Path(a.results).write_text(text + "\n")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
