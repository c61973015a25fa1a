"""The lake layout (atomic, idempotent Parquet partitions) and the DuckDB catalog of views."""

from warehouse.lake import Lake

__all__ = ["Lake"]
