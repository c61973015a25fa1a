"""Writes the shared LLM client's per-call records to the lake table `llm_calls`."""

from __future__ import annotations

from pathlib import Path

from warehouse.lake import Lake


def write_llm_calls(lake: Lake, client, round_: int, part: str, clear: bool = True) -> Path | None:
    """Write `client.records_table()` as part `part` of llm_calls/round=<round_> (atomic); None when there
    were no calls. `clear` empties the client's record list afterwards."""
    table = client.records_table()
    if table.num_rows == 0:
        return None
    path = lake.write_part("llm_calls", round_, table, part=part)
    if clear:
        client.clear_records()
    return path
