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

from pipeline.credit.batch import CreditBatch
from pipeline.credit.methods.c3 import span_token_ranges
from pipeline.credit.methods.gae import GAEAdvantages, GAESettings, gae_advantages, gae_result
from pipeline.credit.methods.grpo import GRPOSettings, grpo_traj_advantage
from pipeline.credit.ops import Moments, segment_discounted_cumsum, whiten
from pipeline.credit.registry import Requirement, RoundStatistics, estimator
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings


@register_settings("process_reward")
class ProcessRewardSettings(StageSettings):
    beta: float = Field(0.5, ge=0.0, description="penalty per unit of severity")
    level: Literal["turn", "outcome"] = Field(
        "turn", description="turn: r_k -= beta*s_k at turn k's last token (gae_pr); outcome: R -= beta*sum s"
    )


def step_severity(batch: CreditBatch) -> np.ndarray:
    """s_k per step row: the largest severity among the step's spans (0 without spans)."""
    out = np.zeros(batch.n_steps)
    spans = batch.annotation("spans")
    if spans is None or spans.height == 0:
        return out
    _, _, row = span_token_ranges(batch, spans)
    sev = spans["severity"].to_numpy().astype(np.float64)
    ok = row >= 0
    np.maximum.at(out, row[ok], sev[ok])
    return out


def penalised_rewards(batch: CreditBatch, beta: float, s_step: np.ndarray) -> np.ndarray:
    """R_i - beta * sum_k s_k per trajectory."""
    penalty = np.bincount(batch.step_traj, weights=s_step, minlength=batch.n_traj)
    return batch.rewards() - beta * penalty  # Eq. 2


@estimator(
    "grpo_pr",
    settings="process_reward",
    needs=("spans",),
    reads=("grpo",),
    components=("a_hat", "score", "severity"),
)
def grpo_pr(batch: CreditBatch, settings: ProcessRewardSettings) -> CreditResult:
    """GRPO on the outcome reward minus beta * the summed turn severities."""
    s_step = step_severity(batch)
    rewards = penalised_rewards(batch, settings.beta, s_step)
    a = grpo_traj_advantage(batch, batch.settings(GRPOSettings), rewards)
    has = s_step > 0
    return CreditResult.per_step(
        batch,
        batch.traj_to_steps(a),
        {
            "a_hat": batch.traj_to_steps(a),
            "score": batch.traj_to_steps(rewards),
            "severity": np.where(has, s_step, np.nan),
        },
        notes={"process_reward.penalised_turns": float(has.sum())},
    )


def gae_pr_advantages(
    batch: CreditBatch, settings: ProcessRewardSettings
) -> tuple[GAEAdvantages, np.ndarray]:
    """gae_pr before whitening: GAE's Eq. 1-4 on the assistant tokens with the penalties of Eq. 1 or 2, and
    s_k per step row."""
    gs = batch.settings(GAESettings)
    s_step = step_severity(batch)
    if settings.level == "outcome":
        rewards = penalised_rewards(batch, settings.beta, s_step)
        return gae_advantages(batch, gs, "gae_pr", rewards=rewards), s_step
    g = gae_advantages(batch, gs, "gae_pr")
    n = batch.step_tokens
    rows = np.flatnonzero((s_step > 0) & (n > 0) & batch.step_is_assistant)
    if len(rows) == 0 or len(g.A) == 0:
        return g, s_step
    # Eq. 1: -beta * s_k on the last token of turn k; on the assistant tokens (the mask's order) that is the
    # last token of assistant step k among them (GAE is linear in the rewards: A = A_base + the discounted
    # cumsum of the penalties, the value terms cancel; returns = A + V get the same)
    end_in_mask = np.cumsum(g.lengths) - 1  # per assistant step with tokens
    penalty = np.zeros(len(g.A))
    penalty[end_in_mask[np.searchsorted(g.a, rows)]] = -settings.beta * s_step[rows]
    traj = np.repeat(batch.step_traj[g.a], g.lengths)
    contrib = segment_discounted_cumsum(penalty, traj, gs.gamma * gs.lam)
    return (
        GAEAdvantages(g.A + contrib, g.returns + contrib, g.a, g.lengths, g.last, g.R),
        s_step,
    )


def gae_pr_statistics(batch: CreditBatch, settings: ProcessRewardSettings) -> dict[str, Moments]:
    """The moments gae_pr whitens with (`gae.whiten`), on this batch: those of its A over the assistant tokens."""
    if not batch.settings(GAESettings).whiten:
        return {}
    return {"gae_pr": Moments.of(gae_pr_advantages(batch, settings)[0].A)}


@estimator(
    "gae_pr",
    settings="process_reward",
    needs=("spans",),
    step_columns=("values",),
    statistics=RoundStatistics(
        "gae", gae_pr_statistics, step_columns=("values",), active=lambda settings: settings.whiten
    ),
    requires=(Requirement("values", "critic values"),),
    components=("a_hat", "score", "severity"),
    reads=("gae",),
)
def gae_pr(batch: CreditBatch, settings: ProcessRewardSettings) -> CreditResult:
    """Token GAE with the behaviour penalties as turn rewards (or subtracted from the outcome reward)."""
    gs = batch.settings(GAESettings)
    g, s_step = gae_pr_advantages(batch, settings)
    has = s_step > 0
    A = g.A
    if gs.whiten and len(A):
        A = whiten(A, batch.moments("gae_pr", A, scope=gs.scope))
    res = gae_result(batch, g, A)
    score = res.components["score"]
    if settings.level == "turn" and len(g.A):  # the turn penalties on the steps' scores
        rows = np.flatnonzero(has & (batch.step_tokens > 0) & batch.step_is_assistant)
        score = score.copy()
        score[rows] += -settings.beta * s_step[rows]
    return CreditResult.on_mask(
        batch,
        A,
        {"a_hat": res.components["a_hat"], "score": score, "severity": np.where(has, s_step, np.nan)},
        {"process_reward.penalised_turns": float(has.sum())},
        g.returns,
    )
