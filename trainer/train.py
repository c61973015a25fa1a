"""The trainer stage: a torch policy update on a Hugging Face causal LM from an exported batch Parquet
(the flat layout of `creditflow export`), exactly as an external trainer would consume it.

Clipped token-level surrogate with the batch's per-token advantages and old logprobs (clip low/high,
optional dual clip), loss aggregation modes, optional KL to a reference model, optional value head for
PPO/GAE, gradient accumulation over micro-batches packed by a token budget, bf16 on GPU / fp32 on CPU, and a
checkpoint in Hugging Face format (what vLLM loads for the next collect). Metrics per optimizer step are
returned as an Arrow table (`train_metrics`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from pipeline.config import StageSettings, register_settings


@register_settings("train")
class TrainSettings(StageSettings):
    lr: float = Field(1e-5, description="AdamW learning rate")
    weight_decay: float = Field(0.0, description="AdamW weight decay")
    epochs: int = Field(1, ge=1, description="passes over the batch (PPO epochs)")
    mini_batch_seqs: int = Field(16, ge=1, description="trajectories per optimizer step")
    token_budget: int = Field(
        8192, ge=16, description="max padded tokens per micro-batch (grad accumulation)"
    )
    max_seq_len: int = Field(4096, ge=8, description="longer trajectories are truncated at the end")
    clip_low: float = Field(0.2, description="ratio clip below 1")
    clip_high: float = Field(0.2, description="ratio clip above 1 (clip-higher when > clip_low)")
    dual_clip: float | None = Field(
        None, description="dual-clip constant c > 1 for negative advantages (None: off)"
    )
    loss_agg: str = Field("token-mean", description="token-mean | seq-mean-token-sum | seq-mean-token-mean")
    kl_coef: float = Field(0.0, description="KL-to-reference loss coefficient (0: no reference model)")
    kl_kind: str = Field("low_var_kl", description="kl | low_var_kl | mse")
    entropy_coef: float = Field(0.0, description="entropy bonus coefficient")
    value_head: bool = Field(False, description="train a value head (PPO/GAE batches with returns)")
    vf_coef: float = Field(0.5, description="value loss coefficient")
    clip_value: float = Field(0.5, description="value clip range")
    grad_clip: float = Field(1.0, description="max gradient norm")
    old_logprobs: str = Field(
        "auto", description="batch | recompute | auto (recompute rows with no logprobs)"
    )
    seed: int = Field(0, description="shuffling and init seed")
    device: str = Field("auto", description="auto | cpu | cuda")


@dataclass
class Sequence:
    input_ids: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    advantages: np.ndarray
    values: np.ndarray | None
    returns: np.ndarray | None
    has_logprobs: bool


def load_batch(path: str | Path, max_seq_len: int) -> tuple[list[Sequence], dict]:
    table = pq.read_table(path)
    needed = {"input_ids", "loss_mask", "old_logprobs", "advantages"}
    missing = needed - set(table.column_names)
    if missing:
        raise ValueError(f"{path}: not a creditflow export batch, missing columns {sorted(missing)}")
    cols = {c: table.column(c).to_pylist() for c in table.column_names if c in needed | {"values", "returns"}}
    # the export says which rows carry the behaviour policy's logprobs (a row with some steps' logprobs 0-filled
    # is not one); a batch written before the column: rows whose trained tokens are not all 0
    known = table.column("logprobs_known").to_pylist() if "logprobs_known" in table.column_names else None
    seqs = []
    for i in range(table.num_rows):
        mask = np.asarray(cols["loss_mask"][i][:max_seq_len], dtype=np.float32)
        old = np.asarray(cols["old_logprobs"][i][:max_seq_len], dtype=np.float32)
        vals = cols.get("values", [None] * table.num_rows)[i]
        rets = cols.get("returns", [None] * table.num_rows)[i]
        seqs.append(
            Sequence(
                input_ids=np.asarray(cols["input_ids"][i][:max_seq_len], dtype=np.int64),
                loss_mask=mask,
                old_logprobs=old,
                advantages=np.asarray(cols["advantages"][i][:max_seq_len], dtype=np.float32),
                values=None if vals is None else np.asarray(vals[:max_seq_len], dtype=np.float32),
                returns=None if rets is None else np.asarray(rets[:max_seq_len], dtype=np.float32),
                has_logprobs=bool(known[i])
                if known is not None and known[i] is not None
                else (bool(np.any(old[mask > 0] != 0)) if mask.any() else False),
            )
        )
    info = {
        "method": table.column("method")[0].as_py()
        if "method" in table.column_names and table.num_rows
        else None,
        "round": table.column("round")[0].as_py() if "round" in table.column_names and table.num_rows else 0,
    }
    return seqs, info


def pack_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Greedy packing of sequence indices (longest first) so that padded tokens <= budget per micro-batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for i in order:
        new_max = max(current_max, lengths[i])
        if current and new_max * (len(current) + 1) > token_budget:
            batches.append(current)
            current, current_max = [], 0
            new_max = lengths[i]
        current.append(i)
        current_max = new_max
    if current:
        batches.append(current)
    return batches


def _pad(arrays: list[np.ndarray], length: int, dtype, fill=0):
    out = np.full((len(arrays), length), fill, dtype=dtype)
    for r, a in enumerate(arrays):
        out[r, : len(a)] = a
    return out


class ValueHead:
    """A linear value head on the last hidden state, saved next to the policy checkpoint."""

    def __init__(self, hidden: int, device, dtype):
        import torch

        self.linear = torch.nn.Linear(hidden, 1).to(device=device, dtype=dtype)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def __call__(self, hidden_states):
        return self.linear(hidden_states).squeeze(-1)


def train(
    batch_path: str | Path,
    model_dir: str | Path,
    out_dir: str | Path,
    settings: TrainSettings | None = None,
    ref_model_dir: str | Path | None = None,
    progress=None,
) -> pa.Table:
    """One policy update on the batch; saves the new checkpoint to out_dir; returns train_metrics rows."""
    import torch

    s = settings or TrainSettings()
    torch.manual_seed(s.seed)
    seqs, info = load_batch(batch_path, s.max_seq_len)
    if not seqs:
        raise ValueError(f"{batch_path}: empty batch")
    run = _Update(s, seqs, model_dir, ref_model_dir)
    run.recompute_old_logprobs()
    rng = np.random.default_rng(s.seed)
    rows = []
    step = 0
    for epoch in range(s.epochs):
        order = rng.permutation(len(seqs))
        for start in range(0, len(order), s.mini_batch_seqs):
            mini = [int(i) for i in order[start : start + s.mini_batch_seqs]]
            rows.append(
                {
                    "round": int(info["round"] or 0),
                    "method": info["method"],
                    "step": step,
                    "epoch": epoch,
                    **run.mini_batch(mini),
                }
            )
            step += 1
            if progress is not None:
                progress(step)
    run.save(Path(out_dir), model_dir)
    from schemas.train_metrics import SPEC

    return SPEC.conform(pa.Table.from_pylist(rows))


class _Update:
    """One policy update in progress: the policy (and the frozen reference for the KL term, the value head),
    its optimizer, the batch's sequences and the device."""

    def __init__(self, s: TrainSettings, seqs: list, model_dir: str | Path, ref_model_dir: str | Path | None):
        import torch
        from transformers import AutoModelForCausalLM

        self.s, self.seqs, self.torch = s, seqs, torch
        self.device = torch.device(
            "cuda" if (s.device == "auto" and torch.cuda.is_available()) or s.device == "cuda" else "cpu"
        )
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        # transformers types PreTrainedModel.to as functools.wraps(nn.Module.to) of its own (self, *args) method: a
        # _Wrapped that mypy does not bind, so `device` reads as `self` (the same below and in collect.py)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=dtype)
        self.model = model.to(self.device)  # type: ignore[arg-type]
        self.ref = None
        if s.kl_coef > 0:
            self.ref = (
                AutoModelForCausalLM.from_pretrained(str(ref_model_dir or model_dir), torch_dtype=dtype)
                .to(self.device)  # type: ignore[arg-type]  # PreTrainedModel.to's _Wrapped type (above)
                .eval()
            )
        self.vhead = (
            ValueHead(self.model.config.hidden_size, self.device, torch.float32) if s.value_head else None
        )
        if self.vhead is not None and any(q.returns is None for q in seqs):
            raise ValueError("value_head needs a batch with `returns` (export a gae method)")
        self.params = list(self.model.parameters()) + (
            list(self.vhead.linear.parameters()) if self.vhead else []
        )
        self.optim = torch.optim.AdamW(self.params, lr=s.lr, weight_decay=s.weight_decay)

    def _padded(self, arrays: list, L: int, dtype):
        return self.torch.from_numpy(_pad(arrays, L, dtype)).to(self.device)

    def forward(self, idx: list[int], with_grad: bool):
        from trainer.losses import token_logprobs_and_entropy

        seqs, torch = self.seqs, self.torch
        L = max(len(seqs[i].input_ids) for i in idx)
        ids = self._padded([seqs[i].input_ids for i in idx], L, np.int64)
        attn = self._padded([np.ones_like(seqs[i].input_ids) for i in idx], L, np.int64)
        ctx = torch.enable_grad() if with_grad else torch.no_grad()
        with ctx:
            out = self.model(input_ids=ids, attention_mask=attn, output_hidden_states=self.vhead is not None)
            logp, ent = token_logprobs_and_entropy(out.logits, ids)
            vpred = self.vhead(out.hidden_states[-1].float()) if self.vhead is not None else None
        return ids, attn, L, logp, ent, vpred

    def recompute_old_logprobs(self) -> None:
        """Old logprobs: from the batch, or recomputed with the current weights before any update."""
        s, seqs = self.s, self.seqs
        recompute = [
            i
            for i, q in enumerate(seqs)
            if s.old_logprobs == "recompute" or (s.old_logprobs == "auto" and not q.has_logprobs)
        ]
        self.model.eval()
        for mb in pack_micro_batches([len(seqs[i].input_ids) for i in recompute], s.token_budget):
            idx = [recompute[j] for j in mb]
            _, _, _, logp, _, _ = self.forward(idx, with_grad=False)
            for r, i in enumerate(idx):
                seqs[i].old_logprobs = logp[r, : len(seqs[i].input_ids)].float().cpu().numpy()
        self.model.train()

    def mini_batch(self, mini: list[int]) -> dict:
        """One optimizer step over a mini-batch (its micro-batches' gradients summed); its metrics row."""
        s, seqs, torch = self.s, self.seqs, self.torch
        t0 = time.perf_counter()
        norm_tokens = float(max(sum(seqs[i].loss_mask.sum() for i in mini), 1.0))
        norm_seqs = float(max(sum(1 for i in mini if seqs[i].loss_mask.any()), 1))
        micro = pack_micro_batches([len(seqs[i].input_ids) for i in mini], s.token_budget)
        self.optim.zero_grad(set_to_none=True)
        agg = {"loss": 0.0, "pg": 0.0, "vf": 0.0, "kl": 0.0, "clip": 0.0, "akl": 0.0, "ent": 0.0}
        for mb in micro:
            self._micro_batch([mini[j] for j in mb], norm_tokens, norm_seqs, agg)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, s.grad_clip)
        self.optim.step()
        gn = float(grad_norm.item())
        return {
            "micro_batches": len(micro),
            "sequences": len(mini),
            "tokens": int(norm_tokens),
            "loss": agg["loss"],
            "pg_loss": agg["pg"],
            "vf_loss": agg["vf"] if self.vhead is not None else None,
            "kl": agg["kl"] if self.ref is not None else None,
            "clip_frac": agg["clip"],
            "approx_kl": agg["akl"],
            "entropy": agg["ent"],
            "grad_norm": gn if math.isfinite(gn) else float("nan"),
            "lr": s.lr,
            "seconds": time.perf_counter() - t0,
        }

    def _micro_batch(self, idx: list[int], norm_tokens: float, norm_seqs: float, agg: dict) -> None:
        """The loss of one micro-batch (policy, KL to the reference, entropy, value), its gradient added."""
        from trainer.losses import aggregate, kl_penalty, policy_loss, token_logprobs_and_entropy, value_loss

        s, seqs, torch = self.s, self.seqs, self.torch
        ids, attn, L, logp, ent, vpred = self.forward(idx, with_grad=True)
        mask = self._padded([seqs[i].loss_mask for i in idx], L, np.float32)
        old = self._padded([seqs[i].old_logprobs for i in idx], L, np.float32)
        adv = self._padded([seqs[i].advantages for i in idx], L, np.float32)
        pg, clip_frac, approx_kl = policy_loss(
            logp, old, adv, mask, s.clip_low, s.clip_high, s.dual_clip, s.loss_agg, norm_tokens, norm_seqs
        )
        loss = pg
        share = float(mask.sum().item()) / norm_tokens
        if self.ref is not None:
            with torch.no_grad():
                ref_logp, _ = token_logprobs_and_entropy(
                    self.ref(input_ids=ids, attention_mask=attn).logits, ids
                )
            kl = aggregate(kl_penalty(logp, ref_logp, s.kl_kind), mask, s.loss_agg, norm_tokens, norm_seqs)
            loss = loss + s.kl_coef * kl
            agg["kl"] += float(kl.item())
        ent_m = aggregate(ent, mask, "token-mean", norm_tokens)
        if s.entropy_coef:
            loss = loss - s.entropy_coef * ent_m
        if self.vhead is not None:
            vals = self._padded(
                [v if (v := seqs[i].values) is not None else np.zeros(1) for i in idx], L, np.float32
            )
            # every row has returns (checked where vhead is made): the filter only narrows the type
            rets = self._padded([ret for i in idx if (ret := seqs[i].returns) is not None], L, np.float32)
            vf = value_loss(vpred, vals, rets, mask, s.clip_value, s.loss_agg, norm_tokens, norm_seqs)
            loss = loss + s.vf_coef * vf
            agg["vf"] += float(vf.item())
        loss.backward()
        agg["loss"] += float(loss.item())
        agg["pg"] += float(pg.item())
        agg["clip"] += float(clip_frac.item()) * share
        agg["akl"] += float(approx_kl.item()) * share
        agg["ent"] += float(ent_m.item())

    def save(self, out_dir: Path, model_dir: str | Path) -> None:
        """The new checkpoint (the tokenizer copied where the model folder has one; the value head beside)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(out_dir), safe_serialization=True)
        try:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(out_dir))
        except Exception:  # noqa: BLE001 - a model folder without a tokenizer is still a valid checkpoint
            pass
        if self.vhead is not None:
            self.torch.save(self.vhead.linear.state_dict(), out_dir / "value_head.pt")
