"""The lake layout (atomic, idempotent partitions: hive Parquet or Delta tables) and the DuckDB catalog of views."""

from warehouse import delta_lake as _delta_lake  # noqa: F401  (registers the delta format with Lake)
from warehouse.lake import Lake

__all__ = ["Lake"]
