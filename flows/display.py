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
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def print_table(table: pa.Table, title: str | None = None, limit: int = 50) -> None:
    out = Table(title=title, show_lines=False)
    for name in table.column_names:
        out.add_column(name, overflow="fold")
    for row in table.slice(0, limit).to_pylist():
        out.add_row(*[_fmt(row[c]) for c in table.column_names])
    console.print(out)
    if table.num_rows > limit:
        console.print(f"[dim]... {table.num_rows - limit} more rows ({table.num_rows} in all)[/dim]")


def print_kv(title: str, items: dict) -> None:
    out = Table(title=title, show_header=False)
    out.add_column("what", style="bold")
    out.add_column("value")
    for k, v in items.items():
        out.add_row(str(k), _fmt(v))
    console.print(out)
