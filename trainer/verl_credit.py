"""creditflow's advantages inside a live verl run (verl 0.9 `RayPPOTrainer.fit`).

`fit()` gives every sample a fresh `uid` (uuid4) each step and pads responses to `rollout.response_length`, so
an export cannot be matched by uid or by shape. It is matched by `key`: a hash of the sample's real prompt and
response token ids (`pipeline.layouts.sample_key`), which the export stores per row and which this module
computes from the batch (`prompts`, `responses`, `attention_mask`); a row the export cut to the run's
`--response-length` is also found by the hash of its cut tokens (what verl's rollout holds). The advantages
are then padded or cut to the batch's response length.

Use (in the process that runs `fit()`, i.e. verl's `TaskRunner`, before `trainer.fit()`):

    from trainer.verl_credit import install
    install("advantages.npz")   # creditflow export --layout verl

`install` wraps `verl.trainer.ppo.ray_trainer.compute_advantage` (and the name in every loaded module that
imported it, e.g. verl's separation trainer): verl's own estimator runs first (it also
fills `returns` for the critic), then the rows found in the export get creditflow's advantages. Rows the export
lacks keep verl's (`missing="keep"`) or stop the run (`missing="error"`). No verl import at module level: the
module imports with or without verl installed."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np

from pipeline.layouts import sample_key

log = logging.getLogger(__name__)


class CreditflowAdvantages:
    """An export (`creditflow export --layout verl`) indexed by sample key."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        for name in ("key", "advantages", "responses", "attention_mask"):
            if name not in arrays:
                raise ValueError(f"not a creditflow verl export: no {name!r} array")
        self.keys = [str(k) for k in arrays["key"]]
        self.row_of = {k: i for i, k in enumerate(self.keys)}
        if "prompts" in arrays and "responses" in arrays:
            # a row cut to the run's response_length: the live batch holds the cut tokens, so it is also
            # found by the key of its tokens as laid out (`key` hashes the whole, uncut sample)
            laid_out = self.batch_keys(
                np.asarray(arrays["prompts"]),
                np.asarray(arrays["responses"]),
                np.asarray(arrays["attention_mask"]),
            )
            for i, k in enumerate(laid_out):
                self.row_of.setdefault(k, i)
        self.advantages = np.asarray(arrays["advantages"], dtype=np.float32)
        R = self.advantages.shape[1]
        self.n_resp = np.asarray(arrays["attention_mask"])[:, -R:].sum(axis=1)
        self.responses = np.asarray(arrays["responses"])
        self.returns = np.asarray(arrays["returns"], np.float32) if "returns" in arrays else None

    @classmethod
    def load(cls, path: str | Path) -> CreditflowAdvantages:
        with np.load(path, allow_pickle=False) as data:
            return cls({k: data[k] for k in data.files})

    def batch_keys(self, prompts: np.ndarray, responses: np.ndarray, attention_mask: np.ndarray) -> list[str]:
        """The key of each row of a verl batch (left-padded prompts, right-padded responses)."""
        P = prompts.shape[1]
        pm, rm = attention_mask[:, :P] != 0, attention_mask[:, P:] != 0
        return [sample_key(prompts[i][pm[i]], responses[i][rm[i]]) for i in range(len(prompts))]

    def lookup(self, prompts, responses, attention_mask) -> tuple[np.ndarray, np.ndarray]:
        """(advantages of shape responses.shape, float32; found: bool per row). A found row's response tokens
        must be the exported ones (else ValueError: the key collided or the export is of other tokens)."""
        prompts, responses, attention_mask = (np.asarray(x) for x in (prompts, responses, attention_mask))
        B, R = responses.shape
        rows = np.array([self.row_of.get(k, -1) for k in self.batch_keys(prompts, responses, attention_mask)])
        found = rows >= 0
        out = np.zeros((B, R), dtype=np.float32)
        if found.any():
            src = rows[found]
            k = min(R, self.advantages.shape[1])
            out[found, :k] = self.advantages[src, :k]  # pad (zeros) or cut to the run's response length
            n_real = np.asarray(attention_mask)[found, -R:].sum(axis=1)
            if (n_real > self.n_resp[src]).any() or not all(
                np.array_equal(responses[i, :n], self.responses[j, :n])
                for i, j, n in zip(np.flatnonzero(found), src, n_real, strict=True)
            ):
                raise ValueError("a batch row's key matches an exported row with other response tokens")
        return out, found

    def apply(self, batch, missing: str = "keep") -> int:
        """Put the advantages into a verl `DataProto` (`batch.batch["advantages"]`, its dtype and device).
        Returns how many rows were found; `missing="error"` raises when some are not."""
        import torch

        t = batch.batch
        adv, found = self.lookup(
            t["prompts"].cpu().numpy(), t["responses"].cpu().numpy(), t["attention_mask"].cpu().numpy()
        )
        if missing == "error" and not found.all():
            raise KeyError(f"{int((~found).sum())} of {len(found)} samples are not in the creditflow export")
        if not found.all():
            log.warning(
                "%d of %d samples are not in the creditflow export: they keep verl's advantages",
                int((~found).sum()),
                len(found),
            )
        current = t["advantages"] if "advantages" in t.keys() else None
        new = torch.from_numpy(adv)
        if current is not None:
            new = torch.where(torch.from_numpy(found)[:, None], new.to(current.dtype), current.cpu())
            new = new.to(current.device)
        t["advantages"] = new
        return int(found.sum())


def install(export: str | Path | CreditflowAdvantages, missing: str = "keep"):
    """Wrap verl's `compute_advantage` (as `RayPPOTrainer.fit` calls it) so each training batch gets the
    export's advantages; returns the wrapper (its `.found` counts the rows found per call; `.uninstall()` puts
    verl's back)."""
    from verl.trainer.ppo import ray_trainer

    table = export if isinstance(export, CreditflowAdvantages) else CreditflowAdvantages.load(export)
    original = getattr(
        ray_trainer.compute_advantage, "__wrapped_by_creditflow__", ray_trainer.compute_advantage
    )

    def compute_advantage(data, *args, **kwargs):
        data = original(data, *args, **kwargs)
        compute_advantage.found.append(table.apply(data, missing=missing))
        return data

    compute_advantage.found = []
    compute_advantage.__wrapped_by_creditflow__ = original
    ray_trainer.compute_advantage = compute_advantage
    # trainers that imported the function by name (verl.experimental.separation.ray_trainer, ppo.v1.utils)
    patched = [ray_trainer] + [
        m
        for m in list(sys.modules.values())
        if m is not ray_trainer and getattr(m, "compute_advantage", None) is original
    ]
    for module in patched:
        module.compute_advantage = compute_advantage

    def uninstall() -> None:
        for module in patched:
            module.compute_advantage = original

    compute_advantage.uninstall = uninstall
    return compute_advantage
