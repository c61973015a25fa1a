"""Does the credit help where credit matters? An oracle arm that proves it, then each paper's method against its
own baseline and GRPO, on environments built like the papers' settings (issue 32).

    nice .venv/bin/python bench/learning_credit.py --pilot 6 --max-seeds 30 --jobs 2     # pilot, power, main run
    .venv/bin/python bench/learning_credit.py --quick                                    # smoke (CI): seconds
    .venv/bin/python bench/learning_credit.py --seeds 20 --envs multihop --rounds 20     # fixed seeds

Environments (trainer/envs/credit_tasks.py): `repair` (TCPO: multi-turn code repair, visible-test share as the
per-turn verifier score, best-turn reward), `multihop` (C3: multi-hop search, budget = optimum + 1, a prior that
likes repeating queries), `toolchain` (IAPO: a dependency chain of 4 tool calls with recoverable errors, 8 turns).

Learner: a tabular softmax policy over each env's abstract observation (`env.key`, the same across tasks):
logits = env.prior(key) + theta[key]. Per round: 8 training tasks x 16 samples at temperature 1; the arm's
credit gives one advantage per turn; one policy-gradient step on theta, sum over turns of
A * grad log pi(a | key) / trajectories, plus an entropy bonus (`--ent`) on every visited key (the regulariser
that keeps arms from collapsing; `--ent 0` shows what happens without it).

Arms: every arm but the oracle takes its credit from creditflow's own estimators: the rollouts are laid out
as a trajectories and a steps table (one token per action: token_ids = [action], logprobs = [log pi], the
verifier score per turn, the critic's value per turn for GAE) and the registry runs the method chain
(pipeline.credit.registry.run_methods) with the annotations the method needs: C3's spans from C3's own
detector (pipeline.detect.stage.detect_spans) on the action texts, IAPO's nodes and edges from the env's true
dependency graph (the annotator's target), TCPO's counterfactuals by sampling M alternatives from the rollout
policy at each turn's pre-turn state and scoring them with the env's verifier (the counterfactual stage's
protocol). The oracle arm: A = Q^pi(s_k, a_k) - V^pi(s_k) of the current policy, exact (memoised enumeration
of the env's reachable states), divided by its root-mean-square over the round (so its step size matches a
normalised estimator's).

Evaluation after each round's update, on 48 held-out tasks never trained on: greedy success; for repair also
best-turn pass@8 (8 samples at temperature 1, a task passes when one of them reaches 1.0) and greedy turns to
success (K + 1 when never). AUC = mean over rounds 1..R (round 0, the untrained policy, excluded). Every
comparison is paired by seed: the same seed gives every arm the same tasks, the same initial policy and the
same evaluation samples. A collapse: held-out greedy success falls at least 0.3 below the run's own peak and
ends there (last round).

Power: `--pilot N` runs N pilot seeds (separate from the main seeds), takes each comparison's paired
SD of ΔAUC and mean, and sets the main run's seeds to the most any comparison needs for 80% power at a
two-sided 0.05 (t-based, iterated), capped by --max-seeds. The tables go to stdout and --results (a markdown
file; the committed figures and their reading are in bench/results/learning.md), the raw runs as JSON lines to
--out (pilot.jsonl, runs.jsonl as they finish; runs.json at the end; --report-only summarises either).
`--explain-tcpo ROUNDS` prints TCPO's credit components per kind of turn (bench/results/learning.md, findings).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_BENCH = str(Path(__file__).resolve().parent)
sys.path.insert(0, _BENCH)
from _common import ROOT, machine_note  # noqa: E402
from _common import md_table as _md_lines  # noqa: E402

sys.path[:] = [p for p in sys.path if p not in (_BENCH, "")]
sys.path.insert(0, str(ROOT))

# env -> arms (oracle first, then the baseline GRPO, then the paper's baseline and method), the paper's
# comparisons (method, baseline) besides oracle - grpo
ENVS: dict[str, dict] = {
    "repair": {
        "paper": "TCPO",
        # tcpo_retro (retrospective credit only) and tcpo_retro_hin (+ hindsight, no counterfactual): which part
        # of TCPO's credit carries or loses the signal
        "arms": ["oracle", "grpo", "mt_grpo", "tcpo", "tcpo_retro", "tcpo_retro_hin"],
        "pairs": [
            ("tcpo", "mt_grpo"),
            ("tcpo", "grpo"),
            ("mt_grpo", "grpo"),
            ("tcpo_retro", "grpo"),
            ("tcpo_retro_hin", "tcpo_retro"),
            ("tcpo", "tcpo_retro_hin"),
        ],
        "quick_arms": ["oracle", "grpo", "tcpo"],
        "lr": 4.0,
        "ent": 0.005,
    },
    "multihop": {
        "paper": "C3",
        "arms": ["oracle", "grpo", "gae", "gae+c3", "grpo+c3"],
        "pairs": [("gae+c3", "gae"), ("gae+c3", "grpo"), ("grpo+c3", "grpo"), ("gae", "grpo")],
        "quick_arms": ["oracle", "grpo", "gae+c3"],
        "lr": 4.0,
        "ent": 0.005,
    },
    "toolchain": {
        "paper": "IAPO",
        "arms": ["oracle", "grpo", "grpo+iapo"],
        "pairs": [("grpo+iapo", "grpo")],
        "quick_arms": ["oracle", "grpo", "grpo+iapo"],
        # lr 1.0 / entropy 0.05 (the first setting) left GRPO's policy near uniform (train success 4%) and its
        # greedy argmax flipping between near-ties: 9 of 30 'collapses'; lower lr or entropy did not help
        "lr": 4.0,
        "ent": 0.005,
    },
}

# issue 27's environments as probes (trainer/envs/credit_tasks.ToyProbe): does the oracle beat GRPO there?
for _toy in ("c3_search", "tcpo_refine", "iapo_service"):
    ENVS[f"probe_{_toy}"] = {
        "paper": "probe",
        "arms": ["oracle", "grpo"],
        "pairs": [],
        "lr": 2.0,
        "ent": 0.02,
    }
    ENVS[f"probe_{_toy}"]["quick_arms"] = ENVS[f"probe_{_toy}"]["arms"]
MAIN_ENVS = ["repair", "multihop", "toolchain"]

# method settings: MT-GRPO in its K-turn verifier reading (spec 2.3 [INF]); TCPO's counterfactual budget
STAGES = {"mt_grpo": {"mode": "kturn"}, "tcpo": {"M": 4, "L": 5}}
N_EVAL = 48
PASS_K = 8


# ---- statistics ------------------------------------------------------------------------------------------
def t975(df: int) -> float:
    """Two-sided 95% quantile of Student's t: exact (tabulated) up to 30 degrees of freedom, beyond that the
    Cornish-Fisher expansion around the normal quantile (error < 1e-4 there)."""
    table = (
        12.706,
        4.303,
        3.182,
        2.776,
        2.571,
        2.447,
        2.365,
        2.306,
        2.262,
        2.228,
        2.201,
        2.179,
        2.160,
        2.145,
        2.131,
    )
    table += (
        2.120,
        2.110,
        2.101,
        2.093,
        2.086,
        2.080,
        2.074,
        2.069,
        2.064,
        2.060,
        2.056,
        2.052,
        2.048,
        2.045,
        2.042,
    )
    if 1 <= df <= 30:
        return table[df - 1]
    z = 1.959963984540054
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def mean_ci(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    return m, t975(n - 1) * statistics.stdev(xs) / math.sqrt(n)


def sign_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def seeds_for_power(sd: float, delta: float, power: float = 0.8, cap: int = 10_000) -> int:
    """Paired seeds for `power` at a two-sided 0.05 to detect a mean difference `delta` with per-seed SD `sd`:
    n = ((t_{0.975,n-1} + z_power) * sd / delta)^2, iterated from the normal approximation (cap: not reachable)."""
    if delta == 0 or not math.isfinite(sd):
        return cap
    if sd == 0:
        return 2
    zp = statistics.NormalDist().inv_cdf(power)
    n = max(2, math.ceil(((1.959963984540054 + zp) * sd / abs(delta)) ** 2))
    for _ in range(50):
        new = max(2, math.ceil(((t975(n - 1) + zp) * sd / abs(delta)) ** 2))
        if new == n or new > cap:
            break
        n = new
    return min(n, cap)


def fmt(m: float, h: float, d: int = 3) -> str:
    return f"{m:+.{d}f}" if math.isnan(h) else f"{m:+.{d}f} ± {h:.{d}f}"


# ---- policy ----------------------------------------------------------------------------------------------
class Policy:
    """Tabular softmax: one row of logits per abstract observation, prior + theta."""

    def __init__(self, env) -> None:
        self.env = env
        self.n_actions = len(env.actions)
        self.ids: dict = {}
        self.prior = np.zeros((64, self.n_actions))
        self.theta = np.zeros((64, self.n_actions))
        self.value = np.zeros(64)  # the critic of the GAE arms (per key)

    def row(self, key) -> int:
        r = self.ids.get(key)
        if r is None:
            r = self.ids[key] = len(self.ids)
            if r >= len(self.theta):
                grow = len(self.theta)
                self.prior = np.vstack([self.prior, np.zeros((grow, self.n_actions))])
                self.theta = np.vstack([self.theta, np.zeros((grow, self.n_actions))])
                self.value = np.concatenate([self.value, np.zeros(grow)])
            self.prior[r] = self.env.prior(key)
        return r

    def probs(self, rows) -> np.ndarray:
        z = self.prior[rows] + self.theta[rows]
        z = z - z.max(axis=-1, keepdims=True)
        p = np.exp(z)
        return p / p.sum(axis=-1, keepdims=True)


@dataclass
class Batch:
    """A round's rollouts, one entry per turn (trajectory-major); per trajectory: task, reward, success."""

    traj: np.ndarray  # trajectory of each turn
    turn: np.ndarray  # 1-based
    row: np.ndarray  # policy row (key) of the pre-turn state
    action: np.ndarray
    logp: np.ndarray
    score: np.ndarray  # verifier score after the turn
    error: np.ndarray
    tool: np.ndarray
    binds: np.ndarray
    text: list
    obs: list
    states: list  # pre-turn state of each turn
    tasks: list  # task of each trajectory
    group: np.ndarray  # group (task index in the round) of each trajectory
    reward: np.ndarray
    success: np.ndarray


