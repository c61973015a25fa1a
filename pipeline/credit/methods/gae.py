"""PPO / GAE as in verl `compute_gae_advantage_return` (spec 2.5, token PPO). Equations, numbered here:

    (1) r_t       = R_i on the last assistant token of trajectory i, 0 elsewhere (verl: the response's last
                    valid token; with observation tokens masked out that is the last assistant token; no KL term)
    (2) delta_t   = r_t + gamma * V_{t+1} - V_t
    (3) A_t       = delta_t + gamma * lam * A_{t+1}
    (4) returns_t = A_t + V_t            (before whitening; the critic targets)
    (5) A        <- masked_whiten(A) over the assistant tokens of the round (`scope="round"`, default) or of
                    the processing batch (`scope="batch"`); `whiten=false` skips it
Observation tokens are skipped: `nextvalues` and `lastgaelam` carry straight through mask-0 positions, so the
recursion runs over the trajectory's assistant tokens in order, with V = 0 after the last one.
Reward placement (Eq. 1) is the one rule the verl export shares (`pipeline.layouts.reward_columns` puts
`token_level_scores` there): the last assistant token, never a trailing observation token, where verl's own
GAE would drop it; tests/test_interop_export.py checks verl's GAE on the export equals this estimator's.

verl whitens over its training batch (`data.batch["advantages"] = masked_whiten(advantages, response_mask)` in
`compute_gae_advantage_return`), whatever that batch is; here the round plays that part, so the advantages do
not depend on how the round was cut into parts. Defaults gamma = lam = 1.0 are verl's `algorithm.gamma` /
`algorithm.lam`. Critic values come from `steps.values`; an assistant token without one is an error that names
the trajectory."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from pydantic import Field

from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import (
    BLOCK,
    Moments,
    moments_of_blocks,
    runs_discounted_cumsum,
    segment_bounds,
    whiten,
)
from pipeline.credit.registry import MethodError, Requirement, RoundStatistics, estimator
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings


@register_settings("gae")
class GAESettings(StageSettings):
    gamma: float = Field(1.0, description="discount gamma (verl algorithm.gamma)")
    lam: float = Field(1.0, description="GAE lambda (verl algorithm.lam)")
    whiten: bool = Field(True, description="masked_whiten the advantages (verl)")
    scope: Literal["round", "batch"] = Field(
        "round",
        description="what the whitening's mean and variance are taken over: the round (every batch) or the "
        "processing batch (batch_groups groups)",
    )


def require_values(batch: CreditBatch, positions: np.ndarray, method: str) -> np.ndarray:
    """Critic values at the given token positions (read from the steps' lists: no per-token array of the whole
    batch); a missing one names its trajectory."""
    V = batch.values.at(positions)
    check_values(batch, V, lambda i: batch.token_trajs()[positions[i]], method)
    return V


def check_values(batch: CreditBatch, V: np.ndarray, traj_row_of, method: str) -> None:
    """Raise naming the first trajectory with a missing critic value in V (`traj_row_of(i)`: V[i]'s trajectory
    row)."""
    missing = ~np.isfinite(V)
    if missing.any():
        traj = batch.trajectories["traj_id"][int(traj_row_of(int(np.argmax(missing))))]
        raise MethodError(
            f"{method}: trajectory {traj!r} has assistant tokens without critic values (steps.values); "
            f"{int(missing.sum())} such tokens in this batch"
        )


def telescoped(settings: GAESettings) -> bool:
    """gamma = lam = 1 (the defaults): A_t = R - V_t on each trajectory's assistant tokens (Eq. 1-3
    telescoped), so A's moments over a step's tokens are R - the mean of its values and the values' own m2: the
    statistics pass reads the steps' value moments (`values_mean`, `values_m2`, schemas.steps), not the values."""
    return float(settings.gamma) == 1.0 and float(settings.lam) == 1.0


def statistics_columns(settings: GAESettings) -> tuple[str, ...]:
    return ("values_mean", "values_m2") if telescoped(settings) else ("values",)


