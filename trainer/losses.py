"""Policy-gradient losses on token tensors (verl conventions), small pure functions of torch tensors.

All tensors are [batch, seq]; `mask` is 1 on tokens that are trained (assistant tokens)."""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    norm_tokens: float | None = None,
    norm_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss. `norm_tokens`/`norm_seqs` are the mini-batch totals when a micro-batch is
    one slice of a larger mini-batch (gradient accumulation), so the accumulated gradient equals the
    gradient of the whole mini-batch's loss."""
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        denom = norm_tokens if norm_tokens is not None else mask.sum().clamp(min=1.0)
        return (loss * mask).sum() / denom
    if mode == "seq-mean-token-sum":
        per_seq = (loss * mask).sum(dim=-1)
    elif mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; one of {AGG_MODES}")
    seqs_with_tokens = (mask.sum(dim=-1) > 0).to(loss.dtype)
    denom = norm_seqs if norm_seqs is not None else seqs_with_tokens.sum().clamp(min=1.0)
    return (per_seq * seqs_with_tokens).sum() / denom


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_tokens: float | None = None,
    norm_seqs: float | None = None,
):
    """Token-level clipped surrogate. Returns (loss, clip_fraction, approx_kl)."""
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    if dual_clip is not None:  # Dual-clip PPO: bound the loss of negative-advantage tokens with huge ratios
        loss3 = -adv * dual_clip
        clipped = torch.where(adv < 0, torch.minimum(loss3, clipped), clipped)
    loss = aggregate(clipped, mask, agg, norm_tokens, norm_seqs)
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1.0)
    clip_frac = ((loss2 > loss1).to(logp.dtype) * m).sum() / n
    approx_kl = (0.5 * (log_ratio**2) * m).sum() / n
    return loss, clip_frac.detach(), approx_kl.detach()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate to the reference policy (k1 'kl', k3 'low_var_kl', 'mse')."""
    if kind == "kl":
        return logp - ref_logp
    if kind == "mse":
        return 0.5 * (logp - ref_logp) ** 2
    if kind == "low_var_kl":
        kl = (ref_logp - logp).clamp(-20.0, 20.0)
        return (torch.exp(kl) - kl - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl kind {kind!r}")


def value_loss(
    vpred: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_value: float = 0.5,
    agg: str = "token-mean",
    norm_tokens: float | None = None,
    norm_seqs: float | None = None,
) -> torch.Tensor:
    """Clipped value loss (PPO): 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2)."""
    v_clipped = old_values + (vpred - old_values).clamp(-clip_value, clip_value)
    loss = 0.5 * torch.maximum((vpred - returns) ** 2, (v_clipped - returns) ** 2)
    return aggregate(loss, mask, agg, norm_tokens, norm_seqs)


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor):
    """Log-prob of each token given its prefix, aligned with input_ids (position 0 gets 0), and the entropy
    of the predictive distribution at the same positions."""
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pad = torch.zeros(logp.shape[0], 1, dtype=logp.dtype, device=logp.device)
    return torch.cat([pad, logp], dim=1), torch.cat([pad, entropy], dim=1)