def rollout(env, policy: Policy, tasks: list[dict], samples: int, rng: np.random.Generator) -> Batch:
    """`samples` episodes of each task at temperature 1, all episodes stepped together: one probability lookup
    and one inverse-CDF draw per turn for the whole batch; the turns come back trajectory-major."""
    n = len(tasks) * samples
    ep_task = [t for t in tasks for _ in range(samples)]
    states = [env.init(t) for t in ep_task]
    turn_of = np.zeros(n, dtype=np.int64)
    rec: dict[str, list] = {
        k: [] for k in ("traj", "row", "action", "logp", "score", "error", "tool", "binds")
    }
    rec.update(text=[], obs=[], states=[])
    active = list(range(n))
    while active:
        rows = np.fromiter(
            (policy.row(env.key(ep_task[i], states[i])) for i in active), np.int64, len(active)
        )
        P = policy.probs(rows)
        acts = (rng.random((len(active), 1)) > P.cumsum(axis=1)).sum(axis=1).clip(max=P.shape[1] - 1)
        logp = np.log(P[np.arange(len(active)), acts])
        still = []
        for j, i in enumerate(active):
            st = env.step(ep_task[i], states[i], int(acts[j]))
            turn_of[i] += 1
            for name, v in (
                ("traj", i),
                ("row", rows[j]),
                ("action", acts[j]),
                ("logp", logp[j]),
                ("score", st.score),
                ("error", st.error),
                ("tool", st.tool),
                ("binds", st.binds),
                ("text", st.text),
                ("obs", st.obs),
                ("states", states[i]),
            ):
                rec[name].append(v)
            states[i] = st.state
            if not st.done:
                still.append(i)
        active = still
    traj = np.asarray(rec["traj"])
    order = np.argsort(traj, kind="stable")  # turns of an episode were recorded in order
    turn = np.empty(len(traj), dtype=np.int64)
    turn[order] = np.concatenate([np.arange(1, k + 1) for k in turn_of]) if n else []
    arr = {
        k: np.asarray(rec[k])[order]
        for k in ("traj", "row", "action", "logp", "score", "error", "tool", "binds")
    }
    return Batch(
        **arr,
        turn=turn[order],
        text=[rec["text"][j] for j in order],
        obs=[rec["obs"][j] for j in order],
        states=[rec["states"][j] for j in order],
        tasks=ep_task,
        group=np.repeat(np.arange(len(tasks)), samples),
        reward=np.array([env.outcome(t, s) for t, s in zip(ep_task, states, strict=True)], dtype=np.float64),
        success=np.array([env.success(t, s) for t, s in zip(ep_task, states, strict=True)]),
    )


