"""PPO / GAE as in verl `compute_gae_advantage_return` (spec 2.5, token PPO).

    r_t   = R_i on the last assistant token of trajectory i, 0 elsewhere (verl: the response's last valid
            token; with observation tokens masked out that is the last assistant token; no KL term here)
    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
Observation tokens are skipped: `nextvalues` and `lastgaelam` carry straight through mask-0 positions, so the
recursion runs over the trajectory's assistant tokens in order, with V = 0 after the last one.
    returns_t = A_t + V_t            (before whitening; the critic targets)
    A <- masked_whiten(A) over the batch's assistant tokens (verl default; `whiten=false` to skip)

Defaults gamma = lam = 1.0 are verl's `algorithm.gamma` / `algorithm.lam`. Critic values come from
`steps.values`; an assistant token without one is an error that names the trajectory."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from pipeline.config import StageSettings, register_settings
from pipeline.credit.context import CreditContext, CreditResult
from pipeline.credit.ops import masked_whiten, segment_discounted_cumsum
from pipeline.credit.registry import MethodError, estimator


@register_settings("gae")
class GAESettings(StageSettings):
    gamma: float = Field(1.0, description="discount gamma (verl algorithm.gamma)")
    lam: float = Field(1.0, description="GAE lambda (verl algorithm.lam)")
    whiten: bool = Field(True, description="masked_whiten the advantages over the batch (verl)")


def require_values(ctx: CreditContext, positions: np.ndarray, method: str) -> np.ndarray:
    """Critic values at the given token positions; a missing one names its trajectory."""
    V = ctx.tok_value[positions]
    missing = ~np.isfinite(V)
    if missing.any():
        traj = ctx.trajectories["traj_id"][int(ctx.tok_traj[positions[np.argmax(missing)]])]
        raise MethodError(
            f"{method}: trajectory {traj!r} has assistant tokens without critic values (steps.values); "
            f"{int(missing.sum())} such tokens in this batch"
        )
    return V


def step_mean(ctx: CreditContext, token_values: np.ndarray) -> np.ndarray:
    """Mean of a token array over each step's assistant tokens (NaN for steps without any)."""
    m = ctx.tok_mask
    step = ctx.tok_step[m]
    total = np.bincount(step, weights=token_values[m], minlength=ctx.n_steps)
    count = np.bincount(step, minlength=ctx.n_steps)
    return np.divide(total, count, out=np.full(ctx.n_steps, np.nan), where=count > 0)


@estimator("gae", settings="gae", step_columns=("values",))
def gae(ctx: CreditContext, settings: GAESettings) -> CreditResult:
    """Token-level GAE over assistant tokens; returns before whitening."""
    t = np.flatnonzero(ctx.tok_mask)  # the assistant tokens, in trajectory order
    traj = ctx.tok_traj[t]
    V = require_values(ctx, t, "gae")
    last = np.ones(len(t), dtype=bool)
    last[:-1] = traj[1:] != traj[:-1]  # last assistant token of its trajectory
    r = np.where(last, ctx.rewards()[traj], 0.0)
    V_next = np.where(last, 0.0, np.append(V[1:], 0.0))
    # delta_t = r_t + gamma V_{t+1} - V_t
    delta = r + settings.gamma * V_next - V
    # A_t = delta_t + gamma lam A_{t+1}, within the trajectory
    A = segment_discounted_cumsum(delta, traj, settings.gamma * settings.lam)
    returns = A + V
    if settings.whiten:
        A = masked_whiten(A, np.ones(len(A), dtype=bool))
    token_adv = np.zeros(ctx.n_tokens)
    token_adv[t] = A
    token_returns = np.zeros(ctx.n_tokens)
    token_returns[t] = returns
    step = ctx.tok_step[t]
    score = np.bincount(step, weights=r, minlength=ctx.n_steps)
    score = np.where(ctx.steps["is_assistant"].to_numpy(), score, np.nan)
    # = step_mean(ctx, token_adv): token_adv on the assistant tokens is A, in the same order
    count = np.bincount(step, minlength=ctx.n_steps)
    a_hat = np.divide(np.bincount(step, weights=A, minlength=ctx.n_steps), count, out=np.full(ctx.n_steps, np.nan),
                      where=count > 0)
    return CreditResult(
        token_adv=token_adv,
        components={"a_hat": a_hat, "score": score},
        token_returns=token_returns,
    )
