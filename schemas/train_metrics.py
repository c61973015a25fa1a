"""train_metrics: one row per optimizer step of the trainer, queryable next to the credit statistics."""

import pyarrow as pa

from schemas import register_table
from schemas._base import TableSpec

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("method", pa.string()),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("epoch", pa.int32(), nullable=False),
        pa.field("micro_batches", pa.int32(), nullable=False),
        pa.field("sequences", pa.int32(), nullable=False),
        pa.field("tokens", pa.int64(), nullable=False),
        pa.field("loss", pa.float64(), nullable=False),
        pa.field("pg_loss", pa.float64(), nullable=False),
        pa.field("vf_loss", pa.float64()),
        pa.field("kl", pa.float64()),
        pa.field("clip_frac", pa.float64(), nullable=False),
        pa.field("approx_kl", pa.float64(), nullable=False),
        pa.field("entropy", pa.float64(), nullable=False),
        pa.field("grad_norm", pa.float64(), nullable=False),
        pa.field("lr", pa.float64(), nullable=False),
        pa.field("seconds", pa.float64(), nullable=False),
    ]
)

DOCS = {
    "round": "round the batch came from",
    "method": "credit method of the batch",
    "step": "optimizer step (0-based, within this train call)",
    "epoch": "pass over the batch",
    "micro_batches": "micro-batches accumulated into this step",
    "sequences": "trajectories in the step",
    "tokens": "trained (loss-mask) tokens in the step",
    "loss": "total loss (pg + vf_coef * vf + kl_coef * kl - entropy_coef * entropy)",
    "pg_loss": "clipped surrogate policy loss",
    "vf_loss": "value loss (PPO/GAE with a value head)",
    "kl": "mean KL to the reference model",
    "clip_frac": "share of tokens where the clip was active",
    "approx_kl": "0.5 * mean (log ratio)^2 to the behaviour policy",
    "entropy": "mean token entropy",
    "grad_norm": "gradient norm before clipping",
    "lr": "learning rate",
    "seconds": "wall time of the step",
}

SPEC = register_table(TableSpec("train_metrics", SCHEMA, DOCS))


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
