"""IAPO routing (spec section 4; paper Eq. 3-7): redistribute a trajectory-level advantage over the
trajectory's actions by their influence-graph features.

    d_i+ = |{j : i ->+ j}|,  d_i- = |{j : i ->- j}|,  d_i_in = u_i_dir + |{k : k ->+ i}|
    phi_i+ = log(1 + d_i+ + d_i_in),  phi_i- = log(1 + e_i (1 + d_i- + d_i_in))                   (Eq. 3)
    m_i = exp(clip(z_i, -c, c)) / ((1/L) sum_j L_j exp(clip(z_j, -c, c))),  z = (phi - phibar)/(sigma + eps)
          with the length-weighted mean and population variance                                   (Eq. 4)
    A_hat > 0:  w_i = L m_i+ exp(-beta_plus psi_i) / sum_j L_j m_j+ exp(-beta_plus psi_j),  psi = phi- - phibar-
    A_hat < 0:  w_i = m_i-  (cons, default)  or  L m_i+ exp(+beta_minus psi_i) / sum_j ...  (proj [INF])
    A_hat = 0:  w_i = 1;     token advantage A_{i,l} = A_hat w_i                                  (Eq. 7)

Whole-column over the batch: degrees are bincounts over validated edge rows, every per-trajectory sum is a
`np.bincount` with the trajectory index, per-trajectory min/max a `reduceat` over the contiguous actions.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import polars as pl
from pydantic import Field

import pipeline.annotate.settings  # noqa: F401  (registers the annotators' settings with the engine)
from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import group_moments, segment_bounds
from pipeline.credit.registry import MethodError, refiner
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings

EDGE_SIGN = {"input": 1, "success_utilization": 1, "failed_utilization": -1}


@register_settings("iapo")
class IAPOSettings(StageSettings):
    beta_plus: float = Field(
        0.05, ge=0, description="beta_+: error-evidence discount in the positive branch (Eq. 5)"
    )
    c: float = Field(0.25, gt=0, description="clip bound c of the standardised feature (Eq. 4)")
    eps: float = Field(1e-6, gt=0, description="epsilon added to the length-weighted std (Eq. 4)")
    negative_branch: Literal["cons", "proj"] = Field(
        "cons",
        description="A_hat < 0: cons = w = m_minus (paper default); proj = support prior m_plus tilted "
        "by +beta_minus * psi and renormalised ([INF] reading of the ablation 'proj. beta')",
    )
    beta_minus: float = Field(
        0.05, ge=0, description="beta_-: tilt of the projected negative branch (proj only)"
    )
    annotator: str | None = Field(
        None,
        description="use the nodes/edges rows of this annotator id (None: the batch must hold exactly one)",
    )
    traj_level_atol: float = Field(
        1e-6, gt=0, description="tolerance when checking that the base advantage is constant on a trajectory"
    )


# ---- the entry point: Eq. 3 -> 7 on the batch's actions -------------------------------------------------


@refiner(
    "iapo",
    settings="iapo",
    needs=("nodes", "edges"),
    components=("a_hat", "d_plus", "d_minus", "d_in", "phi_plus", "phi_minus", "m_plus", "m_minus", "w"),
)
def iapo(batch: CreditBatch, base: CreditResult, settings: IAPOSettings) -> CreditResult:
    """Influence-aware routing of a trajectory-level advantage over the trajectory's actions."""
    s = settings
    a_traj = trajectory_advantage(batch, base, s.traj_level_atol)  # A_hat per trajectory
    steps = batch.steps
    act_mask = (steps["is_assistant"] & (steps["n_tokens"] > 0)).to_numpy()
    act_rows = np.flatnonzero(act_mask)
    actions = steps.select("traj_id", "turn", "traj_index").filter(pl.Series(act_mask))
    seg = actions["traj_index"].to_numpy().astype(np.int64)
    L = steps["n_tokens"].to_numpy()[act_rows].astype(np.float64)
    nodes = _select_annotator(batch.annotation("nodes"), s.annotator, "nodes")
    edges = _select_annotator(batch.annotation("edges"), s.annotator, "edges")
    feats, notes = graph_features(actions, nodes, edges)  # Eq. 3
    if nodes is None and edges is None:
        notes["no_annotations"] = 1.0
    # Eq. 4-6: the bounded weights m+-, the routed w by the sign of A_hat
    routed = route_weights(feats["phi_plus"], feats["phi_minus"], L, seg, batch.n_traj, np.sign(a_traj), s)
    w_step = np.ones(batch.n_steps)
    w_step[act_rows] = routed["w"]
    tok_adv = np.where(
        batch.tok_mask, a_traj[batch.token_trajs()] * w_step[batch.token_steps()], 0.0
    )  # Eq. 7

    def per_step(values: np.ndarray) -> np.ndarray:
        out = np.full(batch.n_steps, np.nan)
        out[act_rows] = values
        return out

    comps = {
        **base.components,
        "a_hat": batch.traj_to_steps(a_traj),
        "d_plus": per_step(feats["d_plus"]),
        "d_minus": per_step(feats["d_minus"]),
        "d_in": per_step(feats["d_in"]),
        "phi_plus": per_step(feats["phi_plus"]),
        "phi_minus": per_step(feats["phi_minus"]),
        "m_plus": per_step(routed["m_plus"]),
        "m_minus": per_step(routed["m_minus"]),
        "w": per_step(routed["w"]),
    }
    return base.refined(tok_adv, comps, {**base.notes, **{f"iapo.{k}": v for k, v in notes.items()}})


