"""Shared machinery for table schemas: one `TableSpec` per table, a validator that names the first bad
field and row, and a conformer that casts an input table to the canonical schema."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from pyarrow.parquet import ParquetFile


class SchemaError(ValueError):
    """A table does not match its schema. Names the table, the field and the first bad row."""

    def __init__(self, table: str, field: str, row: int | None, reason: str):
        self.table, self.field, self.row, self.reason = table, field, row, reason
        where = f"row {row}" if row is not None else "all rows"
        super().__init__(f"{table}: field '{field}' at {where}: {reason}")


RowCheck = Callable[[pa.Table], "SchemaError | None"]


def round_column(round_: int, rows: int) -> pa.Array:
    """The `round` column of `rows` rows of one round (every table's partition value: restored on a lake read,
    added by ingest): one value repeated, no list of `rows` Python ints (0.2 ms for a 64-group batch's steps)."""
    return pa.array(np.full(rows, int(round_), dtype=np.int32))


def is_text(t: pa.DataType) -> bool:
    """A string or binary type (either offset width): free text or bytes, whose size a schema does not bound."""
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


@dataclass(frozen=True)
class Derived:
    """A column computed from others: the lake computes it on every write (an input's own value is replaced, so
    it never disagrees with its sources), and a read derives it where a part written before it lacks it."""

    sources: tuple[str, ...]
    # from a table holding `sources`, and a memo the derived columns of one derivation share (`TableSpec.derive`:
    # the steps' value mean and m2 come from one pass over the values)
    arrow: Callable[[pa.Table, dict[object, object]], pa.Array | pa.ChunkedArray]
    sql: str  # the same over the sources, in DuckDB SQL (the catalog's views)


@dataclass(frozen=True)
class TableSpec:
    """A table: its Arrow schema, one line of documentation per field and extra row-level checks."""

    name: str
    schema: pa.Schema
    docs: dict[str, str]
    checks: tuple[RowCheck, ...] = field(default=())
    derived: dict[str, Derived] = field(default_factory=dict)

    @property
    def required(self) -> list[str]:
        return [f.name for f in self.schema if not f.nullable]

    def empty(self) -> pa.Table:
        return self.schema.empty_table()

    def conform(self, table: pa.Table) -> pa.Table:
        """Select and cast the schema's columns (missing nullable columns become nulls; derived columns are
        computed from their sources)."""
        if not self.derived and table.schema.equals(self.schema, check_metadata=True):  # already conformed
            return table
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
        out = pa.Table.from_arrays(cols, schema=self.schema)
        # the derived columns from their sources, whatever the input held
        for name, col in self.derive(out, list(self.derived)).items():
            out = out.set_column(out.schema.get_field_index(name), name, col)
        return out

    def derive(self, table: pa.Table, names: list[str]) -> dict[str, pa.Array | pa.ChunkedArray]:
        """The derived columns `names` computed from `table`'s sources, in the schema's types (one derivation:
        columns sharing an intermediate compute it once)."""
        memo: dict[object, object] = {}
        return {n: self.derived[n].arrow(table, memo).cast(self.schema.field(n).type) for n in names}

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

    @property
    def written_schema(self) -> pa.Schema:
        """The schema less its derived columns: what a writer builds (`conform` adds them)."""
        out = self.schema
        for name in self.derived:
            out = out.remove(out.get_field_index(name))
        return out

    def lacks(self, columns: Collection[str] | None, present: Collection[str]) -> bool:
        """Whether a read of `columns` (None: all) from a part holding `present` meets a derived column the part
        lacks (written before it): read `with_sources(columns)` then, and `complete` it."""
        wanted = self.derived if columns is None else [c for c in columns if c in self.derived]
        return any(c not in present for c in wanted)

    def read_file(self, pf: ParquetFile, columns: list[str] | None = None) -> pa.Table:
        """One Parquet file of this table, `columns` of it (None: all): a file written before a derived column
        (`lacks` it) is read with the column's sources and `complete`d (hive parts, a Delta batch's files)."""
        if self.lacks(columns, pf.schema_arrow.names):
            return self.complete(pf.read(columns=self.with_sources(columns)), columns)
        return pf.read(columns=columns)

    def readable(self, names: list[str]) -> list[str]:
        """The columns a read can give from parts holding `names`: those and the derived ones whose sources they
        hold."""
        return names + [c for c, d in self.derived.items() if c not in names and set(d.sources) <= set(names)]

    def with_sources(self, columns: list[str] | None) -> list[str] | None:
        """`columns` and the sources of the derived columns among them."""
        if columns is None:
            return None
        out = list(columns)
        for c in columns:
            if c in self.derived:
                out += [s for s in self.derived[c].sources if s not in out]
        return out

    def complete(self, table: pa.Table, columns: list[str] | None = None) -> pa.Table:
        """A read's `table`: each derived column of `columns` (None: of the table) that is absent or null in some
        rows (parts written before it) computed there from its sources, which `table` then holds; the columns
        are `columns` afterwards (the sources dropped that only the derivation read)."""
        todo = []
        for name, d in self.derived.items():
            if columns is not None and name not in columns:
                continue
            col = table.column(name) if name in table.column_names else None
            if col is not None and not col.null_count:
                continue
            missing = [s for s in d.sources if s not in table.column_names]
            if missing:
                raise KeyError(
                    f"table {self.name!r}: deriving {name!r} needs {', '.join(map(repr, missing))}"
                )
            todo.append(name)
        for name, new in self.derive(table, todo).items():
            if name not in table.column_names:
                table = table.append_column(pa.field(name, self.schema.field(name).type), new)
            else:
                col = table.column(name)
                table = table.set_column(
                    table.schema.get_field_index(name), name, pc.if_else(pc.is_null(col), new, col)
                )
        return table if columns is None else table.select(columns)

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


def one_chunk(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A column as one array: its only chunk as it is (`combine_chunks` copies even one chunk: a 3M-token
    batch's values, 12 MB, on every read), several chunks concatenated."""
    if not isinstance(col, pa.ChunkedArray):
        return col
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def strictly_increasing(table: pa.Table, keys: Collection[str]) -> bool:
    """Whether the rows are in strictly increasing order of `keys` (lexicographic, each key compared as Arrow
    compares its type: strings by their bytes): then no two rows share a key. O(rows), no hashing; False where
    a key holds a null or its type has no ordering kernel (a caller then takes its general path)."""
    if table.num_rows < 2:
        return True
    ok: pa.Array | None = None  # from the last key to the first: k_i > prev, or k_i == prev and the rest ok
    for name in reversed(list(keys)):
        col = table.column(name)
        if col.null_count:
            return False
        col = one_chunk(col)
        later, earlier = col.slice(1), col.slice(0, len(col) - 1)
        try:
            gt = pc.greater(later, earlier)
            ok = gt if ok is None else pc.or_(gt, pc.and_(pc.equal(later, earlier), ok))
        except pa.ArrowNotImplementedError:
            return False
    return bool(pc.all(ok).as_py()) if ok is not None else True


def check_unique(table_name: str, *keys: str) -> RowCheck:
    def check(table: pa.Table) -> SchemaError | None:
        # sorted rows (what the lake's writers write) are unique without a hash of every key
        if table.num_rows == 0 or strictly_increasing(table, keys):
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
