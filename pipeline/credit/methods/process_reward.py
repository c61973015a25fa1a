"""The "+ process reward" baseline of the C3 paper (spec 5 [INF]): the same behaviour signals as C3, injected
as rewards *before* the estimator instead of correcting credit after it.

    (1) turn level:    r_k -= beta * s_k at the last token of turn k   (gae_pr)
    (2) outcome level: R   -= beta * sum_k s_k                          (grpo_pr; gae_pr with level=outcome)

s_k is the largest severity among turn k's spans. GRPO has only an outcome reward, so grpo_pr always uses the
outcome level (the undiscounted sum of turn penalties). gae_pr reuses `gae` unwhitened and adds the penalties'
GAE contribution (GAE is linear in the rewards: A = A_base + discounted-cumsum of the token penalties, the
value terms cancel), then whitens as `gae` would (same `gae.whiten` and `gae.scope`, its own round statistic
"gae_pr"); returns get the same contribution (returns = A + V)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from pipeline.config import StageSettings, register_settings
from pipeline.credit.context import CreditContext, CreditResult
from pipeline.credit.methods.c3 import span_token_ranges
from pipeline.credit.methods.gae import gae_credit, step_mean
from pipeline.credit.methods.grpo import grpo_traj_advantage
from pipeline.credit.ops import segment_discounted_cumsum, whiten
from pipeline.credit.registry import Requirement, estimator


@register_settings("process_reward")
class ProcessRewardSettings(StageSettings):
    beta: float = Field(0.5, ge=0.0, description="penalty per unit of severity")
    level: Literal["turn", "outcome"] = Field(
        "turn", description="turn: r_k -= beta*s_k at turn k's last token (gae_pr); outcome: R -= beta*sum s"
    )


def step_severity(ctx: CreditContext) -> np.ndarray:
    """s_k per step row: the largest severity among the step's spans (0 without spans)."""
    out = np.zeros(ctx.n_steps)
    spans = ctx.annotation("spans")
    if spans is None or spans.height == 0:
        return out
    _, _, row = span_token_ranges(ctx, spans)
    sev = spans["severity"].to_numpy().astype(np.float64)
    ok = row >= 0
    np.maximum.at(out, row[ok], sev[ok])
    return out


def penalised_rewards(ctx: CreditContext, beta: float, s_step: np.ndarray) -> np.ndarray:
    """R_i - beta * sum_k s_k per trajectory."""
    penalty = np.bincount(ctx.step_traj, weights=s_step, minlength=ctx.n_traj)
    return ctx.rewards() - beta * penalty  # Eq. 2


@estimator("grpo_pr", settings="process_reward", needs=("spans",), reads=("grpo",))
def grpo_pr(ctx: CreditContext, settings: ProcessRewardSettings) -> CreditResult:
    """GRPO on the outcome reward minus beta * the summed turn severities."""
    s_step = step_severity(ctx)
    rewards = penalised_rewards(ctx, settings.beta, s_step)
    a = grpo_traj_advantage(ctx, ctx.stage("grpo"), rewards)
    has = s_step > 0
    return CreditResult.per_step(
        ctx,
        ctx.traj_to_steps(a),
        {
            "a_hat": ctx.traj_to_steps(a),
            "score": ctx.traj_to_steps(rewards),
            "severity": np.where(has, s_step, np.nan),
        },
        notes={"process_reward.penalised_turns": float(has.sum())},
    )


@estimator(
    "gae_pr",
    settings="process_reward",
    needs=("spans",),
    step_columns=("values",),
    batch_statistics="gae",
    requires=(Requirement("values", "critic values"),),
)
def gae_pr(ctx: CreditContext, settings: ProcessRewardSettings) -> CreditResult:
    """Token GAE with the behaviour penalties as turn rewards (or subtracted from the outcome reward)."""
    gs = ctx.stage("gae")
    s_step = step_severity(ctx)
    has = s_step > 0
    notes = {"process_reward.penalised_turns": float(has.sum())}
    if settings.level == "outcome":
        base = gae_credit(ctx, gs, "gae_pr", rewards=penalised_rewards(ctx, settings.beta, s_step))
        return CreditResult(
            base.token_adv,
            {**base.components, "severity": np.where(has, s_step, np.nan)},
            base.token_returns,
            notes,
        )
    raw = gae_credit(ctx, gs.model_copy(update={"whiten": False}), "gae_pr")
    t = np.flatnonzero(ctx.tok_mask)
    penalty = np.zeros(ctx.n_tokens)
    n = ctx.steps["n_tokens"].to_numpy()
    last_tok = ctx.steps["tok_start"].to_numpy() + n - 1
    rows = np.flatnonzero(has & (n > 0) & ctx.steps["is_assistant"].to_numpy())
    penalty[last_tok[rows]] = -settings.beta * s_step[rows]  # Eq. 1
    contrib = segment_discounted_cumsum(penalty[t], ctx.tok_traj[t], gs.gamma * gs.lam)
    A = raw.token_adv[t] + contrib
    assert raw.token_returns is not None  # gae_credit always returns them
    returns = raw.token_returns.copy()
    returns[t] = returns[t] + contrib
    if gs.whiten:
        A = whiten(A, ctx.moments("gae_pr", A, scope=gs.scope))
    token_adv = np.zeros(ctx.n_tokens)
    token_adv[t] = A
    score = raw.components["score"] + np.bincount(ctx.tok_step, weights=penalty, minlength=ctx.n_steps)
    return CreditResult(
        token_adv,
        {"a_hat": step_mean(ctx, token_adv), "score": score, "severity": np.where(has, s_step, np.nan)},
        returns,
        notes,
    )
