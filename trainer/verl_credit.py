"""creditflow's advantages inside a live verl run (verl 0.9), on both of its trainers.

verl gives every sample a fresh `uid` each step and pads or nests responses its own way, so an export cannot be
matched by uid or by shape. It is matched by `key`: a hash of the sample's token ids
(`pipeline.layouts.sample_key`), which the export stores per row and which this module computes from the
batch's `input_ids` (the whole sequence, what both trainers hold). A sample verl cut at its
`rollout.response_length` is found as the cut prefix of the exported one; one the export cut shorter than the
run holds it stops with one line naming both lengths (`trainer.export_lookup.LengthMismatch`).

Use (in the process that runs the trainer, i.e. verl's `TaskRunner` / `TaskRunnerV1`, before `trainer.fit`):

    from trainer.verl_credit import install
    install("advantages.npz", config=config)   # creditflow export --layout verl

`install` hooks both trainers; verl's own estimator runs first (it also fills `returns` for the critic), then
every sample found in the export gets creditflow's advantages, each token its own:
- v1 (`trainer.use_v1: true`, the default of verl 0.9.1's ppo_trainer.yaml): `PPOTrainer._compute_advantage`
  fetches only uid / masks / scores / logprobs from its transfer queue and, for GRPO, replaces each row's
  advantages with its first token's (`compute_advantage_for_multi_trajectories`). The hook runs after it: it
  fetches the batch's `input_ids`, `response_mask` and `advantages` from the same queue and puts the rows'
  per-token advantages back (verl's padding rows are left alone).
- legacy (`trainer.use_v1: false`, `RayPPOTrainer.fit`): wraps `verl.trainer.ppo.ray_trainer.compute_advantage`
  (and the name in every loaded module that imported it, e.g. verl's separation trainer).

With `config`, install checks the run's settings first: a loss that averages each response's advantages into
one (`actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean`) cannot carry per-token credit and is refused in
one line naming the setting; so is an export cut shorter than the run's response length. Rows the export lacks
keep verl's (`missing="keep"`, logged) or stop the run (`missing="error"`). No verl import at module level:
the module imports with or without verl installed."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from trainer.export_lookup import ExportIndex, LengthMismatch

log = logging.getLogger(__name__)

__all__ = ["CreditflowAdvantages", "LengthMismatch", "check_config", "install"]

# policy losses of verl 0.9.1 (core_algos.register_policy_loss) that use one advantage per response
SEQUENCE_LEVEL_LOSSES = {"geo_mean": "compute_policy_loss_geo_mean averages each response's advantages"}


class CreditflowAdvantages(ExportIndex):
    """An export (`creditflow export --layout verl`) indexed by sample key, applied to verl batches."""

    def lookup(self, prompts, responses, attention_mask, cap: int | None = None):
        """Padded legacy rows (left-padded prompts, right-padded responses): (advantages of shape
        responses.shape, float32; found: bool per row)."""
        seq = np.concatenate([np.asarray(prompts), np.asarray(responses)], axis=1)
        return self.lookup_padded(seq, np.asarray(attention_mask), np.asarray(responses).shape[1], cap)

    def lookup_padded(self, input_ids, attention_mask, width: int, cap: int | None = None):
        """Rows of `input_ids` ([prompt | response], `width` response columns, `attention_mask` on the real
        tokens): (B, width) advantages, float32, and which rows were found. `cap`: the run's response length
        (default: `width`, to which verl pads responses)."""
        real = attention_mask != 0
        seqs = [input_ids[i][real[i]] for i in range(len(input_ids))]
        resp = real[:, input_ids.shape[1] - width :].sum(axis=1)
        rows = self.match(seqs, resp, cap=width if cap is None else cap)
        out = np.zeros((len(seqs), width), dtype=np.float32)
        for i in np.flatnonzero(rows >= 0):
            n, r = len(seqs[i]), int(resp[i])
            out[i, :r] = self.advantages(int(rows[i]), n)[n - r :]
        return out, rows >= 0

    def lookup_rows(self, seqs, response_lengths, cap: int | None = None, skip=None):
        """Unpadded rows (verl v1's nested tensors): per row its response's advantages (None where the export
        lacks the sample or the row is skipped)."""
        rows = self.match(seqs, response_lengths, cap=cap, skip=skip)
        out = []
        for i, j in enumerate(rows.tolist()):
            n, r = len(seqs[i]), int(response_lengths[i])
            out.append(None if j < 0 else self.advantages(j, n)[n - r :].copy())
        return out

    def _report(self, found: np.ndarray, missing: str) -> None:
        lost = int((~found).sum())
        if lost and missing == "error":
            raise KeyError(f"{lost} of {len(found)} samples are not in the creditflow export")
        if lost:
            log.warning(
                "%d of %d samples are not in the creditflow export: they keep verl's advantages",
                lost,
                len(found),
            )

    def apply(self, batch, missing: str = "keep", cap: int | None = None) -> int:
        """Put the advantages into a legacy verl `DataProto` (`batch.batch["advantages"]`, its dtype and
        device). Returns how many rows were found; `missing="error"` raises when some are not."""
        import torch

        t = batch.batch
        keys = set(t.keys())
        width = (t["responses"] if "responses" in keys else t["response_mask"]).shape[1]
        if "input_ids" in keys:
            ids = t["input_ids"].cpu().numpy()
        else:
            ids = np.concatenate([t["prompts"].cpu().numpy(), t["responses"].cpu().numpy()], axis=1)
        adv, found = self.lookup_padded(ids, t["attention_mask"].cpu().numpy(), width, cap)
        self._report(found, missing)
        new = torch.from_numpy(adv)
        if "advantages" in keys:
            current = t["advantages"]
            new = torch.where(torch.from_numpy(found)[:, None], new.to(current.dtype), current.cpu())
            new = new.to(current.device)
        t["advantages"] = new
        return int(found.sum())

    def apply_v1(self, queue, meta, missing: str = "keep", cap: int | None = None) -> int:
        """Put the advantages of verl v1's batch `meta` (a KVBatchMeta: keys, partition_id, tags) into its
        transfer queue `queue` (verl's `transfer_queue` module), as nested per-response tensors; rows tagged
        `is_padding` are left alone. Returns how many rows were found."""
        import torch
        from tensordict import TensorDict

        data = queue.kv_batch_get(
            keys=meta.keys,
            partition_id=meta.partition_id,
            select_fields=["input_ids", "response_mask", "advantages"],
        )
        seqs = [x.cpu().numpy() for x in data["input_ids"].unbind()]
        current = list(data["advantages"].unbind())
        resp = [len(x) for x in data["response_mask"].unbind()]
        padding = np.array([bool((tag or {}).get("is_padding", False)) for tag in meta.tags], dtype=bool)
        if len(padding) != len(seqs):
            padding = np.zeros(len(seqs), dtype=bool)
        ours = self.lookup_rows(seqs, resp, cap=cap, skip=padding)
        found = np.array([a is not None for a in ours], dtype=bool)
        self._report(found | padding, missing)
        rows = [
            cur if a is None else torch.from_numpy(a).to(cur.dtype).to(cur.device)
            for a, cur in zip(ours, current, strict=True)
        ]
        nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        queue.kv_batch_put(
            keys=meta.keys,
            partition_id=meta.partition_id,
            fields=TensorDict({"advantages": nested}, batch_size=len(rows)),
        )
        return int(found.sum())


def _get(config, path: str):
    node = config
    for part in path.split("."):
        if node is None:
            return None
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return node


def check_config(config, table: ExportIndex | None = None) -> int | None:
    """Refuse, in one line naming the setting, a verl config whose path cannot carry per-token advantages or
    whose response length the export was cut shorter than; returns the run's response length (or None)."""
    if config is None:
        return None
    loss = _get(config, "actor_rollout_ref.actor.policy_loss.loss_mode")
    if loss in SEQUENCE_LEVEL_LOSSES:
        raise ValueError(
            f"verl's actor_rollout_ref.actor.policy_loss.loss_mode={loss} cannot carry per-token advantages "
            f"({SEQUENCE_LEVEL_LOSSES[loss]}): set actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"
        )
    cap = _get(config, "actor_rollout_ref.rollout.response_length")
    cap = int(cap) if cap is not None else _get(config, "data.max_response_length")
    if table is not None and cap is not None and table.cut_at is not None and int(cap) > table.cut_at:
        raise LengthMismatch(
            f"the creditflow export was cut at --response-length {table.cut_at}, this run's responses reach "
            f"{cap} tokens (actor_rollout_ref.rollout.response_length): export again with --response-length {cap}"
        )
    return None if cap is None else int(cap)


def _v1_trainer(config):
    """verl's v1 trainer class, or None where it does not import (its transfer_queue is not installed: then
    no v1 run can happen in this process); a config asking for v1 makes that an error."""
    import importlib

    try:
        trainer_base = importlib.import_module("verl.trainer.ppo.v1.trainer_base")
    except ImportError as exc:
        if config is not None and _get(config, "trainer.use_v1"):
            raise ImportError(
                f"trainer.use_v1=true but verl's v1 trainer does not import here ({exc}): install its "
                f"dependencies or set trainer.use_v1=false"
            ) from None
        log.debug("verl v1 trainer not importable (%s): only the legacy fit() path is hooked", exc)
        return None
    return trainer_base


class AdvantageHook(Protocol):
    """What `install` returns: verl's compute_advantage wrapped, with the rows found per call (`found`), verl's
    own function (`__wrapped_by_creditflow__`) and `uninstall()`."""

    found: list[int]
    __wrapped_by_creditflow__: Callable[..., Any]
    uninstall: Callable[[], None]

    def __call__(self, data: Any, *args: Any, **kwargs: Any) -> Any: ...


def install(export: str | Path | CreditflowAdvantages, missing: str = "keep", config=None) -> AdvantageHook:
    """Hook verl's advantage step on both trainers (v1 `PPOTrainer._compute_advantage` and the legacy
    `compute_advantage`) so each training batch gets the export's advantages; returns the legacy wrapper (its
    `.found` counts the rows found per call, on either trainer; `.uninstall()` puts verl's back). `config`: the
    run's verl config, checked first (`check_config`)."""
    from verl.trainer.ppo import ray_trainer

    table = export if isinstance(export, CreditflowAdvantages) else CreditflowAdvantages.load(export)
    run_cap = check_config(config, table)
    # v1 first: its utils module binds verl's compute_advantage by name at import, and must keep verl's (the
    # hook runs after compute_advantage_for_multi_trajectories, not inside it)
    v1 = _v1_trainer(config)
    original = getattr(
        ray_trainer.compute_advantage, "__wrapped_by_creditflow__", ray_trainer.compute_advantage
    )
    found: list[int] = []

    def compute_advantage(data, *args, **kwargs):
        data = original(data, *args, **kwargs)
        found.append(table.apply(data, missing=missing, cap=run_cap))
        return data

    hook = cast(AdvantageHook, compute_advantage)  # with the attributes it gets here
    hook.found = found
    hook.__wrapped_by_creditflow__ = original
    # trainers that imported the function by name (verl.experimental.separation.ray_trainer), not v1's
    patched: list[Any] = [ray_trainer] + [
        m
        for name, m in list(sys.modules.items())
        if m is not ray_trainer
        and not name.startswith("verl.trainer.ppo.v1")
        and getattr(m, "compute_advantage", None) is original
    ]
    for module in patched:
        module.compute_advantage = compute_advantage
    restore = []
    if v1 is not None:
        cls = v1.PPOTrainer
        v1_original = getattr(cls._compute_advantage, "__wrapped_by_creditflow__", cls._compute_advantage)

        def _compute_advantage(self, batch, metrics):
            check_config(getattr(self, "config", None), table)
            out = v1_original(self, batch, metrics)
            cap = _get(getattr(self, "config", None), "actor_rollout_ref.rollout.response_length")
            found.append(table.apply_v1(v1.tq, batch, missing=missing, cap=cap))
            return out

        _compute_advantage.__dict__["__wrapped_by_creditflow__"] = v1_original
        cls._compute_advantage = _compute_advantage
        restore.append(lambda: setattr(cls, "_compute_advantage", v1_original))

    def uninstall() -> None:
        for module in patched:
            module.compute_advantage = original
        for undo in restore:
            undo()

    hook.uninstall = uninstall
    return hook
