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

Each dataset item is one exported row (`train_dataset` is built from the export). Old log-probabilities (TRL's
`old_per_token_logps`, the denominator of the importance ratio): a row whose export says its logprobs are the
behaviour policy's (`logprobs_known`, with `use_rollout_logprobs=True`, the default) uses them; any other row
(a text source: tau-bench, chat JSONL, TRL completions carry none, and the export fills them with 0) uses the
policy's own log-probabilities at the batch's first use, computed without gradient (on-policy: ratio 1 on the
first step), never the 0s: against 0 the ratio would be exp(logp), about 2e-5, clipped to a constant, and the
batch would carry no learning signal. A KL term (`beta` != 0) needs a `ref_model`; without one the trainer
refuses in one line."""

from __future__ import annotations

import warnings
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


def logprobs_known(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """(B,) which rows' `old_log_probs` are the behaviour policy's: the export's `logprobs_known`, or, in an
    export written before that array, the rows whose trained tokens are not all 0 (0-filled rows are unknown)."""
    if "logprobs_known" in arrays:
        known = np.asarray(arrays["logprobs_known"])
        if known.shape != (len(arrays["prompts"]),) or known.dtype != bool:
            raise ValueError(
                f"not a creditflow verl export: logprobs_known is {known.dtype}{list(known.shape)}, "
                f"expected bool[{len(arrays['prompts'])}]"
            )
        return known
    if "old_log_probs" not in arrays:
        return np.zeros(len(arrays["prompts"]), dtype=bool)
    trained = np.asarray(arrays["response_mask"]) != 0
    return ((np.asarray(arrays["old_log_probs"]) != 0) & trained).any(axis=1)


class CreditflowGRPOTrainer(GRPOTrainer):
    """A `GRPOTrainer` whose batches and per-token advantages come from a creditflow verl-layout export."""

    def __init__(self, *args, export, use_rollout_logprobs: bool = True, **kwargs):
        arrays = _load(export)
        for name in ("prompts", "responses", "attention_mask", "response_mask", "advantages"):
            if name not in arrays:
                raise ValueError(f"not a creditflow verl export: no {name!r} array")
        P = arrays["prompts"].shape[1]
        # a row without a prompt token: its first token is trained with nothing before it to condition on;
        # such rows are left out (said in one line), and an export of nothing else is refused
        no_prompt = ~np.any(np.asarray(arrays["attention_mask"])[:, :P], axis=1)
        rows = np.flatnonzero(~no_prompt)
        if no_prompt.any():
            r = int(np.flatnonzero(no_prompt)[0])
            name = arrays["traj_id"][r] if "traj_id" in arrays else f"row {r}"
            line = f"{int(no_prompt.sum())} of {len(no_prompt)} rows have no prompt token (first: {name})"
            if not len(rows):
                raise ValueError(f"{line}: nothing to train on (TRL scores a token from the ones before it)")
            warnings.warn(f"{line}: left out, TRL scores a token from the ones before it", stacklevel=2)
        self._cf = arrays
        known = (
            logprobs_known(arrays) if "old_log_probs" in arrays else np.zeros(len(no_prompt), dtype=np.bool_)
        )
        self._cf_known = known & bool(use_rollout_logprobs)
        kwargs.setdefault(
            "train_dataset",
            Dataset.from_dict({"prompt": [""] * len(rows), "creditflow_row": rows.tolist()}),
        )
        kwargs.setdefault("reward_funcs", [lambda completions, **_: [0.0] * len(completions)])
        super().__init__(*args, **kwargs)
        if self.beta != 0.0 and self.ref_model is None:
            raise ValueError(
                f"CreditflowGRPOTrainer: beta={self.beta} needs a reference model (ref_model); set beta=0.0"
            )

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        # transformers leaves `_signature_columns` unannotated (`= None` in Trainer.__init__), and where trl is
        # not installed (CI's gates run before the frameworks are) the base class is Any: through the instance
        # dict the code type-checks the same either way
        columns: list[str] | None = self.__dict__.get("_signature_columns")
        assert columns is not None  # the call above set it
        if "creditflow_row" not in columns:
            self.__dict__["_signature_columns"] = [*columns, "creditflow_row"]

    def _logps(self, model, out: dict) -> torch.Tensor:
        """Per-token log-probabilities of the completion tokens under `model`, without gradient."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model, ids, attn, out["completion_ids"].size(1), batch_size=len(ids)
            )
        return logps

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
        known = self._cf_known[rows]
        if known.all():  # the behaviour policy's own logprobs for every row
            out["old_per_token_logps"] = take("old_log_probs", dtype=torch.float32)
        else:  # rows without them: the policy's own, at the batch's first use (never the export's 0s)
            old = self._logps(self.model, out).float()
            if known.any():
                lp = take("old_log_probs", dtype=torch.float32)
                old = torch.where(torch.from_numpy(known).to(device)[:, None], lp, old)
            out["old_per_token_logps"] = old
        if self.beta != 0.0:
            out["ref_per_token_logps"] = self._logps(self.ref_model, out)
        return out
