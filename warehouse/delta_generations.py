"""The generations of a Delta lake's round ingest (`warehouse.delta_lake.DeltaLake` delegates to these): a
round's ingest writes its follower tables' parts tagged with a new generation (invisible), publishes them by
replacing the round's trajectories with parts of that generation in one commit, then drops the older
generations. Readers see each round's newest `trajectories` generation only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from warehouse.delta_store import EMPTY_PARTS, PART, arrow_table, rust_panics_quiet
from warehouse.lake import FOLLOWERS, GEN_SEP, INGEST_TABLES, split_generation

if TYPE_CHECKING:
    from warehouse.delta_lake import DeltaLake


def visible_actions(lake: DeltaLake, table: str) -> pa.Table | None:
    """The table's live files that a reader sees: all of them, but for the tables of a round's ingest only
    those of the round's generation (`visible`), their `partition._part` the part's name without it."""
    acts = lake._raw_actions(table)
    if acts is None or table not in INGEST_TABLES or acts.num_rows == 0:
        return acts
    gens = lake.generations()
    t = lake._table(table)
    key = (t.version(), tuple(sorted(gens.items())))
    kept = getattr(t, "_creditflow_visible", None)
    if kept is not None and kept[0] == key:
        return kept[1]
    keep, names = visible_names(
        acts.column("partition.round").to_pylist(), acts.column(f"partition.{PART}").to_pylist(), gens
    )
    index = acts.schema.get_field_index(f"partition.{PART}")
    out = acts.set_column(index, f"partition.{PART}", pa.array(names, pa.string())).filter(
        pa.array(keep, pa.bool_())
    )
    t._creditflow_visible = (key, out)
    return out


def visible_names(rounds: list, stored: list, gens: dict[int, str]) -> tuple[list[bool], list[str]]:
    keep, names = [], []
    for r, name in zip(rounds, stored, strict=True):
        base, gen = split_generation(name)
        keep.append(gen == gens.get(int(r), ""))
        names.append(base)
    return keep, names


def generations(lake: DeltaLake, as_of=None) -> dict[int, str]:
    """Round -> the generation of the round's ingest that readers see: the newest among the round's
    `trajectories` parts (their data files and empty parts). A round's ingest writes its steps and
    quarantine parts tagged with a new generation (invisible), then replaces the round's trajectories
    with parts of that generation in one commit (the publish), then drops the older generations: a
    kill or a full disk before the publish leaves the previous generation what every reader sees."""
    if as_of is not None:
        t = lake.table_at("trajectories", as_of)
        if t is None:
            return {}
        acts = arrow_table(t.get_add_actions(flatten=True))
        empty: list[tuple[int, str]] = []
    else:
        acts = lake._raw_actions("trajectories")
        if acts is None:
            return {}
        empty = lake._raw_empty("trajectories")
        t, side = lake._table("trajectories"), lake._table(EMPTY_PARTS)
        key = (t.version(), side.version() if side is not None else -1)
        kept = getattr(t, "_creditflow_gens", None)
        if kept is not None and kept[0] == key:
            return kept[1]
        gens = generations_of(acts, empty)
        t._creditflow_gens = (key, gens)
        return gens
    return generations_of(acts, empty)


def generations_of(acts: pa.Table | None, empty: list[tuple[int, str]]) -> dict[int, str]:
    pairs: list[tuple[int, str]] = list(empty)
    if acts is not None and acts.num_rows:
        pairs += zip(
            (int(r) for r in acts.column("partition.round").to_pylist()),
            acts.column(f"partition.{PART}").to_pylist(),
            strict=True,
        )
    gens: dict[int, str] = {}
    for r, name in pairs:
        gen = split_generation(name)[1]
        if gen > gens.get(r, ""):
            gens[r] = gen
    return gens


def drop_generations(lake: DeltaLake, round_: int, keep: str) -> None:
    """Remove the follower tables' parts of the round stored with another generation than `keep` (left by
    an earlier ingest of the round, or by one killed before its publish): no reader sees them."""
    other = f"{PART} NOT LIKE '%{GEN_SEP}{keep}'" if keep else f"{PART} LIKE '%{GEN_SEP}%'"
    for table_name in FOLLOWERS:
        t = lake._table(table_name)
        acts = lake._raw_actions(table_name)
        if t is not None and acts is not None and acts.num_rows:
            lake.check_writable(table_name)
            stale = [
                n
                for r, n in zip(
                    acts.column("partition.round").to_pylist(),
                    acts.column(f"partition.{PART}").to_pylist(),
                    strict=True,
                )
                if int(r) == int(round_) and split_generation(n)[1] != keep
            ]
            if stale:
                with rust_panics_quiet():
                    t.delete(f"round = {int(round_)} AND {other}")
                lake.last_versions[table_name] = t.version()
        if any(r == int(round_) and split_generation(n)[1] != keep for r, n in lake._raw_empty(table_name)):
            lake._set_empty(table_name, round_, [], f" AND {other.replace(PART, 'part')}")
