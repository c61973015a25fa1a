"""creditflow's advantages for an OpenRLHF or SkyRL training batch, matched by sample key (a hash of the prompt
and response token ids, `pipeline.layouts.sample_key`), whatever the batch's order, ids or padding. verl has its
own hook (`trainer.verl_credit`), TRL a trainer subclass (`trainer.trl_credit`).

    F = np.load("adv.npz")   # creditflow export --layout openrlhf (or skyrl)
    # OpenRLHF 0.11, after RemoteExperienceMaker.compute_advantages_and_returns, per Experience:
    exp.advantages, found = openrlhf_advantages(F, exp.sequences, exp.attention_mask, exp.action_mask)
    # SkyRL 0.3, on the generator output, before the policy update:
    batch["advantages"], found = skyrl_advantages(F, prompt_token_ids, response_ids)

Rows the export lacks get zeros and `found` False (keep the framework's own there, or stop)."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.layouts import sample_key


def _rows(export, keys: list[str]) -> np.ndarray:
    row_of = {str(k): i for i, k in enumerate(export["key"])}
    return np.array([row_of.get(k, -1) for k in keys], dtype=np.int64)


def openrlhf_advantages(export, sequences, attention_mask, action_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T-1) advantages on OpenRLHF's action positions (right-padded whole sequences; action j is token
    j + 1), float32 on the batch's device, and which rows were found."""
    seq, attn, act = (x.detach().cpu().numpy() for x in (sequences, attention_mask, action_mask))
    keys = []
    for i in range(len(seq)):
        ids = seq[i][attn[i] != 0]
        on = np.flatnonzero(act[i])
        p = int(on[0]) + 1 if len(on) else len(ids)  # the prompt: tokens before the first action token
        keys.append(sample_key(ids[:p], ids[p:]))
    rows = _rows(export, keys)
    found = rows >= 0
    width = act.shape[1]
    out = np.zeros((len(seq), width), dtype=np.float32)
    adv = export["advantages"]
    k = min(width, adv.shape[1])
    out[found, :k] = adv[rows[found], :k]
    return torch.from_numpy(out).to(sequences.device), torch.from_numpy(found)


def skyrl_advantages(export, prompts: list[list[int]], responses: list[list[int]]):
    """(B, max response length) advantages right-aligned as SkyRL's convert_prompts_responses_to_batch_tensors
    lays out response tensors, float32, and which rows were found."""
    rows = _rows(export, [sample_key(p, r) for p, r in zip(prompts, responses, strict=True)])
    found = rows >= 0
    R = max((len(r) for r in responses), default=0)
    out = np.zeros((len(responses), R), dtype=np.float32)
    adv = export["advantages"]
    W = adv.shape[1]
    for i in np.flatnonzero(found):  # one row copy per sample (right-aligned in both)
        n = len(responses[i])
        out[i, R - n :] = adv[rows[i], W - n :]
    return torch.from_numpy(out), torch.from_numpy(found)
