"""credit_stats: the statistics pass of a round, one part per batch: the sufficient statistics of each
batch-level statistic a credit method takes over the round (GAE / turn-PPO whitening, GDPO's batch
normalisation). The credit pass merges the parts (pipeline.credit.ops.Moments) and whitens every batch with
the round's mean and variance, so the advantages do not depend on how the round was split into parts."""

import pyarrow as pa

from schemas import register_table
from schemas._base import TableSpec

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("key", pa.string(), nullable=False),
        pa.field("n", pa.float64(), nullable=False),
        pa.field("mean", pa.float64(), nullable=False),
        pa.field("m2", pa.float64(), nullable=False),
        pa.field("source", pa.string()),
    ]
)

DOCS = {
    "round": "round partition key",
    "key": "the statistic: the estimator that takes it (gae, turn_ppo, gdpo, gae_pr)",
    "n": "count (or total weight: tokens) of the values the batch contributes",
    "mean": "their (weighted) mean",
    "m2": "sum of weight * (value - mean)^2 (sum of squares = m2 + n * mean^2)",
    "source": "identity of what the part was computed from (the statistics stage's cache key: input parts, "
    "settings, code); a part whose source is not the batch's current one is recomputed",
}

SPEC = register_table(TableSpec("credit_stats", SCHEMA, DOCS))