def gae_statistics(batch: CreditBatch, settings: GAESettings) -> dict[str, Moments]:
    """Eq. 5's moments on this batch: those of A (Eq. 1-3) over its assistant tokens (the statistics pass)."""
    if not settings.whiten:
        return {}
    if telescoped(settings) and "values_mean" in batch.step_table.column_names:
        m = telescoped_moments(batch, "gae")
        if batch.values.valid.any():  # a batch kept for credit (its values read too): Eq. 1-4 for its credit
            batch.memo[("gae", settings.gamma, settings.lam)] = gae_advantages(batch, settings, "gae")
        return {"gae": m}
    g = gae_advantages(batch, settings, "gae", moments=True)
    batch.memo[("gae", settings.gamma, settings.lam)] = g  # credit of this batch, when it is kept for credit
    return {"gae": g.moments or Moments()}


def telescoped_moments(batch: CreditBatch, key: str) -> Moments:
    """A's moments over the batch's assistant tokens at gamma = lam = 1 from its steps' value moments: on step
    s (n_s tokens, trajectory reward R_s) A = R_s - V has mean R_s - mean(V_s) and m2 = m2(V_s); the steps merge
    as Chan et al.'s parallel update does, whole-column: mean = sum n_s mean_s / n, m2 = sum m2_s + sum n_s
    (mean_s - mean)^2. A step without values (NaN) names its trajectory, as the token path does."""
    a = batch.mask_rows
    if len(a) == 0:
        return Moments()
    n_s = batch.step_tokens[a].astype(np.float64)
    vm = batch.step_floats("values_mean")[a]
    vm2 = batch.step_floats("values_m2")[a]
    bad = ~(np.isfinite(vm) & np.isfinite(vm2))
    if bad.any():
        traj = batch.trajectories["traj_id"][int(batch.step_traj[a[int(np.argmax(bad))]])]
        raise MethodError(
            f"{key}: trajectory {traj!r} has assistant tokens without critic values (steps.values); "
            f"{int(n_s[bad].sum())} such tokens in this batch"
        )
    mean_s = batch.rewards()[batch.step_traj[a]] - vm
    n = float(n_s.sum())
    mean = float(np.dot(n_s, mean_s)) / n
    dev = mean_s - mean
    return Moments(n, mean, float(vm2.sum() + np.dot(n_s, dev * dev)))


@estimator(
    "gae",
    settings="gae",
    # (the value moments: what its statistics pass reads at gamma = lam = 1; read with credit's columns, a
    # statistics pass that keeps its read for credit reads them too)
    step_columns=("values", "values_mean", "values_m2"),
    statistics=RoundStatistics(
        "gae", gae_statistics, step_columns=statistics_columns, active=lambda settings: settings.whiten
    ),
    requires=(Requirement("values", "critic values"),),
    components=("a_hat", "score"),
)
def gae(batch: CreditBatch, settings: GAESettings) -> CreditResult:
    """Token-level GAE over assistant tokens; returns before whitening."""
    return gae_credit(batch, settings, "gae")


@dataclass(frozen=True)
class GAEAdvantages:
    """Eq. 1-4 on the assistant tokens (in token order: the steps' runs laid end to end), before whitening."""

    A: np.ndarray  # advantages
    returns: np.ndarray
    a: np.ndarray  # the assistant steps with tokens (step rows)
    lengths: np.ndarray  # their token counts
    last: np.ndarray  # per assistant step: the trajectory's last one
    R: np.ndarray  # per assistant step: the trajectory's reward
    moments: Moments | None = None  # of A, when asked for (Eq. 5's statistic on this batch)


