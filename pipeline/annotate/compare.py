"""Agreement between two IAPO annotators on the same trajectories (the paper's Table 4 figures).

* edge F1: canonical typed edge sets (traj, src, dst, type), F1 = 2|A n B| / (|A| + |B|) (symmetric);
* source Jaccard [INF]: per consuming action, Jaccard of its resolved source-action sets (untyped), averaged
  over the actions that have a source under either annotator;
* Cohen's kappa on the error flags e_i (all actions);
* Spearman rho of m+ and of m- (computed by the iapo refiner's own functions on the same actions and lengths);
* sign agreement of routed advantages [INF]: routing preserves the sign of A_hat, so the routed advantages
  A_hat * w are compared by the sign of their change from flat credit, sign(A_hat (w - 1)), over actions with
  A_hat != 0 (|w - 1| < 1e-9 counts as 0). A_hat is GRPO's group-normalised reward.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.credit.methods.iapo import IAPOSettings, graph_features, route_weights
from pipeline.credit.ops import group_normalize


def _actions(steps: pa.Table) -> pl.DataFrame:
    lengths = pc.list_value_length(steps.column("token_ids")).to_numpy(zero_copy_only=False)
    s = pl.DataFrame(steps.select(["traj_id", "step_idx", "role", "turn"])).with_columns(
        pl.Series("L", lengths).cast(pl.Float64)
    )
    return (
        s.filter((pl.col("role") == "assistant") & (pl.col("L") > 0))
        .sort("traj_id", "step_idx")
        .select("traj_id", pl.col("turn").cast(pl.Int64), "L")
    )


def _ranks(x: np.ndarray) -> np.ndarray:
    return pl.Series(x).rank("average").to_numpy().astype(np.float64)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def cohen_kappa(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=bool)
    b = np.asarray(b, dtype=bool)
    if len(a) == 0:
        return float("nan")
    po = float(np.mean(a == b))
    pa_, pb_ = a.mean(), b.mean()
    pe = pa_ * pb_ + (1 - pa_) * (1 - pb_)
    if pe >= 1.0:
        return 1.0 if po == 1.0 else float("nan")
    return float((po - pe) / (1 - pe))


def _routing(
    actions: pl.DataFrame,
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    a_sign: np.ndarray,
    traj_index: dict[str, int],
    s: IAPOSettings,
) -> dict[str, np.ndarray]:
    feats, _ = graph_features(actions.select("traj_id", "turn"), nodes, edges)
    seg = np.array([traj_index[t] for t in actions["traj_id"].to_list()], dtype=np.int64)
    out = route_weights(
        feats["phi_plus"], feats["phi_minus"], actions["L"].to_numpy(), seg, len(traj_index), a_sign, s
    )
    out["e"] = feats["e"]
    return out


def compare(
    trajectories: pa.Table,
    steps: pa.Table,
    nodes_a: pa.Table,
    edges_a: pa.Table,
    nodes_b: pa.Table,
    edges_b: pa.Table,
    settings: IAPOSettings | None = None,
) -> dict[str, float]:
    s = settings or IAPOSettings()
    traj = pl.DataFrame(trajectories.select(["traj_id", "group_id", "reward"])).sort("traj_id")
    traj_index = {t: k for k, t in enumerate(traj["traj_id"].to_list())}
    groups = traj["group_id"].rank("dense").cast(pl.Int64).to_numpy() - 1
    a_hat = group_normalize(traj["reward"].to_numpy().astype(np.float64), groups)
    actions = _actions(steps).filter(pl.col("traj_id").is_in(list(traj_index)))
    na, ea, nb, eb = (pl.DataFrame(t) for t in (nodes_a, edges_a, nodes_b, edges_b))
    ra = _routing(actions, na, ea, np.sign(a_hat), traj_index, s)
    rb = _routing(actions, nb, eb, np.sign(a_hat), traj_index, s)

    def edge_set(e: pl.DataFrame) -> set[tuple]:
        return set(e.select("traj_id", "src_turn", "dst_turn", "type").unique().iter_rows())

    sa, sb = edge_set(ea), edge_set(eb)
    f1 = 2 * len(sa & sb) / (len(sa) + len(sb)) if (sa or sb) else 1.0
    src_a: dict[tuple, set] = {}
    src_b: dict[tuple, set] = {}
    for (t, i, j, _), d in [(x, src_a) for x in sa] + [(x, src_b) for x in sb]:
        d.setdefault((t, j), set()).add(i)
    keys = set(src_a) | set(src_b)
    jac = [
        len(src_a.get(k, set()) & src_b.get(k, set())) / len(src_a.get(k, set()) | src_b.get(k, set()))
        for k in keys
    ]
    seg = np.array([traj_index[t] for t in actions["traj_id"].to_list()], dtype=np.int64)
    ah = a_hat[seg]
    live = ah != 0

    def dev_sign(w: np.ndarray) -> np.ndarray:
        d = ah * (w - 1.0)
        return np.where(np.abs(w - 1.0) < 1e-9, 0.0, np.sign(d))

    sign_agree = (
        float(np.mean(dev_sign(ra["w"])[live] == dev_sign(rb["w"])[live])) if live.any() else float("nan")
    )
    return {
        "trajectories": float(len(traj_index)),
        "actions": float(actions.height),
        "edges_a": float(len(sa)),
        "edges_b": float(len(sb)),
        "edge_f1": float(f1),
        "source_jaccard": float(np.mean(jac)) if jac else 1.0,
        "error_kappa": cohen_kappa(ra["e"], rb["e"]),
        "spearman_m_plus": spearman(ra["m_plus"], rb["m_plus"]),
        "spearman_m_minus": spearman(ra["m_minus"], rb["m_minus"]),
        "routed_sign_agreement": sign_agree,
        "parse_failed_a": float(na.filter(pl.col("parse_failed").fill_null(False))["traj_id"].n_unique())
        if na.height
        else 0.0,
        "parse_failed_b": float(nb.filter(pl.col("parse_failed").fill_null(False))["traj_id"].n_unique())
        if nb.height
        else 0.0,
    }