# ---- the oracle: exact values of the current policy ------------------------------------------------------
class Values:
    """V^pi(s) and Q^pi(s, a) of the current policy by memoised enumeration of the env's reachable states
    (transitions are deterministic given the task; the outcome is the episode's reward)."""

    def __init__(self, env, policy: Policy) -> None:
        self.env, self.policy = env, policy
        self.memo: dict = {}
        self.pi: dict = {}  # key -> action probabilities (the policy is fixed while the values are taken)

    def probs(self, task: dict, state) -> np.ndarray:
        key = self.env.key(task, state)
        p = self.pi.get(key)
        if p is None:
            p = self.pi[key] = self.policy.probs(self.policy.row(key))
        return p

    def v(self, task: dict, state) -> float:
        key = (task["id"], state)
        got = self.memo.get(key)
        if got is not None:
            return got
        p = self.probs(task, state)
        q = self.q_all(task, state)
        out = float(p @ q)
        self.memo[key] = out
        return out

    def q_all(self, task: dict, state) -> np.ndarray:
        out = np.empty(len(self.env.actions))
        for a in range(len(out)):
            st = self.env.step(task, state, a)
            out[a] = self.env.outcome(task, st.state) if st.done else self.v(task, st.state)
        return out

    def advantages(self, b: Batch) -> np.ndarray:
        """Q(s_k, a_k) - V(s_k) of every turn of the batch."""
        out = np.empty(len(b.traj))
        for j in range(len(out)):
            task, state = b.tasks[b.traj[j]], b.states[j]
            q = self.q_all(task, state)
            out[j] = q[b.action[j]] - self.v(task, state)
        return out


# ---- tables for creditflow's estimators ------------------------------------------------------------------
def tables(env, b: Batch, policy: Policy, round_: int):
    """The round as trajectories and steps tables: per trajectory a user step, then per turn an assistant step
    (one token: the action) and its observation step (a tool step; is_error on an error return)."""
    import pyarrow as pa

    from schemas.steps import SCHEMA as STEPS
    from schemas.steps import SPEC
    from schemas.trajectories import SCHEMA as TRAJ

    n = len(b.reward)
    tid = [f"t{i:05d}" for i in range(n)]
    traj = pa.table(
        {
            "round": pa.array(np.full(n, round_, dtype=np.int32)),
            "traj_id": tid,
            "group_id": [f"g{g:03d}" for g in b.group],
            "sample_idx": pa.array(np.arange(n, dtype=np.int32)),
            "reward": pa.array(b.reward),
            "reward_components": pa.nulls(n, TRAJ.field("reward_components").type),
            "source": ["learning_credit"] * n,
            "action_format": [env.action_format] * n,
            "policy_version": [f"r{round_}"] * n,
            "meta": [json.dumps({"env": env.name, "task_id": t["id"]}) for t in b.tasks],
        },
        schema=TRAJ,
    )
    m = len(b.traj)
    # per trajectory: user step 0; turn k -> assistant step 2k-1, tool step 2k
    n_steps = n + 2 * m
    s_traj = np.concatenate([np.arange(n), np.repeat(b.traj, 2)])
    s_idx = np.concatenate([np.zeros(n, dtype=np.int64), np.stack([2 * b.turn - 1, 2 * b.turn], 1).ravel()])
    order = np.lexsort((s_idx, s_traj))
    is_asst = np.concatenate([np.zeros(n, bool), np.tile([True, False], m)])[order]
    turn = np.concatenate([np.zeros(n, dtype=np.int64), np.repeat(b.turn, 2)])[order]
    src = np.concatenate([np.full(n, -1), np.repeat(np.arange(m), 2)])[order]  # the turn of each step
    content = []
    for j, a in zip(src, is_asst, strict=True):
        content.append("task" if j < 0 else (b.text[j] if a else b.obs[j]))
    tok = np.where(is_asst, b.action[np.maximum(src, 0)], 0).astype(np.int32)
    lp = np.where(is_asst, b.logp[np.maximum(src, 0)], np.nan)
    val = np.where(is_asst, policy.value[b.row[np.maximum(src, 0)]], np.nan)
    offs = np.arange(n_steps + 1, dtype=np.int32)
    steps = pa.table(
        {
            "round": pa.array(np.full(n_steps, round_, dtype=np.int32)),
            "traj_id": pa.array(np.asarray(tid)[s_traj[order]]),
            "step_idx": pa.array(s_idx[order].astype(np.int32)),
            "role": pa.array(np.where(is_asst, "assistant", np.where(src < 0, "user", "tool"))),
            "turn": pa.array(turn.astype(np.int32)),
            "content": content,
            "tool_calls": pa.nulls(n_steps, STEPS.field("tool_calls").type),
            "tool_call_id": pa.nulls(n_steps, pa.string()),
            "is_error": pa.array(~is_asst & (src >= 0) & b.error[np.maximum(src, 0)]),
            "token_ids": pa.ListArray.from_arrays(offs, pa.array(tok)),
            "token_offsets": pa.ListArray.from_arrays(offs, pa.array(np.zeros(n_steps, dtype=np.int32))),
            "logprobs": pa.ListArray.from_arrays(
                offs, pa.array(lp.astype(np.float32)), mask=pa.array(~is_asst)
            ),
            "logprob_source": pa.array(np.where(is_asst, "rollout", None)),
            "values": pa.ListArray.from_arrays(
                offs, pa.array(val.astype(np.float32)), mask=pa.array(~is_asst)
            ),
            "verifier_score": pa.array(
                [float(b.score[j]) if a else None for j, a in zip(src, is_asst, strict=True)]
            ),
        },
        schema=SPEC.written_schema,
    )
    return traj, SPEC.conform(steps)  # (the derived columns: n_tokens, the value moments)


