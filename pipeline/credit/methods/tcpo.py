"""TCPO: turn-level credit from per-turn verifier scores (spec section 3; paper sections 3.0.1-3.3).

Reads top to bottom next to the paper; `# Eq. n` marks the line that implements (n) below. Every array is one
row per (trajectory i, turn k), rows in (trajectory, turn) order; symbols are names:

    r        r_{i,k}       per-turn verifier score in [0,1] (steps.verifier_score of the turn's assistant step)
 (1) m_best   m_{i,k}       max_{t<k} r_{i,t}, m_{i,1} = 0
 (2) delta    Delta_{i,k}   [r - m]_+
 (3) i_succ   I^succ        1[m >= tau]
 (4) i_keep   I^keep        I^succ * 1[Delta = 0] * 1[r >= m]
 (5) c_ret                  alpha_plus*Delta + alpha_keep*I^keep - alpha_minus*I^succ*[m - r]_+
 (6) b_gate   b_{i,k}       1[m < tau] * 1[Delta = 0]
 (7) u_future u_{i,k}       max_{t>=k} r_{i,t}
 (8) u_bar_peers            leave-one-out mean of u_{j,k} over eligible peers j != i of the same (prompt, turn)
 (9) c_hin                  b * (u - u_bar_peers), 0 when no eligible peer
(10) xi       xi_{i,k}      surprisal: -mean behaviour logprob over the turn's assistant tokens
(11) g_sel    g_{i,k}       1[(i,k) in I_x], I_x = Top-L of B_x = {b = 1} by xi (per prompt)
(12) c_cf                   q_0 - mean(q_1..q_M), q_0 = r
(13) eta      eta_{i,k}     1[Var(q_0..q_M) > 0]
(14) c_del                  c_hin + g*eta*(c_cf - c_hin)
(15) phi                    c_ret + mu*c_del
(16) phi_norm               z-score of phi within (prompt, turn): (phi - mean)/(std_unbiased + eps);
                           skipped when the (prompt, turn) set has fewer than 2 trajectories; constant -> 0
(17) A                      gamma^(k-1) * phi_norm, broadcast to the turn's assistant tokens

The ablation variants of Tables 3 and 4 (traj_reward, turn_reward, delta_reward, tcpo_retro, tcpo_retro_hin,
tcpo_random_cf, tcpo_all_cf) share the same per-(prompt, turn) Norm and gamma^(k-1).

Counterfactual scores come from the `counterfactuals` annotation table (pipeline/counterfactual). The
Top-L selection (`select_cf_turns`) is shared with that stage, so the stage samples exactly the turns the
estimator gates on. A selected turn without usable counterfactual rows falls back to hindsight (eta = 0) and
is counted in the result's notes; so is every other degraded case.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import numpy as np
import polars as pl
from pydantic import Field

from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import group_normalize
from pipeline.credit.registry import Requirement, estimator
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings

Selection = Literal["top", "random", "all"]


@register_settings("tcpo")
class TCPOSettings(StageSettings):
    tau: float = Field(1.0, description="success threshold on the verifier score: I^succ = 1[m >= tau] [INF]")
    alpha_plus: float = Field(1.0, description="weight of progress Delta in c_ret [INF]")
    alpha_keep: float = Field(0.5, description="weight of the keep indicator in c_ret (alpha_0) [INF]")
    alpha_minus: float = Field(1.0, description="weight of post-success regression in c_ret [INF]")
    mu: float = Field(1.0, description="weight of delayed credit c_del in phi [INF]")
    gamma: float = Field(0.9, description="early-turn prior: A = gamma^(k-1) * Norm(phi) [INF]")
    L: int = Field(5, ge=0, description="counterfactual turns per prompt (Top-L of the eligible turns)")
    M: int = Field(8, ge=1, description="alternatives sampled per selected turn")
    norm_eps: float = Field(1e-6, description="added to the unbiased std in the (prompt, turn) z-score [INF]")
    selection: Selection = Field(
        "top",
        description="which eligible turns get counterfactuals: top (Top-L by surprisal), random "
        "(Rand-L, seeded), all (every eligible turn)",
    )
    seed: int = Field(0, description="seed of the random selection (tcpo_random_cf)")
    cf_min_ok: int = Field(
        1,
        ge=1,
        description="a selected turn needs at least this many alternatives with status ok, else it "
        "falls back to hindsight (eta = 0) [INF]",
    )
    missing_score: Literal["error", "zero"] = Field(
        "error",
        description="an assistant turn without verifier_score: error (names traj and turn) or "
        "score it 0 (counted in notes)",
    )


# ---- per-(trajectory, turn) inputs -----------------------------------------------------------------


def turn_table(batch: CreditBatch, missing_score: str = "error") -> tuple[pl.DataFrame, dict[str, float]]:
    """One row per (trajectory, turn) in (trajectory, turn) order: ids, r, xi, and the turn's step rows.

    A turn made of several assistant steps takes the last non-null score and the surprisal over all of them."""
    notes: dict[str, float] = {}
    steps = batch.assistant_steps()
    # surprisal sums per step: one bincount over the assistant tokens that have a behaviour logprob
    lp = batch.logprobs.on_mask()
    has_lp = np.isfinite(lp)
    lp_step = batch.mask_steps()[has_lp]
    nlp_sum = np.bincount(lp_step, weights=-lp[has_lp], minlength=batch.n_steps)
    nlp_cnt = np.bincount(lp_step, minlength=batch.n_steps)
    rows = steps["step_row"].to_numpy()
    turns = (
        steps.select("step_row", "traj_index", "group_index", "turn", "verifier_score")
        .with_columns(pl.Series("nlp_sum", nlp_sum[rows]), pl.Series("nlp_cnt", nlp_cnt[rows]))
        .group_by("traj_index", "turn", maintain_order=True)
        .agg(
            pl.col("group_index").first(),
            pl.col("verifier_score").drop_nulls().last().alias("r"),
            pl.col("nlp_sum").sum(),
            pl.col("nlp_cnt").sum(),
        )
        .sort("traj_index", "turn")
        .join(batch.trajectories.select("traj_index", "traj_id", "group_id"), on="traj_index", how="left")
        .with_columns(
            pl.when(pl.col("nlp_cnt") > 0)
            .then(pl.col("nlp_sum") / pl.col("nlp_cnt"))
            .otherwise(None)
            .alias("xi")  # Eq. 10
        )
    )
    missing = turns.filter(pl.col("r").is_null())
    if missing.height:
        if missing_score == "error":
            t = missing.row(0, named=True)
            raise ValueError(
                f"tcpo: trajectory {t['traj_id']!r} turn {t['turn']} has no verifier_score "
                f"({missing.height} turns in this batch lack one); set tcpo.missing_score=zero to score them 0"
            )
        notes["missing_score_zeroed"] = float(missing.height)
        turns = turns.with_columns(pl.col("r").fill_null(0.0))
    bad = turns.filter((pl.col("r") < 0) | (pl.col("r") > 1) | pl.col("r").is_nan())
    if bad.height:
        t = bad.row(0, named=True)
        raise ValueError(
            f"tcpo: trajectory {t['traj_id']!r} turn {t['turn']} has verifier_score {t['r']} outside [0,1]"
        )
    n_no_lp = int(turns["xi"].null_count())
    if n_no_lp:
        notes["surprisal_missing"] = float(n_no_lp)
    return turns.drop("nlp_sum", "nlp_cnt"), notes


def retro_hindsight_frame(turns: pl.DataFrame, tau: float) -> pl.DataFrame:
    """Add m_best, delta, b_gate, u_future and the eligible-peer sums (window expressions, no loops)."""
    per_traj = "traj_index"
    per_prompt_turn = ["group_index", "turn"]
    out = (
        turns.with_columns(
            # m_{i,k} = max_{t<k} r: shift by one turn, running max; m_{i,1} = 0 (r >= 0, so max with 0 is exact)
            pl.col("r").shift(1).cum_max().over(per_traj).fill_null(0.0).alias("m_best"),  # Eq. 1
            # u_{i,k} = max_{t>=k} r: running max from the last turn backwards
            pl.col("r").cum_max(reverse=True).over(per_traj).alias("u_future"),  # Eq. 7
        )
        .with_columns(
            (pl.col("r") - pl.col("m_best")).clip(lower_bound=0.0).alias("delta"),  # Eq. 2
        )
        .with_columns(
            ((pl.col("m_best") < tau) & (pl.col("delta") == 0.0)).cast(pl.Float64).alias("b_gate"),  # Eq. 6
        )
        .with_columns(
            (pl.col("b_gate") * pl.col("u_future")).sum().over(per_prompt_turn).alias("_sum_bu"),
            pl.col("b_gate").sum().over(per_prompt_turn).alias("_n_b"),
            pl.len().over(per_prompt_turn).alias("n_peers_all"),
        )
    )
    return out


def select_cf_turns(turns: pl.DataFrame, L: int, selection: str = "top", seed: int = 0) -> np.ndarray:
    """g_{i,k}: the eligible turns (b_gate = 1) that get counterfactuals, per prompt (group_id).

    top: the L eligible turns with the highest surprisal xi; ties (and turns without logprobs, which rank
    last) broken by (traj_id, turn). random: L eligible turns by a seeded hash of (seed, group_id, traj_id,
    turn), so the stage and the estimator agree without sharing state. all: every eligible turn.
    `turns` needs group_id, traj_id, turn, b_gate, xi. Returns a bool array aligned with its rows."""
    eligible = turns["b_gate"].to_numpy() > 0
    if selection == "all":
        return eligible
    frame = turns.select("group_id", "traj_id", "turn", "b_gate", "xi").with_row_index("_row")
    frame = frame.filter(pl.col("b_gate") > 0)
    if selection == "top":
        frame = frame.with_columns(pl.col("xi").fill_nan(None)).sort(
            ["group_id", "xi", "traj_id", "turn"], descending=[False, True, False, False], nulls_last=True
        )
    elif selection == "random":
        keys = [
            int.from_bytes(hashlib.blake2b(f"{seed}|{g}|{t}|{k}".encode(), digest_size=8).digest(), "little")
            for g, t, k in zip(frame["group_id"], frame["traj_id"], frame["turn"], strict=True)
        ]
        frame = frame.with_columns(pl.Series("_key", keys, dtype=pl.UInt64)).sort(
            ["group_id", "_key", "traj_id", "turn"]
        )
    else:
        raise ValueError(f"tcpo: unknown selection {selection!r} (top | random | all)")
    chosen = frame.filter(pl.int_range(pl.len()).over("group_id") < L)["_row"].to_numpy()
    g_sel = np.zeros(turns.height, dtype=bool)
    g_sel[chosen] = True
    return g_sel


def cf_scores(turns: pl.DataFrame, counterfactuals: pl.DataFrame | None, min_ok: int = 1) -> pl.DataFrame:
    """Per (traj_id, turn) of `turns`: q_mean (mean of the ok alternatives' scores), q_min, q_max, n_ok."""
    if counterfactuals is None or counterfactuals.height == 0:
        return turns.select(
            pl.lit(None, pl.Float64).alias("q_mean"),
            pl.lit(None, pl.Float64).alias("q_min"),
            pl.lit(None, pl.Float64).alias("q_max"),
            pl.lit(0, pl.Int64).alias("n_ok"),
        )
    ok = counterfactuals.filter((pl.col("status") == "ok") & pl.col("score").is_not_null())
    per_turn = (
        ok.group_by("traj_id", "turn")
        .agg(
            pl.col("score").mean().alias("q_mean"),
            pl.col("score").min().alias("q_min"),
            pl.col("score").max().alias("q_max"),
            pl.len().cast(pl.Int64).alias("n_ok"),
        )
        .with_columns(pl.col("traj_id").cast(pl.String), pl.col("turn").cast(pl.Int64))
    )
    joined = turns.select(pl.col("traj_id").cast(pl.String), pl.col("turn").cast(pl.Int64)).join(
        per_turn, on=["traj_id", "turn"], how="left", maintain_order="left"
    )
    return joined.select(
        pl.when(pl.col("n_ok") >= min_ok).then(pl.col(c)).otherwise(None).alias(c)
        for c in ("q_mean", "q_min", "q_max")
    ).with_columns(joined["n_ok"].fill_null(0).alias("n_ok"))


# ---- the estimator ---------------------------------------------------------------------------------

Variant = Literal["traj_reward", "turn_reward", "delta_reward", "retro", "retro_hin", "full"]


def tcpo_credit(
    batch: CreditBatch, s: TCPOSettings, variant: Variant = "full", selection: str | None = None
) -> CreditResult:
    turns, notes = turn_table(batch, s.missing_score)
    if turns.height == 0:
        return CreditResult.per_token(np.zeros(batch.n_tokens), notes=notes)
    turns = retro_hindsight_frame(turns, s.tau)
    r = turns["r"].to_numpy().astype(np.float64)
    k = turns["turn"].to_numpy().astype(np.int64)
    retro = _retro_credit(turns, r, s)
    hin = _hindsight_credit(turns, notes)
    cf = _counterfactual_credit(batch, turns, r, s, variant, selection, notes)
    c_del = hin["c_hin"] + cf["g_sel"] * cf["eta"] * (np.nan_to_num(cf["c_cf"]) - hin["c_hin"])  # Eq. 14
    phi = _turn_signal(turns, r, retro["c_ret"], hin["c_hin"], c_del, s.mu, variant)
    phi_norm, a_turn = _normalized_advantage(turns, k, phi, s, notes)

    per_turn = {"score": r, "a_hat": a_turn, "phi": phi, "phi_norm": phi_norm}
    if variant in ("retro", "retro_hin", "full"):
        per_turn |= retro
    if variant in ("retro_hin", "full"):
        per_turn |= hin | {"c_del": c_del if variant == "full" else hin["c_hin"]}
    if variant == "full":
        per_turn |= cf
    return _broadcast(batch, turns, per_turn, notes)


def _retro_credit(turns: pl.DataFrame, r: np.ndarray, s: TCPOSettings) -> dict[str, np.ndarray]:
    """Retrospective credit (3.0.1): m_best, delta and c_ret per turn."""
    m_best = turns["m_best"].to_numpy()
    delta = turns["delta"].to_numpy()
    i_succ = (m_best >= s.tau).astype(np.float64)  # Eq. 3
    i_keep = i_succ * (delta == 0.0) * (r >= m_best)  # Eq. 4
    regression = i_succ * np.maximum(m_best - r, 0.0)
    c_ret = s.alpha_plus * delta + s.alpha_keep * i_keep - s.alpha_minus * regression  # Eq. 5
    return {"m_best": m_best, "delta": delta, "c_ret": c_ret}


def _hindsight_credit(turns: pl.DataFrame, notes: dict[str, float]) -> dict[str, np.ndarray]:
    """Hindsight delayed credit: leave-one-out mean over eligible same-prompt same-turn peers (b_gate,
    u_future, c_hin per turn); counts the gated turns without a peer in `notes`."""
    b_gate = turns["b_gate"].to_numpy()
    u_future = turns["u_future"].to_numpy()
    n_peers = turns["_n_b"].to_numpy() - b_gate  # eligible peers j != i
    sum_peers = turns["_sum_bu"].to_numpy() - b_gate * u_future
    u_bar_peers = np.divide(
        sum_peers, n_peers, out=np.full_like(sum_peers, np.nan), where=n_peers > 0
    )  # Eq. 8
    c_hin = np.where((b_gate > 0) & (n_peers > 0), u_future - np.nan_to_num(u_bar_peers), 0.0)  # Eq. 9
    notes["hindsight_no_peer"] = float(((b_gate > 0) & (n_peers == 0)).sum())
    return {"b_gate": b_gate, "u_future": u_future, "c_hin": c_hin}


def _counterfactual_credit(
    batch: CreditBatch,
    turns: pl.DataFrame,
    r: np.ndarray,
    s: TCPOSettings,
    variant: Variant,
    selection: str | None,
    notes: dict[str, float],
) -> dict[str, np.ndarray]:
    """Counterfactual credit with the non-degeneracy gate (surprisal, c_cf, g_sel, eta per turn): computed for
    the full variant only (c_cf NaN, g_sel and eta 0 otherwise); its counts go to `notes`."""
    xi = turns["xi"].fill_null(np.nan).to_numpy().astype(np.float64)
    c_cf = np.full(len(r), np.nan)
    g_sel = np.zeros(len(r))
    eta = np.zeros(len(r))
    if variant == "full":
        g_sel = select_cf_turns(turns, s.L, selection or s.selection, s.seed).astype(np.float64)  # Eq. 11
        q = cf_scores(turns, batch.annotation("counterfactuals"), s.cf_min_ok)
        q_mean = q["q_mean"].fill_null(np.nan).to_numpy()
        have_q = np.isfinite(q_mean)
        c_cf = np.where(have_q, r - q_mean, np.nan)  # Eq. 12, q_0 = r_{i,k}
        q_lo = np.minimum(q["q_min"].fill_null(np.nan).to_numpy(), r)
        q_hi = np.maximum(q["q_max"].fill_null(np.nan).to_numpy(), r)
        eta = (have_q & (g_sel > 0) & (q_hi - q_lo > 0)).astype(np.float64)  # Eq. 13: Var(q_0..q_M) > 0
        notes["cf_selected"] = float(g_sel.sum())
        notes["cf_missing_fallback"] = float(((g_sel > 0) & ~have_q).sum())
        notes["cf_degenerate"] = float(((g_sel > 0) & have_q & (eta == 0)).sum())
        notes["cf_used"] = float(eta.sum())
    return {"surprisal": xi, "c_cf": c_cf, "g_sel": g_sel, "eta": eta}


def _turn_signal(
    turns: pl.DataFrame,
    r: np.ndarray,
    c_ret: np.ndarray,
    c_hin: np.ndarray,
    c_del: np.ndarray,
    mu: float,
    variant: Variant,
) -> np.ndarray:
    """The variant's raw turn signal phi."""
    if variant == "traj_reward":  # [INF] best-turn reward max_k r_{i,k} on every turn
        return turns.select(pl.col("r").max().over("traj_index"))["r"].to_numpy()
    if variant == "turn_reward":
        return r.copy()
    if variant == "delta_reward":  # r_{i,k} - r_{i,k-1}, r_{i,0} = 0
        return r - turns.select(pl.col("r").shift(1).over("traj_index").fill_null(0.0))["r"].to_numpy()
    if variant == "retro":
        return c_ret
    if variant == "retro_hin":
        return c_ret + mu * c_hin
    return c_ret + mu * c_del  # Eq. 15


def _normalized_advantage(
    turns: pl.DataFrame, k: np.ndarray, phi: np.ndarray, s: TCPOSettings, notes: dict[str, float]
) -> tuple[np.ndarray, np.ndarray]:
    """Norm within (prompt, turn) and the early-turn prior: (phi_norm, a_hat) per turn."""
    key = turns["group_index"].to_numpy().astype(np.int64) * (int(k.max()) + 1) + k
    _, prompt_turn = np.unique(key, return_inverse=True)
    # Eq. 16: z-score within (prompt, turn), unbiased std; skipped below 2 members; constant gives exactly 0
    phi_norm = group_normalize(phi, prompt_turn.reshape(-1), eps=s.norm_eps, singleton="keep")
    notes["norm_skipped_turns"] = float((turns["n_peers_all"].to_numpy() < 2).sum())
    a_turn = s.gamma ** (k - 1).astype(np.float64) * phi_norm  # Eq. 17
    return phi_norm, a_turn


def _broadcast(
    batch: CreditBatch, turns: pl.DataFrame, per_turn: dict[str, np.ndarray], notes: dict[str, float]
) -> CreditResult:
    """Per-turn values onto every assistant step of the turn (components) and its tokens (advantage)."""
    turn_row = turns.select("traj_index", "turn").with_row_index("_turn_row")
    steps = batch.steps.with_row_index("step_row").select("step_row", "traj_index", "turn", "is_assistant")
    idx = steps.join(turn_row, on=["traj_index", "turn"], how="left", maintain_order="left")
    rows = idx["_turn_row"].fill_null(-1).to_numpy().astype(np.int64)
    on_turn = (rows >= 0) & idx["is_assistant"].to_numpy()
    components = {}
    for name, values in per_turn.items():
        comp = np.full(batch.n_steps, np.nan)
        comp[on_turn] = np.asarray(values, dtype=np.float64)[rows[on_turn]]
        components[name] = comp
    adv_step = np.nan_to_num(components["a_hat"], nan=0.0)
    return CreditResult.per_step(batch, adv_step, components, notes=notes)


# ---- registered methods: TCPO and the ablations of Tables 3 and 4 ----------------------------------


def _scores_required(config) -> bool:
    return config.settings(TCPOSettings).missing_score == "error"


# the components each variant fills (tcpo_credit: per_turn)
BASE = ("score", "a_hat", "phi", "phi_norm")
RETRO = (*BASE, "m_best", "delta", "c_ret")
RETRO_HIN = (*RETRO, "b_gate", "u_future", "c_hin", "c_del")
FULL = (*RETRO_HIN, "surprisal", "c_cf", "g_sel", "eta")

# every TCPO variant reads per-turn verifier scores r_{i,k} (unless missing ones are scored 0)
TURN_SCORES = Requirement(
    "verifier_score", "per-turn verifier scores (or tcpo.missing_score=zero)", _scores_required
)


@estimator(
    "tcpo",
    settings="tcpo",
    needs=("counterfactuals",),
    step_columns=("logprobs",),
    requires=(TURN_SCORES,),
    components=FULL,
)
def tcpo(batch: CreditBatch, settings: TCPOSettings) -> CreditResult:
    """TCPO: retrospective + hindsight + Top-L counterfactual credit, normalised per (prompt, turn), gamma^(k-1)."""
    return tcpo_credit(batch, settings, "full")


@estimator(
    "tcpo_random_cf",
    settings="tcpo",
    needs=("counterfactuals",),
    step_columns=("logprobs",),
    requires=(TURN_SCORES,),
    components=FULL,
)
def tcpo_random_cf(batch: CreditBatch, settings: TCPOSettings) -> CreditResult:
    """TCPO with Rand-L counterfactual selection (Table 4), seeded by tcpo.seed."""
    return tcpo_credit(batch, settings, "full", selection="random")


@estimator(
    "tcpo_all_cf",
    settings="tcpo",
    needs=("counterfactuals",),
    step_columns=("logprobs",),
    requires=(TURN_SCORES,),
    components=FULL,
)
def tcpo_all_cf(batch: CreditBatch, settings: TCPOSettings) -> CreditResult:
    """TCPO with counterfactuals on every eligible turn (Table 4, All CF)."""
    return tcpo_credit(batch, settings, "full", selection="all")


@estimator(
    "tcpo_retro_hin",
    settings="tcpo",
    step_columns=("logprobs",),
    requires=(TURN_SCORES,),
    components=RETRO_HIN,
)
def tcpo_retro_hin(batch: CreditBatch, settings: TCPOSettings) -> CreditResult:
    """Table 3 'Retro + Hin.': phi = c_ret + mu*c_hin (no counterfactuals)."""
    return tcpo_credit(batch, settings, "retro_hin")


@estimator(
    "tcpo_retro", settings="tcpo", step_columns=("logprobs",), requires=(TURN_SCORES,), components=RETRO
)
def tcpo_retro(batch: CreditBatch, settings: TCPOSettings) -> CreditResult:
    """Table 3 'Retro': phi = c_ret."""
    return tcpo_credit(batch, settings, "retro")


@estimator(
    "delta_reward", settings="tcpo", step_columns=("logprobs",), requires=(TURN_SCORES,), components=BASE
)
def delta_reward(batch: CreditBatch, settings: TCPOSettings) -> CreditResult:
    """Table 3 'Delta reward': phi = r_{i,k} - r_{i,k-1} (r_{i,0} = 0), TCPO's Norm and gamma^(k-1)."""
    return tcpo_credit(batch, settings, "delta_reward")


@estimator(
    "turn_reward", settings="tcpo", step_columns=("logprobs",), requires=(TURN_SCORES,), components=BASE
)
def turn_reward(batch: CreditBatch, settings: TCPOSettings) -> CreditResult:
    """Table 3 'Turn reward': phi = r_{i,k}, TCPO's Norm and gamma^(k-1)."""
    return tcpo_credit(batch, settings, "turn_reward")


@estimator(
    "traj_reward", settings="tcpo", step_columns=("logprobs",), requires=(TURN_SCORES,), components=BASE
)
def traj_reward(batch: CreditBatch, settings: TCPOSettings) -> CreditResult:
    """Table 3 'Traj. reward' [INF]: phi = best-turn max_k r_{i,k} on every turn, TCPO's Norm and gamma^(k-1)."""
    return tcpo_credit(batch, settings, "traj_reward")
