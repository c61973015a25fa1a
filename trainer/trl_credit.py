"""Train a TRL `GRPOTrainer` step on creditflow's per-token advantages (TRL 1.16).

TRL computes its own advantages inside `_generate_and_score_completions` (generate, score with the reward
functions, normalise per group: one scalar per completion). `CreditflowGRPOTrainer` replaces that method: a
training batch is read from a creditflow export (`creditflow export --layout verl`, the same file verl reads),
and the per-token advantages go to TRL's loss as they are: `GRPOTrainer._compute_loss` takes advantages of
shape (B, T) as well as (B,). The export's loss mask (assistant tokens only) is TRL's `tool_mask`, so tool and
user tokens inside a multi-turn response carry no loss, as in TRL's own tool loop.

    trainer = CreditflowGRPOTrainer(
        model=model, processing_class=tokenizer, args=GRPOConfig(...), export="advantages.npz"
    )
    trainer.train()

Each dataset item is one exported row (`train_dataset` is built from the export); with
`use_rollout_logprobs=True` (default) the export's behaviour logprobs are TRL's `old_per_token_logps` (the
importance ratio is taken against the policy that sampled the tokens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from trl import GRPOTrainer


def _load(export) -> dict[str, np.ndarray]:
    if isinstance(export, dict):
        return export
    with np.load(Path(export), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


class CreditflowGRPOTrainer(GRPOTrainer):
    """A `GRPOTrainer` whose batches and per-token advantages come from a creditflow verl-layout export."""

    def __init__(self, *args, export, use_rollout_logprobs: bool = True, **kwargs):
        arrays = _load(export)
        for name in ("prompts", "responses", "attention_mask", "response_mask", "advantages"):
            if name not in arrays:
                raise ValueError(f"not a creditflow verl export: no {name!r} array")
        self._cf = arrays
        self._cf_logprobs = use_rollout_logprobs and "old_log_probs" in arrays
        n = len(arrays["prompts"])
        kwargs.setdefault(
            "train_dataset", Dataset.from_dict({"prompt": [""] * n, "creditflow_row": list(range(n))})
        )
        kwargs.setdefault("reward_funcs", [lambda completions, **_: [0.0] * len(completions)])
        super().__init__(*args, **kwargs)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "creditflow_row" not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, "creditflow_row"]

    def _generate_and_score_completions(self, inputs):
        rows = np.asarray([x["creditflow_row"] for x in inputs], dtype=np.int64)
        a = self._cf
        P = a["prompts"].shape[1]
        device = self.accelerator.device

        def take(name, cols=slice(None), dtype=None):
            t = torch.from_numpy(np.ascontiguousarray(a[name][rows][:, cols]))
            return (t if dtype is None else t.to(dtype)).to(device)

        completion_mask = take("attention_mask", slice(P, None), torch.long)
        loss_mask = take("response_mask", dtype=torch.long)
        out = {
            "prompt_ids": take("prompts", dtype=torch.long),
            "prompt_mask": take("attention_mask", slice(0, P), torch.long),
            "completion_ids": take("responses", dtype=torch.long),
            "completion_mask": completion_mask,
            "tool_mask": loss_mask,  # TRL's loss mask for tokens the policy did not sample
            "advantages": take("advantages", dtype=torch.float32),
            "num_items_in_batch": (completion_mask * loss_mask).sum(),
        }
        if self._cf_logprobs:
            out["old_per_token_logps"] = take("old_log_probs", dtype=torch.float32)
        return out