def annotations(env, method: str, b: Batch, policy: Policy, traj, steps, rng, round_: int) -> dict:
    """The annotation tables `method` reads: spans (C3's detector), nodes/edges (the env's true dependency
    graph), counterfactuals (M alternatives from the rollout policy, scored by the env's verifier)."""
    import pyarrow as pa

    from pipeline.credit.registry import method_needs

    needs = method_needs(method)
    out = {}
    if "spans" in needs:
        from pipeline.detect.stage import detect_spans

        out["spans"] = detect_spans(traj, steps)[0]
    if "nodes" in needs or "edges" in needs:
        n_turns = len(b.traj)
        tid = [f"t{i:05d}" for i in b.traj]
        out["nodes"] = pa.table(
            {
                "round": pa.array(np.full(n_turns, round_, dtype=np.int32)),
                "traj_id": tid,
                "turn": pa.array(b.turn.astype(np.int32)),
                "error": pa.array(b.error.astype(np.int8)),
                "error_kind": [("tool" if e else "none") for e in b.error],
                "u_dir": pa.array(np.zeros(n_turns, dtype=np.int32)),
                "annotator": ["env"] * n_turns,
                "parse_failed": pa.array(np.zeros(n_turns, bool)),
            }
        )
        src, dst, typ, etid = [], [], [], []
        last_ok: dict[int, int] = {}
        prev_err = (-1, -1)  # (turn, tool) of the previous turn's error
        for j in range(n_turns):
            if j == 0 or b.traj[j] != b.traj[j - 1]:
                last_ok, prev_err = {}, (-1, -1)
            k, call = int(b.turn[j]), env.tool_of(int(b.action[j]))
            if b.binds[j] >= 0 and b.binds[j] in last_ok:  # the call consumed that call's output
                src.append(last_ok[int(b.binds[j])])
                dst.append(k)
                typ.append("input")
                etid.append(tid[j])
            if prev_err[0] == k - 1 and call == prev_err[1] and call >= 0:  # the recovery of an error
                src.append(k - 1)
                dst.append(k)
                typ.append("failed_utilization")
                etid.append(tid[j])
            if b.tool[j] >= 0:
                last_ok[int(b.tool[j])] = k
            prev_err = (k, call) if b.error[j] else (-1, -1)
        ne = len(src)
        out["edges"] = pa.table(
            {
                "round": pa.array(np.full(ne, round_, dtype=np.int32)),
                "traj_id": pa.array(etid, pa.string()),
                "src_turn": pa.array(src, pa.int32()),
                "dst_turn": pa.array(dst, pa.int32()),
                "sign": pa.array([1 if t == "input" else -1 for t in typ], pa.int8()),
                "type": pa.array(typ, pa.string()),
                "info_unit": pa.nulls(ne, pa.string()),
                "binding": pa.nulls(ne, pa.string()),
                "annotator": pa.array(["env"] * ne, pa.string()),
                "prompt_version": pa.nulls(ne, pa.string()),
            }
        )
    if "counterfactuals" in needs:
        M = STAGES["tcpo"]["M"]
        p = policy.probs(b.row)
        cum = p.cumsum(axis=1)
        alt = (rng.random((len(b.traj), M, 1)) > cum[:, None, :]).sum(axis=2).clip(0, p.shape[1] - 1)
        score = np.empty((len(b.traj), M))
        for j in range(len(b.traj)):
            task, state = b.tasks[b.traj[j]], b.states[j]
            for m_ in range(M):
                score[j, m_] = env.step(task, state, int(alt[j, m_])).score
        n_cf = len(b.traj) * M
        out["counterfactuals"] = pa.table(
            {
                "round": pa.array(np.full(n_cf, round_, dtype=np.int32)),
                "traj_id": [f"t{i:05d}" for i in np.repeat(b.traj, M)],
                "turn": pa.array(np.repeat(b.turn, M).astype(np.int32)),
                "alt_idx": pa.array(np.tile(np.arange(M, dtype=np.int32), len(b.traj))),
                "text": [env.actions[a] for a in alt.ravel()],
                "score": pa.array(score.ravel()),
                "surprisal": pa.array(-np.log(np.take_along_axis(p, alt, 1)).ravel()),
                "sampler": ["policy"] * n_cf,
                "verifier": ["env"] * n_cf,
                "status": ["ok"] * n_cf,
                "error": pa.nulls(n_cf, pa.string()),
            }
        )
    return out


def estimator_credit(env, method: str, b: Batch, policy: Policy, rng, round_: int) -> np.ndarray:
    """Per-turn advantages of `method` from creditflow's registry (one token per turn)."""
    from pipeline.config import Config
    from pipeline.credit.batch import CreditBatch
    from pipeline.credit.registry import run_methods

    traj, steps = tables(env, b, policy, round_)
    ann = annotations(env, method, b, policy, traj, steps, rng, round_)
    cfg = Config(methods=[method], stages=STAGES)
    ctx = CreditBatch.from_arrow(traj, steps, config=cfg, annotations=ann, round_=round_)
    res = run_methods(ctx, [method])[method]
    adv = np.asarray(res.adv_per_token(), dtype=np.float64)[ctx.tok_mask]
    assert len(adv) == len(b.traj), (len(adv), len(b.traj))
    return adv


# ---- one run ---------------------------------------------------------------------------------------------
def evaluate(env, policy: Policy, tasks: list[dict], rng: np.random.Generator, pass_k: int) -> dict:
    """Greedy success, greedy turns to success (K + 1 when never) and best-turn pass@k at temperature 1."""
    succ, turns = [], []
    for task in tasks:
        state, k, done, first = env.init(task), 0, False, None
        while not done:
            p = policy.probs(policy.row(env.key(task, state)))
            st = env.step(task, state, int(np.argmax(p)))
            k += 1
            state, done = st.state, st.done
            if first is None and env.success(task, state):
                first = k
        succ.append(env.success(task, state))
        turns.append(first if first is not None else env.max_turns(task) + 1)
    out = {"greedy": float(np.mean(succ)), "turns": float(np.mean(turns))}
    if pass_k:
        b = rollout(env, policy, tasks, pass_k, rng)
        out["pass_k"] = float(b.success.reshape(len(tasks), pass_k).any(axis=1).mean())
    return out


