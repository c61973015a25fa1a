"""The `nodes` and `edges` tables of an annotator's graph, built from column lists (one owner for both
annotators)."""

from __future__ import annotations

import pyarrow as pa


def graph_tables(n: dict, e: dict, round_: int, annotator_id: str, prompt_version: str | None
                 ) -> tuple[pa.Table, pa.Table]:
    """`n`: traj_id, turn, error, error_kind, u_dir (+ parse_failed); `e`: traj_id, src_turn, dst_turn, sign, type,
    info_unit, binding. Returns (nodes, edges) conformed to their schemas."""
    from schemas.edges import SPEC as EDGES
    from schemas.nodes import SPEC as NODES

    nn, ne = len(n["traj_id"]), len(e["traj_id"])
    nodes_t = NODES.conform(pa.table({
        "round": pa.array([round_] * nn, pa.int32()),
        "traj_id": pa.array(n["traj_id"], pa.string()),
        "turn": pa.array(n["turn"], pa.int32()),
        "error": pa.array(n["error"], pa.int8()),
        "error_kind": pa.array(n["error_kind"], pa.string()),
        "u_dir": pa.array(n["u_dir"], pa.int32()),
        "annotator": pa.array([annotator_id] * nn, pa.string()),
        "parse_failed": pa.array(n.get("parse_failed") or [False] * nn, pa.bool_()),
    }))
    edges_t = EDGES.conform(pa.table({
        "round": pa.array([round_] * ne, pa.int32()),
        "traj_id": pa.array(e["traj_id"], pa.string()),
        "src_turn": pa.array(e["src_turn"], pa.int32()),
        "dst_turn": pa.array(e["dst_turn"], pa.int32()),
        "sign": pa.array(e["sign"], pa.int8()),
        "type": pa.array(e["type"], pa.string()),
        "info_unit": pa.array(e["info_unit"], pa.string()),
        "binding": pa.array(e["binding"], pa.string()),
        "annotator": pa.array([annotator_id] * ne, pa.string()),
        "prompt_version": pa.array([prompt_version] * ne, pa.string()),
    }))
    return nodes_t, edges_t
