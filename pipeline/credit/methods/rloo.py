"""RLOO (verl `compute_rloo_outcome_advantage`): A_i = R_i - mean_{j != i} R_j, the leave-one-out baseline,
broadcast to every assistant token. Equivalently A_i = G/(G-1) * (R_i - mean_g).

A group of size 1 has no other sample: verl leaves the score as it is (baseline 0, A = R); `singleton="zero"`
gives A = 0 instead."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from pipeline.config import StageSettings, register_settings
from pipeline.credit.context import CreditContext, CreditResult
from pipeline.credit.registry import estimator


@register_settings("rloo")
class RLOOSettings(StageSettings):
    singleton: Literal["verl", "zero"] = Field(
        "verl", description="size-1 group: verl (A = R) or zero (A = 0)"
    )


@estimator("rloo", settings="rloo")
def rloo(ctx: CreditContext, settings: RLOOSettings) -> CreditResult:
    """Leave-one-out mean baseline within the prompt group."""
    R = ctx.rewards()
    group = ctx.traj_group
    G = np.bincount(group, minlength=ctx.n_groups).astype(np.float64)[group]
    total = np.bincount(group, weights=R, minlength=ctx.n_groups)[group]
    # baseline b_i = (sum_g R - R_i) / (G - 1)
    baseline = np.divide(total - R, G - 1, out=np.zeros_like(R), where=G > 1)
    A = R - baseline
    if settings.singleton == "zero":
        A = np.where(G > 1, A, 0.0)
    a_step = ctx.traj_to_steps(A)
    return CreditResult.per_step(
        ctx,
        a_step,
        {"a_hat": a_step, "score": ctx.traj_to_steps(R)},
        notes={"singleton_groups": float(np.sum(G == 1))},
    )
