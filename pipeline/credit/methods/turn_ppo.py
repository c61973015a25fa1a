"""Turn-level PPO (spec 2.5; Li et al. 2512.17008, from summaries): one state per assistant turn.

    (1) V(s_h)   = the critic value at the turn's first assistant token (the state: history up to the turn)
    (2) r_h      = R_i on the trajectory's last turn (`turn_reward="outcome"`), or the turn's verifier score
                   (`"verifier_score"`, null -> 0)
    (3) delta_h  = r_h + gamma V(s_{h+1}) - V(s_h),   V(s_{H+1}) = 0
    (4) A_h      = sum_l (gamma lam)^l delta_{h+l},   broadcast to the turn's tokens
    (5) returns_h = A_h + V(s_h)
    (6) A       <- masked_whiten over the assistant tokens (as token PPO) of the round (`scope="round"`) or
                   of the processing batch (`scope="batch"`); `whiten=false` skips it

A turn with no tokens has no state and is skipped (its verifier score is dropped; an outcome reward moves
to the last turn that has tokens)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from pipeline.credit.batch import CreditBatch
from pipeline.credit.methods.gae import require_values
from pipeline.credit.ops import Moments, segment_bounds, segment_discounted_cumsum, whiten
from pipeline.credit.registry import Requirement, RoundStatistics, estimator
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings


@register_settings("turn_ppo")
class TurnPPOSettings(StageSettings):
    gamma: float = Field(0.99, description="turn discount gamma (paper: about 0.99)")
    lam: float = Field(0.9, description="turn GAE lambda (paper: about 0.9)")
    turn_reward: Literal["outcome", "verifier_score"] = Field(
        "outcome", description="r_h: outcome R on the last turn, or each turn's verifier score"
    )
    whiten: bool = Field(True, description="masked_whiten the token advantages")
    scope: Literal["round", "batch"] = Field(
        "round",
        description="what the whitening is taken over: the round (every batch) or the processing batch",
    )


def turn_advantages(batch: CreditBatch, settings: TurnPPOSettings):
    """Eq. 1-4 on the states (assistant steps with tokens): (state step rows h, V, r, A_h)."""
    h = batch.mask_rows  # the states
    traj = batch.step_traj[h]
    V = require_values(batch, batch.step_starts[h], "turn_ppo")  # Eq. 1
    _, last = segment_bounds(traj)
    if settings.turn_reward == "outcome":  # Eq. 2
        r = np.where(last, batch.rewards()[traj], 0.0)
    else:
        score = batch.step_floats("verifier_score")[h]
        r = np.where(np.isnan(score), 0.0, score)
    V_next = np.where(last, 0.0, np.append(V[1:], 0.0))
    delta = r + settings.gamma * V_next - V  # Eq. 3
    return h, V, r, segment_discounted_cumsum(delta, traj, settings.gamma * settings.lam)  # Eq. 4


def turn_ppo_statistics(batch: CreditBatch, settings: TurnPPOSettings) -> dict[str, Moments]:
    """Eq. 6's moments on this batch: A_h over the states, each weighted by its token count."""
    if not settings.whiten:
        return {}
    h, _, _, A_turn = turn_advantages(batch, settings)
    return {"turn_ppo": Moments.of(A_turn, batch.step_tokens[h])}


@estimator(
    "turn_ppo",
    settings="turn_ppo",
    step_columns=("values",),
    # the values at the turns' first tokens (and turn_reward="verifier_score" reads the steps' scores)
    statistics=RoundStatistics(
        "turn_ppo",
        turn_ppo_statistics,
        step_columns=("values", "verifier_score"),
        active=lambda settings: settings.whiten,
    ),
    requires=(Requirement("values", "critic values"),),
    components=("a_hat", "score"),
)
def turn_ppo(batch: CreditBatch, settings: TurnPPOSettings) -> CreditResult:
    """GAE over turns, one value per turn."""
    h, V, r, A_turn = turn_advantages(batch, settings)
    A_out = A_turn
    if settings.whiten:
        # Eq. 6: masked_whiten over the assistant tokens, where each turn's n_h tokens share A_h: the turns
        # weighted by their token counts (no per-token pass)
        n_h = batch.step_tokens[h]
        A_out = whiten(A_turn, batch.moments("turn_ppo", A_turn, n_h, scope=settings.scope))
    per_step_A = np.zeros(batch.n_steps)
    per_step_A[h] = A_out
    per_step_ret = np.zeros(batch.n_steps)
    per_step_ret[h] = A_turn + V  # Eq. 5
    a_hat = np.full(batch.n_steps, np.nan)
    a_hat[h] = A_out
    score = np.full(batch.n_steps, np.nan)
    score[h] = r
    return CreditResult.per_step(
        batch, per_step_A, {"a_hat": a_hat, "score": score}, step_returns=per_step_ret
    )
