"""GRPO and Dr.GRPO (spec 2.1, verl reference), broadcast to every assistant token:

    (1) A_i = (R_i - mean_g) / (std_g + eps)     std unbiased; a size-1 group has mean 0, std 1 (verl)
    (2) A_i = R_i - mean_g                       Dr.GRPO (`norm_by_std=False`)

A group whose rewards are all equal gets exactly 0 (spec 7; ops.group_normalize)."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from pipeline.credit.context import CreditContext, CreditResult
from pipeline.credit.ops import group_normalize
from pipeline.credit.registry import estimator
from pipeline.settings import StageSettings, register_settings


@register_settings("grpo")
class GRPOSettings(StageSettings):
    norm_by_std: bool = Field(True, description="divide by the group std (false = Dr.GRPO)")
    eps: float = Field(1e-6, description="added to the unbiased group std")


def grpo_traj_advantage(
    ctx: CreditContext, settings: GRPOSettings, rewards: np.ndarray | None = None
) -> np.ndarray:
    """Per-trajectory A_i; a size-1 group gives A = R (verl: mean 0, std 1)."""
    rewards = ctx.rewards() if rewards is None else rewards
    # Eq. 1, or Eq. 2 without the std
    return group_normalize(rewards, ctx.traj_group, eps=settings.eps, norm_by_std=settings.norm_by_std)


def _result(ctx: CreditContext, a_traj: np.ndarray, score: np.ndarray) -> CreditResult:
    a_step = ctx.traj_to_steps(a_traj)
    return CreditResult.per_step(ctx, a_step, {"a_hat": a_step, "score": ctx.traj_to_steps(score)})


@estimator("grpo", settings="grpo", components=("a_hat", "score"))
def grpo(ctx: CreditContext, settings: GRPOSettings) -> CreditResult:
    """Group-normalised outcome reward on every assistant token."""
    rewards = ctx.rewards()
    return _result(ctx, grpo_traj_advantage(ctx, settings, rewards), rewards)


@estimator("dr_grpo", settings="grpo", components=("a_hat", "score"))
def dr_grpo(ctx: CreditContext, settings: GRPOSettings) -> CreditResult:
    """Dr.GRPO: A_i = R_i - mean_g (no std division)."""
    rewards = ctx.rewards()
    a = grpo_traj_advantage(ctx, settings.model_copy(update={"norm_by_std": False}), rewards)
    return _result(ctx, a, rewards)
