"""Shared machinery for table schemas: one `TableSpec` per table, a validator that names the first bad
field and row, and a conformer that casts an input table to the canonical schema."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc


class SchemaError(ValueError):
    """A table does not match its schema. Names the table, the field and the first bad row."""

    def __init__(self, table: str, field: str, row: int | None, reason: str):
        self.table, self.field, self.row, self.reason = table, field, row, reason
        where = f"row {row}" if row is not None else "all rows"
        super().__init__(f"{table}: field '{field}' at {where}: {reason}")


RowCheck = Callable[[pa.Table], "SchemaError | None"]


@dataclass(frozen=True)
class TableSpec:
    """A table: its Arrow schema, one line of documentation per field and extra row-level checks."""

    name: str
    schema: pa.Schema
    docs: dict[str, str]
    checks: tuple[RowCheck, ...] = field(default=())

    @property
    def required(self) -> list[str]:
        return [f.name for f in self.schema if not f.nullable]

    def empty(self) -> pa.Table:
        return self.schema.empty_table()

    def conform(self, table: pa.Table) -> pa.Table:
        """Select and cast the schema's columns (missing nullable columns become nulls)."""
        cols = []
        for f in self.schema:
            if f.name in table.column_names:
                col = table.column(f.name)
                if col.type != f.type:
                    try:
                        col = col.cast(f.type)
                    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                        raise SchemaError(
                            self.name, f.name, None, f"cannot cast {col.type} to {f.type}: {exc}"
                        ) from exc
                cols.append(col)
            elif f.nullable:
                cols.append(pa.nulls(table.num_rows, f.type))
            else:
                raise SchemaError(self.name, f.name, None, "required column is missing")
        return pa.Table.from_arrays(cols, schema=self.schema)

    def validate(self, table: pa.Table) -> pa.Table:
        """Return the table conformed to the schema, or raise SchemaError naming the first bad field and row."""
        table = self.conform(table)
        for name in self.required:
            col = table.column(name)
            if col.null_count:
                row = pc.index(pc.is_null(col), True).as_py()
                raise SchemaError(self.name, name, row, "null in a required field")
        for check in self.checks:
            err = check(table)
            if err is not None:
                raise err
        return table

    def describe(self) -> str:
        lines = [f"{self.name}:"]
        for f in self.schema:
            lines.append(f"  {f.name:<18} {str(f.type):<40} {self.docs.get(f.name, '')}")
        return "\n".join(lines)


def first_true(mask: pa.ChunkedArray | pa.Array) -> int | None:
    mask = pc.fill_null(mask, False)
    if not pc.any(mask).as_py():
        return None
    return int(pc.index(mask, True).as_py())


def check_unique(table_name: str, *keys: str) -> RowCheck:
    def check(table: pa.Table) -> SchemaError | None:
        if table.num_rows == 0:
            return None
        import polars as pl

        frame = pl.DataFrame(table.select(list(keys)))
        dup = ~frame.select(pl.struct(pl.all()).is_first_distinct()).to_series()
        if dup.any():
            row = int(dup.arg_max() or 0)
            return SchemaError(table_name, keys[-1], row, f"duplicate key {tuple(frame.row(row))}")
        return None

    return check


def check_finite(table_name: str, column: str) -> RowCheck:
    def check(table: pa.Table) -> SchemaError | None:
        col = table.column(column)
        row = first_true(pc.invert(pc.is_finite(col)))
        if row is not None:
            return SchemaError(table_name, column, row, f"not a finite number: {col[row].as_py()}")
        return None

    return check


def check_same_length(table_name: str, ref: str, *others: str) -> RowCheck:
    def check(table: pa.Table) -> SchemaError | None:
        ref_len = pc.list_value_length(table.column(ref))
        for other in others:
            col = table.column(other)
            mismatch = pc.and_(pc.is_valid(col), pc.not_equal(pc.list_value_length(col), ref_len))
            row = first_true(mismatch)
            if row is not None:
                return SchemaError(
                    table_name,
                    other,
                    row,
                    f"length {len(col[row])} does not match {ref} length {ref_len[row].as_py()}",
                )
        return None

    return check


def check_in(table_name: str, column: str, allowed: set[str]) -> RowCheck:
    def check(table: pa.Table) -> SchemaError | None:
        col = table.column(column)
        bad = pc.invert(pc.is_in(col, value_set=pa.array(sorted(allowed))))
        row = first_true(pc.and_(pc.is_valid(col), bad))
        if row is not None:
            return SchemaError(
                table_name,
                column,
                row,
                f"unknown value {col[row].as_py()!r}; expected one of {sorted(allowed)}",
            )
        return None

    return check
