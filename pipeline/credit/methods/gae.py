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
from pipeline.credit.ops import segment_discounted_cumsum, whiten
from pipeline.credit.registry import MethodError, estimator


@register_settings("gae")
class GAESettings(StageSettings):
    gamma: float = Field(1.0, description="discount gamma (verl algorithm.gamma)")
    lam: float = Field(1.0, description="GAE lambda (verl algorithm.lam)")
    whiten: bool = Field(True, description="masked_whiten the advantages over the batch (verl)")


def require_values(ctx: CreditContext, positions: np.ndarray, method: str) -> np.ndarray:
    """Critic values at the given token positions (read from the steps' lists: no per-token array of the whole
    batch); a missing one names its trajectory."""
    V = ctx.values_at("tok_value", positions)
    check_values(ctx, V, lambda i: ctx.tok_traj[positions[i]], method)
    return V


def check_values(ctx: CreditContext, V: np.ndarray, traj_row_of, method: str) -> None:
    """Raise naming the first trajectory with a missing critic value in V (`traj_row_of(i)`: V[i]'s trajectory
    row)."""
    missing = ~np.isfinite(V)
    if missing.any():
        traj = ctx.trajectories["traj_id"][int(traj_row_of(int(np.argmax(missing))))]
        raise MethodError(
            f"{method}: trajectory {traj!r} has assistant tokens without critic values (steps.values); "
            f"{int(missing.sum())} such tokens in this batch"
        )


def step_mean(ctx: CreditContext, token_values: np.ndarray) -> np.ndarray:
    """Mean of a token array over each step's assistant tokens (NaN for steps without any)."""
    m = ctx.tok_mask
    step = ctx.tok_step[m]
    total = np.bincount(step, weights=token_values[m], minlength=ctx.n_steps)
    count = np.bincount(step, minlength=ctx.n_steps)
    return np.divide(total, count, out=np.full(ctx.n_steps, np.nan), where=count > 0)


@estimator("gae", settings="gae", step_columns=("values",))
def gae(ctx: CreditContext, settings: GAESettings) -> CreditResult:
    """Token-level GAE over assistant tokens; returns before whitening.

    Works on the assistant tokens only (in token order: the steps' runs laid end to end). With lam = 1 the
    recursion telescopes, A_t = gamma^(T-t) R - V_t (T: the trajectory's last assistant token), and needs no
    scan; otherwise a segmented discounted cumsum over each trajectory's tokens."""
    steps = ctx.steps
    n_tok = steps["n_tokens"].to_numpy()
    is_asst = steps["is_assistant"].to_numpy()
    a = np.flatnonzero(
        is_asst & (n_tok > 0)
    )  # assistant steps with tokens: their tokens are the mask's, in order
    lengths = n_tok[a]
    traj = ctx.step_traj[a]
    V = ctx.mask_values("tok_value")
    n = len(V)
    score = np.where(is_asst, 0.0, np.nan)
    a_hat = np.full(ctx.n_steps, np.nan)
    if n == 0:
        zeros = np.zeros(ctx.n_tokens)
        return CreditResult(
            token_adv=zeros, components={"a_hat": a_hat, "score": score}, token_returns=zeros.copy()
        )
    # V[i]'s assistant step: the first whose token end lies past i
    check_values(ctx, V, lambda i: traj[np.searchsorted(np.cumsum(lengths), i, side="right")], "gae")
    first = np.ones(len(a), dtype=bool)
    first[1:] = traj[1:] != traj[:-1]
    last = np.ones(len(a), dtype=bool)  # the trajectory's last assistant step (with tokens)
    last[:-1] = first[1:]
    run = np.cumsum(first) - 1  # the trajectory run of each assistant step
    end = np.cumsum(lengths)  # exclusive end of each assistant step's tokens
    R = ctx.rewards()[traj]  # per assistant step
    gamma, lam = float(settings.gamma), float(settings.lam)
    if lam == 1.0:
        # A_t = sum_s gamma^(s-t) (r_s + gamma V_{s+1} - V_s) = gamma^(T-t) R - V_t, since V_{T+1} = 0
        returns = np.repeat(R, lengths)
        if gamma != 1.0:
            returns *= np.power(gamma, np.repeat(end[last][run], lengths) - 1 - np.arange(n))
        A = returns - V
    else:
        T = end[last] - 1  # the last assistant token of each trajectory
        r = np.zeros(n)
        r[T] = R[last]
        V_next = np.empty(n)
        V_next[:-1] = V[1:]
        V_next[T] = 0.0
        delta = r + gamma * V_next - V  # delta_t = r_t + gamma V_{t+1} - V_t
        A = segment_discounted_cumsum(
            delta, np.repeat(run, lengths), gamma * lam
        )  # A_t = delta_t + gamma lam A_{t+1}
        returns = A + V
    if settings.whiten:
        A = whiten(A)
    token_adv = np.zeros(ctx.n_tokens)
    token_adv[ctx.tok_mask] = A
    token_returns = np.zeros(ctx.n_tokens)
    token_returns[ctx.tok_mask] = returns
    score[a[last]] = R[last]
    a_hat[a] = np.add.reduceat(A, end - lengths) / lengths  # = step mean of token_adv
    return CreditResult(
        token_adv=token_adv, components={"a_hat": a_hat, "score": score}, token_returns=token_returns
    )
