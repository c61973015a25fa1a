"""The `nodes` and `edges` tables of an annotator's graph, built from column lists (one owner for both
annotators)."""

from __future__ import annotations

import pyarrow as pa


def add_edges(e: dict, traj_id: str, edges) -> None:
    """Append one trajectory's (src, dst, type, info_unit, binding) edges to the edge columns; E- (type
    failed_utilization) gets sign -1, E+ (input, success_utilization) +1."""
    for i, j, typ, info, binding in edges:
        e["traj_id"].append(traj_id)
        e["src_turn"].append(i)
        e["dst_turn"].append(j)
        e["sign"].append(-1 if typ == "failed_utilization" else 1)
        e["type"].append(typ)
        e["info_unit"].append(info)
        e["binding"].append(binding)


def graph_tables(
    n: dict, e: dict, round_: int, annotator_id: str, prompt_version: str | None
) -> tuple[pa.Table, pa.Table]:
    """`n`: traj_id, turn, error, error_kind, u_dir (+ parse_failed); `e`: traj_id, src_turn, dst_turn, sign, type,
    info_unit, binding. Returns (nodes, edges) conformed to their schemas."""
    from schemas.edges import SPEC as EDGES
    from schemas.nodes import SPEC as NODES

    nn, ne = len(n["traj_id"]), len(e["traj_id"])
    nodes_t = NODES.conform(
        pa.table(
            {
                "round": pa.array([round_] * nn, pa.int32()),
                "traj_id": pa.array(n["traj_id"], pa.string()),
                "turn": pa.array(n["turn"], pa.int32()),
                "error": pa.array(n["error"], pa.int8()),
                "error_kind": pa.array(n["error_kind"], pa.string()),
                "u_dir": pa.array(n["u_dir"], pa.int32()),
                "annotator": pa.array([annotator_id] * nn, pa.string()),
                "parse_failed": pa.array(n.get("parse_failed") or [False] * nn, pa.bool_()),
            }
        )
    )
    edges_t = EDGES.conform(
        pa.table(
            {
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
            }
        )
    )
    return nodes_t, edges_t