def diagnostics(env, b: Batch, adv: np.ndarray, oracle: np.ndarray) -> dict:
    """How the arm's per-turn credit relates to the true one on the same rollouts: correlation, sign agreement
    where the oracle is clearly nonzero, and the mean credit on the env's 'bad turns inside successful
    episodes' (repair: a wrong edit; multihop: a repeated query; toolchain: an error call) beside the oracle's."""
    out = {}
    if np.std(adv) > 0 and np.std(oracle) > 0:
        out["corr"] = float(np.corrcoef(adv, oracle)[0, 1])
    clear = np.abs(oracle) > 0.05 * max(np.abs(oracle).max(), 1e-12)
    if clear.any():
        out["sign_agree"] = float((np.sign(adv[clear]) == np.sign(oracle[clear])).mean())
    bad = env_bad_turns(env, b) & b.success[b.traj]
    if bad.any():
        out["bad_in_success"] = float(adv[bad].mean())
        out["bad_in_success_oracle"] = float(oracle[bad].mean())
        out["bad_in_success_n"] = int(bad.sum())
    return out


def env_bad_turns(env, b: Batch) -> np.ndarray:
    if env.name == "repair":  # an edit that lowered the score, or left it below 1.0
        prev = np.where(b.turn == 1, 0.25, np.concatenate([[0.0], b.score[:-1]]))
        return (b.score < prev) | ((b.score == prev) & (b.score < 1.0))
    if env.name == "multihop":
        return np.array([env.is_repeat(s, int(a)) for s, a in zip(b.states, b.action, strict=True)])
    return b.error.astype(bool)


