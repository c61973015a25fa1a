"""GiGPO (spec 2.4; Feng et al., verl-agent `compute_gigpo_outcome_advantage`). One row per assistant turn.

Episode term, over all step rows of the prompt group (compute_mean_std_cross_steps=True):
    (1) A^E_i = (R_i - mu) / (sigma + eps)   (mean_std_norm)   or   R_i - mu   (mean_norm);  sigma unbiased.
    A group with one trajectory (or one step row) has mu = 0, sigma = 1.
Step return, per trajectory over its turns:
    (2) r_{i,k} = step reward (verifier_score by default) - invalid_action_penalty_coef * 1[invalid]
    (3) G_{i,k} = sum_{k' >= k} gamma^(k'-k) r_{i,k'}
Step groups, within the prompt group, by the anchor observation (the content of the non-assistant step(s)
right before the turn, joined by newlines): exact match, or with `enable_similarity` the first cluster whose
representative has difflib.SequenceMatcher ratio >= similarity_thresh.
    (4) A^S = G - mean_sg   (or / (std_sg + eps) in mean_std_norm);  a singleton step group gives A^S = 0.
    (5) A   = A^E + omega * A^S, broadcast to the turn's tokens.
An action is invalid when its assistant step has is_error = true."""

from __future__ import annotations

import difflib
import itertools
from typing import Literal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import (
    group_moments,
    group_normalize,
    segment_bounds,
    segment_discounted_cumsum,
    segment_start_rows,
)
from pipeline.credit.registry import estimator
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings


@register_settings("gigpo")
class GiGPOSettings(StageSettings):
    mode: Literal["mean_std_norm", "mean_norm"] = Field(
        "mean_std_norm", description="normalisation of A^E and A^S"
    )
    eps: float = Field(1e-6, description="added to the unbiased std")
    gamma: float = Field(0.95, description="step-return discount")
    step_advantage_w: float = Field(1.0, description="omega, weight of the step term")
    step_reward: Literal["verifier_score", "outcome"] = Field(
        "verifier_score",
        description="r_{i,k}: the turn's verifier score (null -> 0), or R_i on the last turn",
    )
    invalid_action_penalty_coef: float = Field(
        0.1, description="subtracted from r when the action is invalid"
    )
    enable_similarity: bool = Field(False, description="cluster anchors by similarity instead of exact match")
    similarity_thresh: float = Field(0.9, description="SequenceMatcher ratio to join a cluster (IAPO: 0.9)")


