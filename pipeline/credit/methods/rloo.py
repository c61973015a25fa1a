"""RLOO (verl `compute_rloo_outcome_advantage`), broadcast to every assistant token:

    (1) A_i = R_i - mean_{j != i} R_j   (the leave-one-out baseline)  =  G/(G-1) * (R_i - mean_g)

so a constant group gives exactly 0 (the group mean is shifted, ops.group_moments).

A group of size 1 has no other sample: verl leaves the score as it is (baseline 0, A = R); `singleton="zero"`
gives A = 0 instead."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import group_moments
from pipeline.credit.registry import estimator
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings


@register_settings("rloo")
class RLOOSettings(StageSettings):
    singleton: Literal["verl", "zero"] = Field(
        "verl", description="size-1 group: verl (A = R) or zero (A = 0)"
    )


@estimator("rloo", settings="rloo", components=("a_hat", "score"))
def rloo(batch: CreditBatch, settings: RLOOSettings) -> CreditResult:
    """Leave-one-out mean baseline within the prompt group."""
    R = batch.rewards()
    mean, _, G = group_moments(R, batch.traj_group, batch.n_groups)
    A = np.where(G > 1, (R - mean) * G / np.maximum(G - 1, 1), R)  # Eq. 1; size 1: baseline 0 (verl)
    if settings.singleton == "zero":
        A = np.where(G > 1, A, 0.0)
    a_step = batch.traj_to_steps(A)
    return CreditResult.per_step(
        batch,
        a_step,
        {"a_hat": a_step, "score": batch.traj_to_steps(R)},
        notes={"singleton_groups": float(np.sum(G == 1))},
    )