def run_one(env_name: str, arm: str, seed: int, a: dict, keep: list | None = None) -> dict:
    """One (env, arm, seed) run; every random stream is derived from the seed alone, so arms are paired."""
    from trainer.envs.credit_tasks import make_credit_env

    t0 = time.perf_counter()
    env = make_credit_env(env_name)
    lr = a["lr"] if a.get("lr") is not None else ENVS[env_name]["lr"]
    ent_coef = a["ent"] if a.get("ent") is not None else ENVS[env_name]["ent"]
    train = env.tasks(a["train_tasks"], seed=10_000 + seed)
    held = env.tasks(N_EVAL, seed=20_000 + seed)
    policy = Policy(env)
    rng = np.random.default_rng(seed)
    pass_k = PASS_K if env_name == "repair" else 0
    curves: dict[str, list] = {"greedy": [], "turns": [], "pass_k": [], "train_success": [], "entropy": []}
    diag: list[dict] = []
    for r in range(a["rounds"] + 1):
        ev = evaluate(env, policy, held, np.random.default_rng([seed, r, 7]), pass_k)
        for k, v in ev.items():
            curves[k].append(v)
        if r == a["rounds"]:
            break
        order = rng.permutation(len(train))[: a["prompts"]]
        b = rollout(env, policy, [train[i] for i in order], a["samples"], rng)
        curves["train_success"].append(float(b.success.mean()))
        p = policy.probs(b.row)
        curves["entropy"].append(float(-(p * np.log(p + 1e-300)).sum(1).mean()))
        want_oracle = arm == "oracle" or (a["diag_every"] and r % a["diag_every"] == 0)
        oracle = Values(env, policy).advantages(b) if want_oracle else None
        if arm == "oracle":
            assert oracle is not None
            rms = math.sqrt(float(np.mean(oracle**2)))
            adv = oracle / rms if rms > 1e-12 else np.zeros_like(oracle)
        else:
            adv = estimator_credit(env, arm, b, policy, rng, r)
        if oracle is not None:
            diag.append({"round": r, **diagnostics(env, b, adv, oracle)})
            if a.get("keep_turns") and r == a["keep_turns"]:
                diag[-1]["turns"] = {
                    "traj": b.traj.tolist(),
                    "action": b.action.tolist(),
                    "adv": np.round(adv, 4).tolist(),
                    "oracle": np.round(oracle, 4).tolist(),
                    "success": b.success[b.traj].tolist(),
                    "bad": env_bad_turns(env, b).tolist(),
                }
        # policy gradient: sum_k A_k grad log pi(a_k | key_k) / trajectories, + entropy bonus on visited keys
        n = len(b.reward)
        onehot = np.zeros_like(p)
        onehot[np.arange(len(b.action)), b.action] = 1.0
        g = adv[:, None] * (onehot - p)
        logp = np.log(p + 1e-300)
        ent = -(p * logp).sum(1, keepdims=True)
        g += ent_coef * (-p * (logp + ent))  # d H / d logits
        upd = np.zeros_like(policy.theta)
        np.add.at(upd, b.row, g)
        policy.theta += lr * upd / n
        if arm.startswith("gae"):  # the critic: per key, towards the Monte Carlo return (gamma = 1)
            tgt = b.reward[b.traj]
            dv = np.zeros_like(policy.value)
            cnt = np.zeros_like(policy.value)
            np.add.at(dv, b.row, tgt - policy.value[b.row])
            np.add.at(cnt, b.row, 1.0)
            policy.value += a["critic_lr"] * dv / np.maximum(cnt, 1.0)
    if keep is not None:
        keep.append(policy)
    g = curves["greedy"]
    peak = max(g[1:]) if len(g) > 1 else g[0]
    collapsed = bool(len(g) > 2 and peak - g[-1] >= 0.3)
    return {
        "env": env_name,
        "arm": arm,
        "seed": seed,
        "curves": curves,
        "diag": diag,
        "collapsed": collapsed,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _run_job(job):
    env, arm, seed, a = job
    try:
        return run_one(env, arm, seed, a)
    except Exception as exc:  # noqa: BLE001 - reported, the other runs go on
        import traceback

        return {"env": env, "arm": arm, "seed": seed, "error": f"{exc!r}\n{traceback.format_exc()[-1500:]}"}


def run_jobs(jobs: list[tuple], n_jobs: int, sink: Path | None = None) -> list[dict]:
    """The runs over `n_jobs` processes, in job order; each finished run is appended to `sink` (JSON lines) so
    an interrupted benchmark can still be summarised (--report-only)."""
    out: list[dict] = []

    def done(r: dict) -> None:
        out.append(r)
        print(
            f"[credit] {r['env']:9s} {r['arm']:9s} seed {r['seed']}: {r.get('wall_s', 'failed')} s",
            flush=True,
        )
        if sink is not None:
            with open(sink, "a") as f:
                f.write(json.dumps(r) + "\n")

    if n_jobs <= 1:
        for j in jobs:
            done(_run_job(j))
    else:
        with ProcessPoolExecutor(max_workers=n_jobs) as pool:
            for r in pool.map(_run_job, jobs, chunksize=1):
                done(r)
    for r in out:
        if "error" in r:
            print(f"[credit] {r['env']} {r['arm']} seed {r['seed']} FAILED: {r['error']}", file=sys.stderr)
    return out


# ---- summaries -------------------------------------------------------------------------------------------
def auc(curve: list[float]) -> float:
    """Mean over rounds 1..R (round 0, the untrained policy, excluded)."""
    return float(np.mean(curve[1:])) if len(curve) > 1 else float("nan")


def metric(run: dict, name: str) -> float:
    if name == "auc":
        return auc(run["curves"]["greedy"])
    if name == "final":
        return float(np.mean(run["curves"]["greedy"][-3:]))
    if name == "pass_k":
        return auc(run["curves"]["pass_k"])
    if name == "turns":
        return auc(run["curves"]["turns"])
    raise KeyError(name)


def paired(runs: list[dict], env: str, x: str, y: str, name: str = "auc") -> dict:
    by = {(r["arm"], r["seed"]): r for r in runs if r["env"] == env and "error" not in r}
    seeds = sorted(s for (arm, s) in by if arm == x and (y, s) in by)
    d = [metric(by[(x, s)], name) - metric(by[(y, s)], name) for s in seeds]
    if not d:
        return {"n": 0}
    m, h = mean_ci(d)
    wins, losses = sum(v > 1e-12 for v in d), sum(v < -1e-12 for v in d)
    return {
        "n": len(d),
        "mean": m,
        "ci": h,
        "sd": statistics.stdev(d) if len(d) > 1 else float("nan"),
        "wins": wins,
        "losses": losses,
        "p": sign_p(wins, losses),
        "d": d,
        "seeds": seeds,
    }


def comparisons(env: str) -> list[tuple[str, str]]:
    return [("oracle", "grpo"), *ENVS[env]["pairs"]]


def verdict(c: dict) -> str:
    if c["n"] < 2:
        return "n/a"
    if c["mean"] - c["ci"] > 0:
        return "better"
    if c["mean"] + c["ci"] < 0:
        return "worse"
    return "no difference (CI spans 0)"


def power_table(runs: list[dict], envs: list[str], cap: int) -> tuple[list[str], int]:
    rows, need = [], 2
    for env in envs:
        for x, y in comparisons(env):
            c = paired(runs, env, x, y)
            if c["n"] < 2:
                continue
            n = seeds_for_power(c["sd"], c["mean"], cap=10_000)
            rows.append(
                [
                    env,
                    f"{x} − {y}",
                    c["n"],
                    f"{c['mean']:+.4f}",
                    f"{c['sd']:.4f}",
                    n if n < 10_000 else "> 10000",
                ]
            )
            if n < 10_000:
                need = max(need, n)
    lines = _md_lines(
        ["env", "comparison", "pilot seeds", "pilot mean ΔAUC", "pilot SD of ΔAUC", "seeds for 80% power"],
        rows,
    )
    return lines, min(need, cap)


def summarise(runs: list[dict], envs: list[str], a: dict) -> str:
    ok = [r for r in runs if "error" not in r]
    out = []
    for env in envs:
        rs = [r for r in ok if r["env"] == env]
        if not rs:
            continue
        arms = [x for x in ENVS[env]["arms"] if any(r["arm"] == x for r in rs)]
        seeds = sorted({r["seed"] for r in rs})
        out.append(f"\n### {env} ({ENVS[env]['paper']})\n")
        out.append(f"Seeds: {seeds[0]}..{seeds[-1]} ({len(seeds)}), the same for every arm.\n")
        head = [
            "arm",
            "runs",
            "held-out greedy, round 0",
            "AUC (greedy, rounds 1-R)",
            "greedy, last 3 rounds",
        ]
        if env == "repair":
            head += ["best-turn pass@8 (AUC)", "greedy turns to success (AUC; K+1 = never)"]
        head += ["train success, last round", "collapses", "s / run"]
        rows = []
        for arm in arms:
            ss = [r for r in rs if r["arm"] == arm]
            row = [
                arm,
                len(ss),
                fmt(*mean_ci([r["curves"]["greedy"][0] for r in ss])),
                fmt(*mean_ci([metric(r, "auc") for r in ss])),
                fmt(*mean_ci([metric(r, "final") for r in ss])),
            ]
            if env == "repair":
                row += [
                    fmt(*mean_ci([metric(r, "pass_k") for r in ss])),
                    fmt(*mean_ci([metric(r, "turns") for r in ss]), 2),
                ]
            row += [
                fmt(*mean_ci([r["curves"]["train_success"][-1] for r in ss])),
                f"{sum(r['collapsed'] for r in ss)}/{len(ss)}",
                f"{np.mean([r['wall_s'] for r in ss]):.1f}",
            ]
            rows.append(row)
        out += _md_lines(head, rows)
        out.append(
            "\nPaired by seed (Δ = first arm − second; 95% t-interval over seeds; exact two-sided sign test):\n"
        )
        prow = []
        names = ["auc"] + (["pass_k", "turns"] if env == "repair" else [])
        for x, y in comparisons(env):
            for name in names:
                c = paired(ok, env, x, y, name)
                if c["n"] == 0:
                    continue
                prow.append(
                    [
                        f"{x} − {y}",
                        {"auc": "greedy AUC", "pass_k": "pass@8 AUC", "turns": "turns to success AUC"}[name],
                        c["n"],
                        fmt(c["mean"], c["ci"]),
                        f"{c['wins']}/{c['losses']}",
                        f"{c['p']:.3g}",
                        verdict(c)
                        if name != "turns"
                        else verdict({**c, "mean": -c["mean"]}) + " (fewer is better)",
                    ]
                )
        out += _md_lines(
            ["comparison", "metric", "pairs", "Δ (95% CI)", "wins/losses", "sign p", "verdict"], prow
        )
        out.append("\nMean held-out greedy success per round (over seeds):\n")
        R = min(len(r["curves"]["greedy"]) for r in rs)
        crow = []
        for arm in arms:
            ss = [r for r in rs if r["arm"] == arm]
            crow.append(
                [arm, " ".join(f"{np.mean([r['curves']['greedy'][i] for r in ss]):.2f}" for i in range(R))]
            )
        out += _md_lines(["arm", f"rounds 0-{R - 1}"], crow)
        drow = []
        for arm in arms:
            ds = [d for r in rs if r["arm"] == arm for d in r["diag"]]
            if not ds:
                continue

            def avg(k, ds=ds):
                v = [d[k] for d in ds if k in d]
                return f"{np.mean(v):+.3f}" if v else "n/a"

            drow.append(
                [
                    arm,
                    len(ds),
                    avg("corr"),
                    avg("sign_agree"),
                    avg("bad_in_success"),
                    avg("bad_in_success_oracle"),
                ]
            )
        if drow:
            out.append(
                f"\nPer-turn credit against the oracle's on the arm's own rollouts (every {a['diag_every']} rounds): "
                "correlation, sign agreement where the oracle is clearly nonzero, and the mean credit on "
                f"{BAD.get(env, 'turns the env marks bad (none for probes)')} inside successful episodes (the arm's, then the oracle's Q − V, unnormalised):\n"
            )
            out += _md_lines(
                [
                    "arm",
                    "rounds x seeds",
                    "corr(A, Q−V)",
                    "sign agreement",
                    "mean A on bad turns",
                    "mean Q−V there",
                ],
                drow,
            )
        ex = example_turns(rs, env, arms)
        if ex:
            out.append(
                f"\nPer-turn advantages from the run (round {a['keep_turns']}, the first seed with such an episode): "
                f"a successful episode with {BAD.get(env, 'a bad turn')} marked *, each arm's credit on its own "
                "rollout beside the oracle's Q − V of the same turns under that arm's policy:\n"
            )
            out += ex
    return "\n".join(out)


def example_turns(rs: list[dict], env: str, arms: list[str]) -> list[str]:
    """One successful trajectory with a bad turn per arm, from the kept round: actions, A, Q - V."""
    from trainer.envs.credit_tasks import make_credit_env

    names = make_credit_env(env).actions
    rows = []
    for arm in arms:
        for r in sorted((r for r in rs if r["arm"] == arm), key=lambda r: r["seed"]):
            kept = [d["turns"] for d in r["diag"] if "turns" in d and "bad" in d["turns"]]
            if not kept:
                continue
            t = kept[0]
            traj = np.asarray(t["traj"])
            ok = np.asarray(t["success"]) & np.asarray(t["bad"])
            if not ok.any():
                continue
            sel = np.flatnonzero(traj == traj[np.flatnonzero(ok)[0]])
            rows.append(
                [
                    arm,
                    r["seed"],
                    " ".join(names[t["action"][j]] + ("*" if t["bad"][j] else "") for j in sel),
                    " ".join(f"{t['adv'][j]:+.2f}" for j in sel),
                    " ".join(f"{t['oracle'][j]:+.3f}" for j in sel),
                ]
            )
            break
    return (
        _md_lines(["arm", "seed", "actions (turn 1..)", "A per turn", "oracle Q − V per turn"], rows)
        if rows
        else []
    )


def explain_tcpo(seed: int, rounds: int, cfg: dict) -> list[str]:
    """Which part of TCPO's credit loses the signal on `repair`: a policy trained by GRPO for `rounds` rounds
    (mid-training), one round of its rollouts, TCPO's components per kind of turn beside the other arms'
    credit and the oracle's Q - V on the same turns."""
    from pipeline.config import Config
    from pipeline.credit.batch import CreditBatch
    from pipeline.credit.registry import run_methods
    from trainer.envs.credit_tasks import make_credit_env

    env = make_credit_env("repair")
    kept: list = []
    run_one("repair", "grpo", seed, {**cfg, "rounds": rounds, "diag_every": 0}, keep=kept)
    policy = kept[0]
    rng = np.random.default_rng([seed, 99])
    b = rollout(env, policy, env.tasks(8, seed=30_000 + seed), 16, rng)
    traj, steps = tables(env, b, policy, 0)
    methods = ["tcpo", "mt_grpo", "grpo"]
    ann = annotations(env, "tcpo", b, policy, traj, steps, rng, 0)
    ctx = CreditBatch.from_arrow(traj, steps, config=Config(methods=methods, stages=STAGES), annotations=ann)
    res = run_methods(ctx, methods)
    asst = ctx.steps["is_assistant"].to_numpy()
    comp = {k: np.asarray(v)[asst] for k, v in res["tcpo"].components.items()}
    adv = {m: np.asarray(res[m].adv_per_token())[ctx.tok_mask] for m in methods}
    oracle = Values(env, policy).advantages(b)
    prev = np.where(b.turn == 1, 0.25, np.concatenate([[0.0], b.score[:-1]]))
    best_before = np.array(
        [max([0.25] + [b.score[i] for i in range(j - int(b.turn[j]) + 1, j)]) for j in range(len(b.turn))]
    )
    won = b.success[b.traj]
    kinds = {}
    for name, m in (
        ("fix (score rises)", b.score > prev),
        ("no change, before success", (b.score == prev) & (best_before < 1.0)),
        ("breaks a part, before success", (b.score < prev) & (best_before < 1.0)),
        ("after success", best_before >= 1.0),
    ):
        kinds[f"{name}, episode fails"] = m & ~won
        kinds[f"{name}, episode succeeds"] = m & won
    rows = []
    for name, m in kinds.items():
        if not m.any():
            continue
        later = np.array([b.success[b.traj[j]] for j in np.flatnonzero(m)])

        def mean(x, m=m):
            v = np.asarray(x, dtype=np.float64)[m]
            v = v[np.isfinite(v)]
            return f"{v.mean():+.3f}" if len(v) else "n/a"

        rows.append(
            [
                name,
                int(m.sum()),
                f"{later.mean():.2f}",
                mean(comp.get("c_ret", np.full(len(m), np.nan))),
                mean(comp.get("c_hin", np.full(len(m), np.nan))),
                mean(comp.get("c_del", np.full(len(m), np.nan))),
                mean(comp.get("phi_norm", np.full(len(m), np.nan))),
                mean(adv["tcpo"]),
                mean(adv["mt_grpo"]),
                mean(adv["grpo"]),
                mean(oracle),
            ]
        )
    return _md_lines(
        [
            "turn kind",
            "turns",
            "episode succeeds",
            "c_ret",
            "c_hin",
            "c_del",
            "Norm(phi)",
            "A tcpo",
            "A mt_grpo",
            "A grpo",
            "oracle Q − V",
        ],
        rows,
    )


BAD = {
    "repair": "edits that did not raise the score",
    "multihop": "repeated queries",
    "toolchain": "error calls",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke: 1 seed, 3 rounds, 3 arms per env")
    p.add_argument("--envs", nargs="+", default=MAIN_ENVS, choices=list(ENVS))
    p.add_argument("--arms", nargs="+", default=None)
    p.add_argument("--seeds", type=int, default=None, help="main-run seeds (default: from the pilot's power)")
    p.add_argument("--seed0", type=int, default=100, help="first main-run seed (pilot seeds start at 0)")
    p.add_argument("--pilot", type=int, default=0, help="pilot seeds for the power computation")
    p.add_argument("--pilot-from", default=None, help="the pilot's runs from an earlier run's pilot.jsonl")
    p.add_argument("--max-seeds", type=int, default=40)
    p.add_argument("--min-seeds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--train-tasks", type=int, default=64)
    p.add_argument("--lr", type=float, default=None, help="policy step size (default: per env, ENVS)")
    p.add_argument("--ent", type=float, default=None, help="entropy bonus coefficient (default: per env)")
    p.add_argument("--critic-lr", type=float, default=0.3)
    p.add_argument(
        "--diag-every", type=int, default=3, help="oracle diagnostics of non-oracle arms every N rounds"
    )
    p.add_argument("--keep-turns", type=int, default=6, help="keep the per-turn advantages of this round")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench" / "_learning_credit"))
    p.add_argument("--results", default=None)
    p.add_argument("--report-only", action="store_true", help="summarise --out/runs.json")
    p.add_argument(
        "--explain-tcpo",
        type=int,
        default=None,
        metavar="ROUNDS",
        help="print TCPO's credit components per kind of turn under a policy GRPO trained for ROUNDS rounds",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.pilot, a.seeds, a.diag_every = 3, 0, 1, 1
    cfg = {
        k: getattr(a, k)
        for k in (
            "rounds",
            "prompts",
            "samples",
            "train_tasks",
            "lr",
            "ent",
            "critic_lr",
            "diag_every",
            "keep_turns",
        )
    }
    if a.explain_tcpo is not None:
        for seed in range(a.seed0, a.seed0 + (a.seeds or 1)):
            print(f"\nseed {seed}, policy after {a.explain_tcpo} GRPO rounds:\n")
            print("\n".join(explain_tcpo(seed, a.explain_tcpo, cfg)))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not a.report_only:
        for name in ("pilot.jsonl", "runs.jsonl", "runs.json"):
            (out / name).unlink(missing_ok=True)

    def arms_of(env):
        arms = ENVS[env]["quick_arms"] if a.quick else ENVS[env]["arms"]
        return [x for x in arms if a.arms is None or x in a.arms]

    t0 = time.perf_counter()
    pilot: list[dict] = []
    power_lines: list[str] = []
    if a.report_only:  # runs.json of a finished benchmark, else the JSON lines of an unfinished one
        if (out / "runs.json").exists():
            data = json.loads((out / "runs.json").read_text())
            pilot, runs, power_lines, n_seeds = data["pilot"], data["runs"], data["power"], data["seeds"]
        else:
            lines = {
                n: [json.loads(x) for x in (out / f"{n}.jsonl").read_text().splitlines()]
                for n in ("pilot", "runs")
                if (out / f"{n}.jsonl").exists()
            }
            pilot, runs = lines.get("pilot", []), lines.get("runs", [])
            if pilot:
                power_lines, n_seeds = power_table(pilot, a.envs, a.max_seeds)
            n_seeds = len({r["seed"] for r in runs})
    else:
        if a.pilot_from:
            pilot = [json.loads(x) for x in Path(a.pilot_from).read_text().splitlines()]
            a.pilot = len({r["seed"] for r in pilot})
            (out / "pilot.jsonl").write_text(Path(a.pilot_from).read_text())
        elif a.pilot:
            jobs = [(env, arm, s, cfg) for s in range(a.pilot) for env in a.envs for arm in arms_of(env)]
            print(f"[credit] pilot: {len(jobs)} runs", flush=True)
            pilot = run_jobs(jobs, a.jobs, out / "pilot.jsonl")
        if pilot:
            power_lines, n_seeds = power_table(pilot, a.envs, a.max_seeds)
            n_seeds = max(n_seeds, a.min_seeds)
            print("\n".join(power_lines), f"\n[credit] main run: {n_seeds} seeds", flush=True)
        else:
            n_seeds = a.seeds or 1
        if a.seeds is not None:
            n_seeds = a.seeds
        jobs = [
            (env, arm, s, cfg)
            for s in range(a.seed0, a.seed0 + n_seeds)
            for env in a.envs
            for arm in arms_of(env)
        ]
        print(f"[credit] {len(jobs)} runs, {a.jobs} at a time", flush=True)
        runs = run_jobs(jobs, a.jobs, out / "runs.jsonl")
        (out / "runs.json").write_text(
            json.dumps({"pilot": pilot, "runs": runs, "power": power_lines, "seeds": n_seeds, "cfg": cfg})
        )
    wall = time.perf_counter() - t0
    failed = [r for r in runs + pilot if "error" in r]
    cmd = "python bench/learning_credit.py " + " ".join(argv if argv is not None else sys.argv[1:])
    head = (
        f"Command: `nice {cmd.strip()}`  \n"
        f"{len(runs)} main runs ({n_seeds} seeds from {a.seed0}) + {len(pilot)} pilot runs; {a.rounds} rounds x "
        f"{a.prompts} tasks x {a.samples} samples per round; lr / entropy bonus "
        + (
            f"{a.lr} / {a.ent}"
            if a.lr is not None
            else ", ".join(f"{e} {ENVS[e]['lr']} / {ENVS[e]['ent']}" for e in a.envs)
        )
        + f"; critic lr "
        f"{a.critic_lr}; {a.train_tasks} training tasks, {N_EVAL} held-out tasks per seed; wall {wall / 60:.1f} min "
        f"with {a.jobs} processes.  \n{machine_note()}\n"
    )
    text = head
    if power_lines:
        text += "\n#### Power (pilot seeds 0.." + str(a.pilot - 1) + ")\n\n" + "\n".join(power_lines) + "\n"
        text += f"\nMain run seeds: {n_seeds} (the most any comparison needs, within [{a.min_seeds}, {a.max_seeds}]).\n"
    text += summarise(runs, a.envs, cfg)
    if failed:
        text += "\n\nFailed runs: " + ", ".join(f"{r['env']}/{r['arm']}/{r['seed']}" for r in failed)
    print(text)
    if a.results:
        Path(a.results).write_text(text + "\n")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