def anchor_observations(batch: CreditBatch) -> pl.DataFrame:
    """Assistant steps (`step_row`, traj_index, group_index, turns_before) with their anchor observation text:
    the contents (nulls skipped) of the non-assistant steps between the previous assistant step of the
    trajectory (or its start) and this one, joined by newlines; "" when there are none.

    Whole-column: each anchor is a run of rows, so a one-step anchor is that step's content (a take) and only
    the anchors of several steps are joined."""
    steps = batch.step_table
    is_asst = batch.step_is_assistant
    traj = batch.step_traj
    n = len(is_asst)
    idx = np.arange(n)
    traj_start = segment_start_rows(traj)
    # the last assistant row before each row (-1: none)
    last_asst = np.maximum.accumulate(np.where(is_asst, idx, -1)) if n else idx
    prev_asst = np.concatenate([[-1], last_asst[:-1]]) if n else idx
    rows = np.flatnonzero(is_asst)
    run_start = np.maximum(prev_asst[rows] + 1, traj_start[rows])
    run_len = rows - run_start
    # the contents in Arrow (a take of the anchors' rows: no frame of every step's text)
    content = steps.column("content") if "content" in steps.column_names else pa.nulls(n, pa.string())
    # a null index (no observation before the turn) takes a null: "" like a null content
    first = pa.array(np.where(run_len > 0, run_start, 0), mask=run_len == 0)
    anchor = pl.Series("anchor", pc.fill_null(pc.take(content, first), "")).cast(pl.String)
    multi = np.flatnonzero(run_len > 1)
    if len(multi):  # several observation steps: join them (a loop over those anchors, not over tokens)
        lens = run_len[multi]
        member = np.repeat(run_start[multi] - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
        texts = iter(pc.take(content, pa.array(member)).to_pylist())  # the runs' rows only, in order
        joined = ["\n".join(t for t in itertools.islice(texts, k) if t is not None) for k in lens.tolist()]
        anchor = anchor.scatter(multi, pl.Series(joined, dtype=pl.String))
    turns_before = idx[: len(rows)] - np.searchsorted(
        rows, traj_start[rows]
    )  # assistant steps before, same trajectory
    take = pa.array(rows)
    return pl.DataFrame(
        {
            "step_row": pl.Series(rows, dtype=pl.UInt32),
            "traj_index": pl.Series(traj[rows], dtype=pl.Int64),
            "group_index": pl.Series(batch.traj_group[traj[rows]], dtype=pl.Int64),
            "turns_before": pl.Series(turns_before, dtype=pl.Int64),
            "is_error": pl.Series(pc.take(steps.column("is_error"), take))
            if "is_error" in steps.column_names
            else pl.Series([None] * len(rows), dtype=pl.Boolean),
            "verifier_score": pl.Series(pc.take(steps.column("verifier_score"), take)).cast(pl.Float64),
            "anchor": anchor,
        }
    )


def step_groups(rows: pl.DataFrame, enable_similarity: bool, thresh: float) -> np.ndarray:
    """Dense step-group id per row: exact anchor match within the prompt group, or similarity clusters."""
    if not enable_similarity:
        # exact: (prompt group, hash of the anchor text), every text checked against its key's first text (a
        # collision falls back to numbering the distinct texts); numbered in order of first appearance
        anchor, group = rows["anchor"], rows["group_index"].to_numpy()
        with np.errstate(over="ignore"):
            key = anchor.hash(seed=0).to_numpy() ^ (group.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        rep = first[inverse]
        if not ((anchor == anchor.gather(rep)).all() and np.array_equal(group, group[rep])):
            # a 64-bit collision: number the distinct texts exactly instead
            text_id = anchor.unique(maintain_order=True)
            tid = anchor.replace_strict(text_id, np.arange(len(text_id)), return_dtype=pl.Int64).to_numpy()
            _, first, inverse = np.unique(
                group.astype(np.int64) * max(len(text_id), 1) + tid, return_index=True, return_inverse=True
            )
        order = np.argsort(np.argsort(first))  # number the keys by their first row
        return order[inverse.reshape(-1)].astype(np.int64)
    uniq = rows.select("group_index", "anchor").unique(maintain_order=True).with_row_index("anchor_id")
    clusters: dict[int, list[tuple[str, int]]] = {}
    cluster = np.empty(uniq.height, dtype=np.int64)
    for i, (g, text) in enumerate(zip(uniq["group_index"].to_list(), uniq["anchor"].to_list(), strict=True)):
        members = clusters.setdefault(g, [])
        match = next(
            (cid for rep, cid in members if difflib.SequenceMatcher(None, text, rep).ratio() >= thresh), None
        )
        if match is None:
            match = i
            members.append((text, i))
        cluster[i] = match
    uniq = uniq.with_columns(pl.Series("anchor_id", cluster))
    return rows.join(uniq, on=["group_index", "anchor"], how="left", maintain_order="left")[
        "anchor_id"
    ].to_numpy()


@estimator(
    "gigpo",
    settings="gigpo",
    step_columns=("content",),
    components=("a_hat", "a_episode", "a_step", "score"),
)
def gigpo(batch: CreditBatch, settings: GiGPOSettings) -> CreditResult:
    """Episode-level group advantage plus anchor-state step advantage."""
    rows = anchor_observations(batch)
    step_row = rows["step_row"].to_numpy()
    traj = rows["traj_index"].to_numpy()
    group = rows["group_index"].to_numpy()
    eps, std_norm = settings.eps, settings.mode == "mean_std_norm"

    # Eq. 1: A^E over the step rows of the prompt group (trajectories weighted by their number of steps)
    R = batch.rewards()[traj]
    mu, sigma, n_rows = group_moments(R, group, batch.n_groups)
    n_traj = np.bincount(batch.traj_group, minlength=batch.n_groups)[group]
    single = (n_traj < 2) | (n_rows < 2)
    mu, sigma = np.where(single, 0.0, mu), np.where(single, 1.0, sigma)
    A_E = (R - mu) / (sigma + eps) if std_norm else R - mu

    if settings.step_reward == "verifier_score":  # Eq. 2
        score = rows["verifier_score"].to_numpy().astype(np.float64)  # (null: NaN)
        r = np.where(np.isnan(score), 0.0, score)
    else:
        _, last = segment_bounds(traj)
        r = np.where(last, R, 0.0)
    r = r - settings.invalid_action_penalty_coef * rows["is_error"].fill_null(False).to_numpy()
    G = segment_discounted_cumsum(r, traj, settings.gamma)  # Eq. 3

    # Eq. 4: A^S within step groups (anchor-state groups); a singleton step group gives 0
    sg = step_groups(rows, settings.enable_similarity, settings.similarity_thresh)
    A_S = group_normalize(G, sg, eps=eps, norm_by_std=std_norm, singleton="zero")
    sg_n = np.bincount(sg)[sg] if len(sg) else np.zeros(0)

    A = A_E + settings.step_advantage_w * A_S  # Eq. 5
    per_step = {name: np.full(batch.n_steps, np.nan) for name in ("a_hat", "a_episode", "a_step", "score")}
    for name, values in (("a_hat", A), ("a_episode", A_E), ("a_step", A_S), ("score", G)):
        per_step[name][step_row] = values
    return CreditResult.per_step(
        batch,
        np.nan_to_num(per_step["a_hat"]),
        per_step,
        notes={"step_groups": float(len(np.unique(sg))), "singleton_step_groups": float(np.sum(sg_n < 2))},
    )
