"""MT-GRPO (spec 2.3; Zeng et al. 2025, code default `advantage_est="aae"`).

Turn reward R^T and outcome R^O are each group-normalised,
  (1) Â = (R - mean_g)/(std_g + eps)   (std unbiased, eps 1e-4; a size-1 group gives Â = R, verl)
  aae:   (2) tokens before the trajectory's first tool-result message get Â^O + λ·Â^T, later tokens get Â^O;
         (3) a trajectory with no tool result gets Â^{T+O} = Norm(R^T + R^O) on every token.
  cae:   (4) tokens before the first tool result get Norm(R^T + γ·R^O), later tokens Â^O;
         no tool result: Norm(R^T + γ·R^O) on every token.
  kturn: (5) [INF] TCPO's K-turn verifier setting: A_{i,k} = Â^O_i + λ·Â^T_{i,k}, R^T_{i,k} the verifier score
         of turn k, normalised per (prompt, k) over the trajectories that have a turn k.

R^T (aae/cae) comes from `turn_reward`: `verifier_score` (turn 1's steps.verifier_score), `tool_ok` (1 if the
first tool result has is_error = false, else 0), or `component:<name>` (trajectories.reward_components).
A missing turn reward counts as 0 (counted in the notes)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import polars as pl
import pyarrow.compute as pc
from pydantic import Field

from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import group_normalize, segment_start_rows
from pipeline.credit.registry import MethodError, estimator
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings


@register_settings("mt_grpo")
class MTGRPOSettings(StageSettings):
    mode: Literal["aae", "cae", "kturn"] = Field(
        "aae", description="aae | cae | kturn ([INF] K-turn verifier)"
    )
    turn_advantage_coef: float = Field(1.0, description="λ, weight of the turn advantage")
    cae_gamma: float = Field(1.0, description="γ in the cae combined reward R^T + γ R^O")
    turn_reward: str = Field(
        "verifier_score", description="R^T source (aae/cae): verifier_score | tool_ok | component:<name>"
    )
    eps: float = Field(1e-4, description="added to the unbiased group std (MT-GRPO code)")


def turn_reward(batch: CreditBatch, source: str) -> tuple[np.ndarray, int]:
    """Per-trajectory R^T for aae/cae and the number of trajectories where it was missing (-> 0)."""
    if source in ("verifier_score", "tool_ok"):
        # the trajectory's first assistant step's score, or whether its first tool step is no error: the first
        # such row of each trajectory (the rows are in trajectory order), whole-column
        if source == "verifier_score":
            rows = np.flatnonzero(batch.step_is_assistant)
        else:
            rows = np.flatnonzero(batch.role_mask("tool"))
        keys, first = np.unique(batch.step_traj[rows], return_index=True)
        if source == "verifier_score":
            vals = batch.step_floats("verifier_score")[rows[first]]
        else:
            vals = (~batch.step_flags("is_error")[rows[first]]).astype(np.float64)
    elif source.startswith("component:"):
        name = source.split(":", 1)[1]
        long = (
            batch.trajectories.select("traj_index", "reward_components")
            .explode("reward_components")
            .unnest("reward_components")
            .filter(pl.col("key") == name)
            if "reward_components" in batch.trajectories.columns
            else pl.DataFrame(
                {"traj_index": [], "value": []}, schema={"traj_index": pl.Int64, "value": pl.Float64}
            )
        )
        keys, vals = long["traj_index"].to_numpy(), long["value"].to_numpy()
    else:
        raise MethodError(
            f"mt_grpo: unknown turn_reward {source!r} (verifier_score | tool_ok | component:<name>)"
        )
    R_T = np.full(batch.n_traj, np.nan)
    R_T[keys.astype(np.int64)] = np.asarray(vals, dtype=np.float64)
    missing = int(np.isnan(R_T).sum())
    return np.nan_to_num(R_T, nan=0.0), missing


@estimator("mt_grpo", settings="mt_grpo", components=("a_hat", "score", "a_step"))
def mt_grpo(batch: CreditBatch, settings: MTGRPOSettings) -> CreditResult:
    """Outcome advantage plus a turn-level advantage on the first turn (or on every turn, kturn)."""
    g, lam, eps = batch.traj_group, settings.turn_advantage_coef, settings.eps
    is_asst = batch.step_is_assistant
    R_O = batch.rewards()
    A_O = group_normalize(R_O, g, eps=eps)  # Eq. 1: Â^O
    if settings.mode == "kturn":
        # Â^T_{i,k}: verifier score of turn k, normalised per (prompt, k)
        rows = np.flatnonzero(is_asst)
        turn = pc.fill_null(batch.step_table.column("turn"), 0).to_numpy()[rows].astype(np.int64)
        _, key = np.unique(
            batch.traj_group[batch.step_traj[rows]] * (turn.max(initial=0) + 1) + turn, return_inverse=True
        )
        r = batch.step_floats("verifier_score")[rows]
        missing = int(np.isnan(r).sum())
        R_T_step = np.full(batch.n_steps, np.nan)
        R_T_step[rows] = np.nan_to_num(r, nan=0.0)
        A_T_step = np.full(batch.n_steps, np.nan)
        A_T_step[rows] = group_normalize(R_T_step[rows], key.reshape(-1), eps=eps)  # Eq. 1 per (x, k)
        per_step = batch.traj_to_steps(A_O) + lam * np.nan_to_num(A_T_step)  # Eq. 5
        return _result(batch, per_step, R_T_step, A_T_step, missing)

    R_T, missing = turn_reward(batch, settings.turn_reward)
    # tokens before the first tool-result message
    is_tool = batch.role_mask("tool")
    tools_before = np.cumsum(is_tool) - is_tool  # tool results before each step, over the whole batch
    tools_so_far = np.cumsum(is_tool) - tools_before[segment_start_rows(batch.step_traj)]
    before_tool = tools_so_far == 0
    has_tool = np.bincount(batch.step_traj[is_tool], minlength=batch.n_traj) > 0
    A_T = group_normalize(R_T, g, eps=eps)  # Eq. 1: Â^T
    if settings.mode == "aae":
        first = A_O + lam * A_T  # Eq. 2: Â^O + λ Â^T
        no_tool = group_normalize(R_T + R_O, g, eps=eps)  # Eq. 3: Â^{T+O}
    else:  # cae
        first = group_normalize(R_T + settings.cae_gamma * R_O, g, eps=eps)  # Eq. 4
        no_tool = first
    per_traj_first = np.where(has_tool, first, no_tool)
    per_traj_later = np.where(has_tool, A_O, no_tool)
    per_step = np.where(before_tool, batch.traj_to_steps(per_traj_first), batch.traj_to_steps(per_traj_later))
    turn_term = np.where(before_tool & is_asst & has_tool[batch.step_traj], batch.traj_to_steps(A_T), np.nan)
    return _result(batch, per_step, np.where(is_asst, batch.traj_to_steps(R_T), np.nan), turn_term, missing)


def _result(batch, per_step, score, turn_term, missing) -> CreditResult:
    is_asst = batch.step_is_assistant
    return CreditResult.per_step(
        batch,
        per_step,
        {"a_hat": np.where(is_asst, per_step, np.nan), "score": score, "a_step": turn_term},
        notes={"missing_turn_reward": float(missing)},
    )