def gae_advantages(
    batch: CreditBatch,
    settings: GAESettings,
    key: str,
    rewards: np.ndarray | None = None,
    moments: bool = False,
) -> GAEAdvantages:
    """Eq. 1-4 (`rewards` replace the trajectories' R: process_reward's penalised outcome); `moments`: also A's
    moments (in the pass that writes the returns, with lam < 1).

    With lam = 1 the recursion telescopes, A_t = gamma^(T-t) R - V_t (T: the trajectory's last assistant
    token), and needs no scan; otherwise a segmented discounted cumsum over each trajectory's tokens."""
    a = batch.mask_rows  # the assistant steps with tokens: their tokens are the mask's, in order
    lengths = batch.step_tokens[a]
    traj = batch.step_traj[a]
    V = batch.values.on_mask()
    n = len(V)
    if n == 0:
        empty = np.zeros(0)
        return GAEAdvantages(empty, empty, a, lengths, np.zeros(0, dtype=bool), empty)
    if not np.isfinite(V.sum()):  # (float32 values: their sum cannot overflow) V[i]'s step: the first past i
        check_values(batch, V, lambda i: traj[np.searchsorted(np.cumsum(lengths), i, side="right")], key)
    first, last = segment_bounds(traj)  # a trajectory's first / last assistant step (with tokens)
    R = (batch.rewards() if rewards is None else rewards)[traj]  # per assistant step
    gamma, lam = float(settings.gamma), float(settings.lam)
    if lam == 1.0:
        # Eq. 1-3 telescoped: A_t = sum_s gamma^(s-t) (r_s + gamma V_{s+1} - V_s) = gamma^(T-t) R - V_t
        returns = np.repeat(R, lengths)
        if gamma != 1.0:
            run = np.cumsum(first) - 1  # the trajectory run of each assistant step
            end = np.cumsum(lengths)  # exclusive end of each assistant step's tokens
            returns *= np.power(gamma, np.repeat(end[last][run], lengths) - 1 - np.arange(n))
        A = np.subtract(returns, V, out=V)  # into V's array (on_mask's own copy, not read again)
        m = Moments.of(A) if moments else None
    else:
        traj_tokens = np.add.reduceat(lengths, np.flatnonzero(first))  # each trajectory's assistant tokens
        T = np.cumsum(traj_tokens) - 1  # the last assistant token of each trajectory
        # Eq. 2, delta_t = r_t + gamma V_{t+1} - V_t (r: R on each trajectory's last token, Eq. 1; V_{T+1} = 0):
        # gamma V_{t+1} - V_t block by block (the two passes fused), then (0 - V_T) + R at each T
        delta = np.empty(n)
        for i in range(0, n, BLOCK):
            e = min(i + BLOCK, n)
            d = delta[i:e]
            if e == n:
                d[-1] = 0.0  # (the last position is a T: set below)
                np.multiply(V[i + 1 : e], gamma, out=d[:-1])
            else:
                np.multiply(V[i + 1 : e + 1], gamma, out=d)
            d -= V[i:e]
        delta[T] = np.subtract(0.0, V[T]) + R[last]
        # Eq. 3, into delta's array (in order: the passes below run on forward, contiguous arrays)
        A = runs_discounted_cumsum(delta, traj_tokens, gamma * lam, out=delta)
        # Eq. 4, returns = A + V into V's array (on_mask's own copy, not read again), with A's moments when
        # asked for in the same read of A
        m = moments_of_blocks(A, add_to=V) if moments else None
        if m is None:
            np.add(V, A, out=V)
        returns = V
    return GAEAdvantages(A, returns, a, lengths, last, R, m)


def gae_result(batch: CreditBatch, g: GAEAdvantages, A: np.ndarray) -> CreditResult:
    """The advantages `A` (g.A whitened, or not) and g's returns on the assistant tokens, with the components."""
    score = np.where(batch.step_is_assistant, 0.0, np.nan)
    a_hat = np.full(batch.n_steps, np.nan)
    if len(A):
        score[g.a[g.last]] = g.R[g.last]
        a_hat[g.a] = (
            np.add.reduceat(A, np.cumsum(g.lengths) - g.lengths) / g.lengths
        )  # step mean of token_adv
    return CreditResult.on_mask(batch, A, {"a_hat": a_hat, "score": score}, mask_returns=g.returns)


def gae_credit(
    batch: CreditBatch, settings: GAESettings, key: str, rewards: np.ndarray | None = None
) -> CreditResult:
    """GAE on the assistant tokens only, whitened under the statistic `key` (Eq. 5); `rewards` replace the
    trajectories' R (process_reward's penalised outcome)."""
    # this batch's own moments when the whitening is taken over it (CreditBatch.moments: scope "batch", or no
    # round statistics given: the batch is the round), computed with the returns
    own = settings.whiten and (settings.scope == "batch" or batch.round_stats is None)
    kept = batch.memo.pop((key, settings.gamma, settings.lam), None) if rewards is None and not own else None
    g = (  # the statistics pass's Eq. 1-4 of this batch (kept for credit), less its own moments: not the round's
        replace(kept, moments=None)
        if isinstance(kept, GAEAdvantages)
        else gae_advantages(batch, settings, key, rewards, moments=own)
    )
    A = g.A
    if settings.whiten and len(A):
        m = g.moments if g.moments is not None else batch.moments(key, A, scope=settings.scope)
        A = whiten(A, m, out=A)  # Eq. 5, in place: g.A is this call's own array (g keeps the returns)
    return gae_result(batch, g, A)
