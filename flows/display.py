"""Terminal output: rich tables for results and summaries."""

from __future__ import annotations

import pyarrow as pa
from rich.console import Console
from rich.table import Table

console = Console()


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        value += 0.0  # -0.0 prints as 0
        return f"{value:.4g}" if value == 0 or abs(value) >= 1e-4 else f"{value:.1e}"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def print_table(table: pa.Table, title: str | None = None, limit: int = 50) -> None:
    """Names (string columns) are never broken across lines; numbers are right-aligned; a simple box keeps
    the table narrow (an 80-column terminal fits the summaries)."""
    from rich import box

    out = Table(title=title, show_lines=False, box=box.SIMPLE_HEAD)
    for field in table.schema:
        text = pa.types.is_string(field.type) or pa.types.is_large_string(field.type)
        numeric = (
            pa.types.is_integer(field.type)
            or pa.types.is_floating(field.type)
            or pa.types.is_decimal(field.type)
        )
        out.add_column(field.name, no_wrap=text, overflow="fold", justify="right" if numeric else "left")
    for row in table.slice(0, limit).to_pylist():
        out.add_row(*[_fmt(row[c]) for c in table.column_names])
    console.print(out)
    if table.num_rows > limit:
        console.print(f"[dim]... {table.num_rows - limit} more rows ({table.num_rows} in all)[/dim]")


def print_kv(title: str, items: dict) -> None:
    out = Table(title=title, show_header=False)
    out.add_column("what", style="bold", no_wrap=True)
    out.add_column("value", overflow="fold")
    for k, v in items.items():
        out.add_row(str(k), v if isinstance(v, str) else _fmt(v))
    console.print(out)
