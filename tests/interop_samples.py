"""Small rollout dumps in the RL frameworks' own layouts, generated here (no downloaded data), each with bad
records whose quarantine reason the tests check. Every writer returns (path, expected counts)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ESC_IN, ESC_OUT = "\x1b[33m\x1b[2m", "\x1b[0m"


def _rllm_step(prompt_msgs, answer, ids, reward=0.0, lps=None):
    return {
        "prompt_ids": list(range(100, 100 + 3 * len(prompt_msgs))),
        "response_ids": ids,
        "logprobs": lps if lps is not None else [-0.1 * (k + 1) for k in range(len(ids))],
        "chat_completions": [*prompt_msgs, {"role": "assistant", "content": answer}],
        "observation": None,
        "thought": "",
        "action": answer,
        "model_response": answer,
        "model_output": None,
        "info": {},
        "reward": reward,
        "done": False,
        "mc_return": 0.0,
        "advantage": None,
    }


def write_rllm(root: Path) -> Path:
    """3 tasks x 2 rollouts, 2-step trajectories (one task has two agent roles) + 3 bad episodes."""
    lines = []
    for task in range(3):
        for rollout in range(2):
            sys_user = [{"role": "system", "content": "solve"}, {"role": "user", "content": f"task {task}"}]
            obs = {"role": "user", "content": f"feedback {rollout}"}
            s1 = _rllm_step(sys_user, "guess", [11, 12, 13])
            s2 = _rllm_step(
                [*sys_user, {"role": "assistant", "content": "guess"}, obs],
                "answer",
                [21, 22],
                reward=float(rollout),
            )
            trajs = [
                {
                    "uid": f"u{task}{rollout}",
                    "name": "solver",
                    "task": {"q": task},
                    "steps": [s1, s2],
                    "reward": float(rollout + task),
                    "info": {},
                }
            ]
            if task == 2:
                trajs.append(
                    {
                        "uid": f"v{rollout}",
                        "name": "judge",
                        "task": None,
                        "reward": None,
                        "info": {},
                        "steps": [_rllm_step(sys_user, "ok", [5], reward=0.5)],
                    }
                )
            lines.append(
                {
                    "id": f"task{task}:{rollout}",
                    "task": {"q": task},
                    "termination_reason": "ENV_DONE",
                    "is_correct": rollout == 1,
                    "trajectories": trajs,
                    "metrics": {},
                    "info": {},
                }
            )
    bad_len = json.loads(json.dumps(lines[0]))
    bad_len["id"] = "task9:0"
    bad_len["trajectories"][0]["steps"][0]["logprobs"] = [-0.1]  # 3 response_ids, 1 logprob
    no_traj = {"id": "task8:0", "task": None, "trajectories": [], "is_correct": False}
    no_reward = json.loads(json.dumps(lines[0]))
    no_reward["id"] = "task7:0"
    no_reward["trajectories"][0]["reward"] = None
    for s in no_reward["trajectories"][0]["steps"]:
        s["reward"] = None
    path = root / "episodes.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [*lines, bad_len, no_traj, no_reward]) + "\n{broken\n")
    return path


def write_areal(root: Path) -> Path:
    """dump_dir/<version>/<qid>.txt: 2 prompts x 4 samples at version 3, + 2 bad blocks in a third file."""
    folder = root / "dump" / "3"
    folder.mkdir(parents=True)
    for q in range(2):
        blocks = []
        for i in range(4):
            prompt = f"<|im_start|>user\nWhat is {q} + {i}?<|im_end|>\n<|im_start|>assistant\n"
            seq = f"The answer is\n{q + i}.<|im_end|>"
            blocks.append(
                "\n".join(
                    [
                        f"idx: {i + 1} / 4, seqlen: {30 + i}, reward is {float(i % 2)}.",
                        f"prompt is \n{ESC_IN}{prompt}{ESC_OUT}",
                        f"sequence is: \n{ESC_IN}{seq}{ESC_OUT}",
                    ]
                )
            )
        (folder / f"q{q}.txt").write_text("\n".join(blocks) + "\n")
    bad = [
        "\n".join(
            [
                "idx: 1 / 2, seqlen: 9, reward is nan.",
                f"prompt is \n{ESC_IN}p{ESC_OUT}",
                f"sequence is: \n{ESC_IN}s{ESC_OUT}",
            ]
        ),
        "idx: 2 / 2, seqlen: 9, reward is 1.0.\nprompt is missing",
    ]
    (folder / "qbad.txt").write_text("\n".join(bad) + "\n")
    return root / "dump"


def write_roll(root: Path) -> Path:
    """2 groups x 3 trajectories of 2 turns with step scores + 3 bad rows."""
    rows = []
    for g in range(2):
        for k in range(3):
            msgs = [
                {"role": "system", "content": "You play Sokoban."},
                {"role": "user", "content": f"state {g}"},
                {"role": "assistant", "content": "<answer>Up</answer>"},
                {"role": "user", "content": "moved"},
                {"role": "assistant", "content": "<answer>Left</answer>"},
            ]
            rows.append(
                {
                    "traj_id": f"g{g}-t{k}",
                    "traj_group_id": f"sokoban-{g}",
                    "env_ids": g * 3 + k,
                    "tags": "SimpleSokoban",
                    "episode_scores": float(k == 2),
                    "step_scores": [0.0, float(k == 2)],
                    "messages": msgs,
                    "global_step": 4,
                }
            )
    bad_steps = dict(rows[0], traj_id="bad-steps", step_scores=[1.0])
    no_score = {k: v for k, v in rows[0].items() if k != "episode_scores"} | {"traj_id": "no-score"}
    inf_score = dict(rows[0], traj_id="inf", episode_scores=math.inf)
    path = root / "roll.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in [*rows, bad_steps, no_score])
        + "\n"
        + json.dumps(inf_score).replace("Infinity", "1e999")
        + "\n"
    )
    return path


def write_trl(root: Path) -> Path:
    """completions/completions_00010.parquet and _00020: 2 steps x 2 prompts x 4 completions, 2 reward functions
    (one NaN where it does not apply) + 2 bad rows (all rewards NaN; no completion)."""
    folder = root / "completions"
    folder.mkdir(parents=True)
    for step in (10, 20):
        prompts, comps, acc, fmt, adv = [], [], [], [], []
        for p in range(2):
            for c in range(4):
                prompts.append(f"Question {p}: 2+{p}?")
                comps.append(f"<think>hm</think> {2 + p + c % 2}")
                acc.append(float(c % 2 == 0))
                fmt.append(float("nan") if c == 3 else 0.5)
                adv.append(0.1 * c)
        if step == 20:
            prompts += ["Question 9", "Question 9"]
            comps += ["x", None]
            acc += [float("nan"), 1.0]
            fmt += [float("nan"), 1.0]
            adv += [0.0, 0.0]
        table = pa.table(
            {
                "step": [step] * len(prompts),
                "prompt": prompts,
                "completion": comps,
                "accuracy_reward": acc,
                "format_reward": fmt,
                "advantage": adv,
            }
        )
        pq.write_table(table, folder / f"completions_{step:05d}.parquet")
    return folder


def verl_arrays(n_groups=2, samples=3, seed=0) -> dict[str, np.ndarray]:
    """A multi-turn verl batch: left-padded prompts, responses with 2 assistant runs and a tool run between."""
    rng = np.random.default_rng(seed)
    B, P, R = n_groups * samples, 6, 14
    prompts = np.zeros((B, P), np.int64)
    responses = np.zeros((B, R), np.int64)
    attn = np.zeros((B, P + R), np.int64)
    rmask = np.zeros((B, R), np.int64)
    scores = np.zeros((B, R), np.float32)
    for b in range(B):
        p = 3 + b % 3
        prompts[b, P - p :] = rng.integers(300, 400, p)
        attn[b, P - p : P] = 1
        a1, t, a2 = 3, 2 + b % 2, 2 + b % 3  # assistant run, tool run, assistant run
        n = a1 + t + a2
        responses[b, :n] = rng.integers(400, 500, n)
        attn[b, P : P + n] = 1
        rmask[b, :a1] = 1
        rmask[b, a1 + t : n] = 1
        scores[b, n - 1] = float(b % 2)
    lp = np.where(rmask == 1, -rng.random((B, R)), 0).astype(np.float32)
    uid = np.array([f"prompt-{b // samples}" for b in range(B)])
    return {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": attn,
        "response_mask": rmask,
        "rollout_log_probs": lp,
        "token_level_scores": scores,
        "uid": uid,
    }


def write_verl(root: Path) -> tuple[Path, Path, dict]:
    """The same good batch as .npz and as Parquet (traj ids distinct), + bad rows in the Parquet one."""
    a = verl_arrays()
    npz = root / "batch.npz"
    np.savez(npz, **a)
    b = {k: v.copy() for k, v in a.items()}
    b["token_level_scores"] = b["token_level_scores"].copy()
    b["token_level_scores"][0, 0] = np.nan  # non-finite reward
    b["response_mask"][1, 0] = 2  # not 0/1
    b["uid"] = b["uid"].astype(object)
    b["uid"][2] = ""  # empty uid
    b["traj_id"] = np.array([f"pq-{r}" for r in range(len(b["uid"]))])
    table = pa.table({k: (list(v) if v.ndim == 1 else [list(r) for r in v]) for k, v in b.items()})
    par = root / "batch.parquet"
    pq.write_table(table, par)
    return npz, par, a