# ---- Eq. 3: the influence-graph features of each action ---------------------------------------------------


def graph_features(
    actions: pl.DataFrame, nodes: pl.DataFrame | None, edges: pl.DataFrame | None
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Validated degrees and features per action row.

    `actions`: one row per action with L > 0, columns traj_id, turn (sorted by trajectory, then turn).
    Invalid edges (unknown trajectory/turn, src >= dst, unknown type) are dropped; duplicate (i, j, sign)
    edges count once (d+ and d- count distinct consumers j); an E- edge sets e_i = 1; a trajectory whose
    annotation failed to parse gets the empty graph (uniform weights)."""
    n = actions.height
    idx = actions.select("traj_id", "turn").with_columns(pl.int_range(n, dtype=pl.Int64).alias("row"))
    idx = idx.with_columns(pl.col("traj_id").cast(pl.String), pl.col("turn").cast(pl.Int64))
    notes: dict[str, float] = {}
    failed_traj = pl.Series("traj_id", [], dtype=pl.String)
    e = np.zeros(n, dtype=np.float64)
    u_dir = np.zeros(n, dtype=np.float64)
    if nodes is not None and nodes.height:
        nd = nodes.select(
            pl.col("traj_id").cast(pl.String),
            pl.col("turn").cast(pl.Int64),
            pl.col("error").cast(pl.Int64).fill_null(0),
            pl.col("u_dir").cast(pl.Int64).fill_null(0),
            pl.col("parse_failed").cast(pl.Boolean).fill_null(False)
            if "parse_failed" in nodes.columns
            else pl.lit(False).alias("parse_failed"),
        )
        failed_traj = nd.filter(pl.col("parse_failed"))["traj_id"].unique()
        joined = idx.join(nd.unique(["traj_id", "turn"], keep="first"), on=["traj_id", "turn"], how="left")
        joined = joined.sort("row")
        e = (joined["error"].fill_null(0).to_numpy() > 0).astype(np.float64)
        u_dir = joined["u_dir"].fill_null(0).to_numpy().astype(np.float64)
        notes["fallback_trajectories"] = float(len(failed_traj))
    d_plus = np.zeros(n)
    d_minus = np.zeros(n)
    d_in_edges = np.zeros(n)
    if edges is not None and edges.height:
        ed = edges.select(
            pl.col("traj_id").cast(pl.String),
            pl.col("src_turn").cast(pl.Int64),
            pl.col("dst_turn").cast(pl.Int64),
            pl.col("type").cast(pl.String),
        )
        total = ed.height
        ed = ed.with_columns(
            pl.col("type").replace_strict(EDGE_SIGN, default=0, return_dtype=pl.Int8).alias("sgn")
        )
        ed = ed.filter((pl.col("sgn") != 0) & (pl.col("src_turn") < pl.col("dst_turn")))
        if len(failed_traj):
            ed = ed.filter(~pl.col("traj_id").is_in(failed_traj.implode()))
        ed = ed.join(idx.rename({"turn": "src_turn", "row": "src"}), on=["traj_id", "src_turn"], how="inner")
        ed = ed.join(idx.rename({"turn": "dst_turn", "row": "dst"}), on=["traj_id", "dst_turn"], how="inner")
        valid = ed.height
        ed = ed.unique(["src", "dst", "sgn"])
        notes["edges"] = float(ed.height)
        notes["invalid_edges"] = float(total - valid)
        notes["duplicate_edges"] = float(valid - ed.height)
        src = ed["src"].to_numpy()
        dst = ed["dst"].to_numpy()
        pos = ed["sgn"].to_numpy() > 0
        d_plus = np.bincount(src[pos], minlength=n).astype(np.float64)
        d_minus = np.bincount(src[~pos], minlength=n).astype(np.float64)
        d_in_edges = np.bincount(dst[pos], minlength=n).astype(np.float64)
    if len(failed_traj):
        fail = idx["traj_id"].is_in(failed_traj.implode()).to_numpy()
        e = np.where(fail, 0.0, e)
        u_dir = np.where(fail, 0.0, u_dir)
    e = np.where(d_minus > 0, 1.0, e)  # d- > 0 implies e = 1
    d_in = u_dir + d_in_edges
    phi_plus = np.log1p(d_plus + d_in)  # Eq. 3
    phi_minus = np.log1p(e * (1.0 + d_minus + d_in))  # Eq. 3
    return {
        "d_plus": d_plus,
        "d_minus": d_minus,
        "d_in": d_in,
        "e": e,
        "phi_plus": phi_plus,
        "phi_minus": phi_minus,
    }, notes


# ---- Eq. 4-6: bounded weights and the routed w (flat per-action arrays, segments = trajectories) ----------


def bounded_weight(
    phi: np.ndarray, L: np.ndarray, seg: np.ndarray, n_seg: int, c: float, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 4 per segment (trajectory): (m, length-weighted mean of phi per element). `seg` is sorted."""
    L = L.astype(np.float64)
    # length-weighted mean and population variance; T = 1 or a constant feature gives z = 0 exactly (the
    # group mean is shifted: phi - phibar is exactly 0), so m = 1 exactly
    mean, sigma, Lsum = group_moments(phi, seg, n_seg, weights=L, ddof=0)
    z = (phi - mean) / (np.nan_to_num(sigma) + eps)
    ez = np.exp(np.clip(z, -c, c))
    norm = np.bincount(seg, weights=L * ez, minlength=n_seg)[seg] / np.where(Lsum > 0, Lsum, 1.0)
    return ez / norm, mean  # Eq. 4


def route_weights(
    phi_plus: np.ndarray,
    phi_minus: np.ndarray,
    L: np.ndarray,
    seg: np.ndarray,
    n_seg: int,
    a_sign: np.ndarray,
    s: IAPOSettings,
) -> dict[str, np.ndarray]:
    """Per-action m+, m-, w+, w- and the applied w (by the sign of the trajectory's A_hat)."""
    Lf = L.astype(np.float64)
    Lsum = np.bincount(seg, weights=Lf, minlength=n_seg)
    m_plus, _ = bounded_weight(phi_plus, L, seg, n_seg, s.c, s.eps)
    m_minus, mean_minus = bounded_weight(phi_minus, L, seg, n_seg, s.c, s.eps)
    psi = phi_minus - mean_minus  # exactly 0 on a constant feature (shifted mean)

    def tilted(beta: float) -> np.ndarray:
        u = m_plus * np.exp(beta * psi)
        return Lsum[seg] * u / np.bincount(seg, weights=Lf * u, minlength=n_seg)[seg]

    w_plus = tilted(-s.beta_plus) if s.beta_plus else m_plus  # Eq. 5
    w_minus = m_minus if s.negative_branch == "cons" else tilted(+s.beta_minus)  # Eq. 6
    sign = a_sign[seg]
    w = np.where(sign > 0, w_plus, np.where(sign < 0, w_minus, 1.0))
    return {"m_plus": m_plus, "m_minus": m_minus, "w_plus": w_plus, "w_minus": w_minus, "w": w}


# ---- the routed A_hat and the annotation rows --------------------------------------------------------------


def trajectory_advantage(batch: CreditBatch, base: CreditResult, atol: float) -> np.ndarray:
    """A_hat per trajectory from the base token advantages; refuses a base that is not trajectory-level."""
    a_hat = np.zeros(batch.n_traj)
    mask = batch.tok_mask
    if not mask.any():
        return a_hat
    adv = np.asarray(base.adv_per_token(), dtype=np.float64)[mask]
    traj = batch.mask_trajs()
    starts = np.flatnonzero(segment_bounds(traj)[0])
    lo = np.minimum.reduceat(adv, starts)
    hi = np.maximum.reduceat(adv, starts)
    bad = hi - lo > atol * (1.0 + np.maximum(np.abs(lo), np.abs(hi)))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        tid = batch.trajectories["traj_id"][int(traj[starts[k]])]
        raise MethodError(
            f"iapo routes a trajectory-level advantage, but the base advantage varies on trajectory {tid!r} "
            f"(min {lo[k]:.6g}, max {hi[k]:.6g}); use a trajectory-level estimator such as grpo, dr_grpo, rloo "
            "or gdpo before iapo"
        )
    a_hat[traj[starts]] = hi
    return a_hat


def _select_annotator(frame: pl.DataFrame | None, which: str | None, name: str) -> pl.DataFrame | None:
    if frame is None or frame.height == 0 or "annotator" not in frame.columns:
        return frame
    if which is not None:
        return frame.filter(pl.col("annotator") == which)
    ids = frame["annotator"].unique().to_list()
    if len(ids) > 1:
        raise MethodError(
            f"iapo: the batch's {name} hold several annotators {sorted(ids)}; "
            "choose one with --set iapo.annotator=ID"
        )
    return frame
