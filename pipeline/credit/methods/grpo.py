"""GRPO and Dr.GRPO (spec 2.1, verl reference), broadcast to every assistant token:

    (1) A_i = (R_i - mean_g) / (std_g + eps)     std unbiased; a size-1 group has mean 0, std 1 (verl)
    (2) A_i = R_i - mean_g                       Dr.GRPO (`norm_by_std=False`)

A group whose rewards are all equal gets exactly 0 (spec 7; ops.group_normalize)."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import group_normalize
from pipeline.credit.registry import estimator
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings


@register_settings("grpo")
class GRPOSettings(StageSettings):
    norm_by_std: bool = Field(True, description="divide by the group std (false = Dr.GRPO)")
    eps: float = Field(1e-6, description="added to the unbiased group std")


def grpo_traj_advantage(
    batch: CreditBatch, settings: GRPOSettings, rewards: np.ndarray | None = None
) -> np.ndarray:
    """Per-trajectory A_i; a size-1 group gives A = R (verl: mean 0, std 1)."""
    rewards = batch.rewards() if rewards is None else rewards
    # Eq. 1, or Eq. 2 without the std
    return group_normalize(rewards, batch.traj_group, eps=settings.eps, norm_by_std=settings.norm_by_std)


def _result(batch: CreditBatch, a_traj: np.ndarray, score: np.ndarray) -> CreditResult:
    a_step = batch.traj_to_steps(a_traj)
    return CreditResult.per_step(batch, a_step, {"a_hat": a_step, "score": batch.traj_to_steps(score)})


@estimator("grpo", settings="grpo", components=("a_hat", "score"))
def grpo(batch: CreditBatch, settings: GRPOSettings) -> CreditResult:
    """Group-normalised outcome reward on every assistant token."""
    rewards = batch.rewards()
    return _result(batch, grpo_traj_advantage(batch, settings, rewards), rewards)


@estimator("dr_grpo", settings="grpo", components=("a_hat", "score"))
def dr_grpo(batch: CreditBatch, settings: GRPOSettings) -> CreditResult:
    """Dr.GRPO: A_i = R_i - mean_g (no std division)."""
    rewards = batch.rewards()
    a = grpo_traj_advantage(batch, settings.model_copy(update={"norm_by_std": False}), rewards)
    return _result(batch, a, rewards)
