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
from dataclasses import dataclass
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
from schemas import one_chunk


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


@dataclass(frozen=True)
class AnchorRows:
    """The batch's assistant steps, in row order, with their anchor observations (Arrow strings: "" where the
    turn has none); one entry per assistant step."""

    step_row: np.ndarray  # int64: the step's row in the batch
    traj_index: np.ndarray  # int64: its trajectory's row
    group_index: np.ndarray  # int64: its prompt group (the batch's dense group index)
    turns_before: np.ndarray  # int64: the assistant steps before it in its trajectory
    anchor: pa.Array

    def __len__(self) -> int:
        return len(self.step_row)

    def frame(self) -> pl.DataFrame:
        """As a Polars frame (the similarity clusters; a reader's view)."""
        return pl.DataFrame(
            {
                "step_row": pl.Series(self.step_row, dtype=pl.UInt32),
                "traj_index": pl.Series(self.traj_index, dtype=pl.Int64),
                "group_index": pl.Series(self.group_index, dtype=pl.Int64),
                "turns_before": pl.Series(self.turns_before, dtype=pl.Int64),
                "anchor": pl.Series(self.anchor).cast(pl.String),
            }
        )


def anchor_observations(batch: CreditBatch) -> AnchorRows:
    """The assistant steps with their anchor observation text: the contents (nulls skipped) of the non-assistant
    steps between the previous assistant step of the trajectory (or its start) and this one, joined by
    newlines; "" when there are none.

    Whole-column, in Arrow: each anchor is a run of rows, so the anchors are one take of those rows' contents
    (the nulls dropped), laid out as a list per assistant step and joined (`binary_join`)."""
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
    # every anchor's rows end to end (each non-assistant row is in at most one run: the one before the next turn)
    ends = np.cumsum(run_len)
    member = np.repeat(run_start - ends + run_len, run_len) + np.arange(int(ends[-1]) if len(ends) else 0)
    content = steps.column("content") if "content" in steps.column_names else pa.nulls(n, pa.string())
    content = one_chunk(content)
    if not (pa.types.is_string(content.type) or pa.types.is_large_string(content.type)):
        content = content.cast(pa.large_string())
    texts = content.take(pa.array(member, pa.int64()))
    valid = texts.is_valid().to_numpy(zero_copy_only=False)
    kept = np.bincount(np.repeat(np.arange(len(rows)), run_len)[valid], minlength=len(rows))
    offsets = np.concatenate([[0], np.cumsum(kept)])
    lists = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), texts.filter(pa.array(valid)))
    anchor = pc.binary_join(lists, pa.scalar("\n", content.type))
    # the assistant steps before each, in the same trajectory
    turns_before = idx[: len(rows)] - np.searchsorted(rows, traj_start[rows])
    return AnchorRows(
        rows.astype(np.int64),
        traj[rows].astype(np.int64),
        batch.traj_group[traj[rows]].astype(np.int64),
        turns_before.astype(np.int64),
        anchor,
    )


def invalid_actions(batch: CreditBatch, step_row: np.ndarray) -> np.ndarray:
    """1.0 where the step's action is invalid (`is_error` true), else 0.0 (null or no column: valid)."""
    if "is_error" not in batch.step_table.column_names:
        return np.zeros(len(step_row))
    return batch.step_flags("is_error")[step_row].astype(np.float64)


def step_groups(rows: AnchorRows, enable_similarity: bool, thresh: float) -> np.ndarray:
    """Dense step-group id per row: exact anchor match within the prompt group, or similarity clusters;
    numbered in order of first appearance."""
    if len(rows) == 0:
        return np.zeros(0, dtype=np.int64)
    if not enable_similarity:
        # exact: Arrow numbers the distinct texts by first appearance (a hash table that compares the texts
        # themselves: no collision can merge two), then each (prompt group, text) pair gets its own id
        text_id = pc.dictionary_encode(rows.anchor).indices.to_numpy(zero_copy_only=False).astype(np.int64)
        key = rows.group_index * (int(text_id.max()) + 1) + text_id
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        order = np.argsort(np.argsort(first))  # number the keys by their first row
        return order[inverse.reshape(-1)].astype(np.int64)
    frame = rows.frame()
    uniq = frame.select("group_index", "anchor").unique(maintain_order=True).with_row_index("anchor_id")
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
    return frame.join(uniq, on=["group_index", "anchor"], how="left", maintain_order="left")[
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
    step_row, traj, group = rows.step_row, rows.traj_index, rows.group_index
    eps, std_norm = settings.eps, settings.mode == "mean_std_norm"

    # Eq. 1: A^E over the step rows of the prompt group (trajectories weighted by their number of steps)
    R = batch.rewards()[traj]
    mu, sigma, n_rows = group_moments(R, group, batch.n_groups)
    n_traj = np.bincount(batch.traj_group, minlength=batch.n_groups)[group]
    single = (n_traj < 2) | (n_rows < 2)
    mu, sigma = np.where(single, 0.0, mu), np.where(single, 1.0, sigma)
    A_E = (R - mu) / (sigma + eps) if std_norm else R - mu

    if settings.step_reward == "verifier_score":  # Eq. 2
        score = batch.step_floats("verifier_score")[step_row]  # (null: NaN)
        r = np.where(np.isnan(score), 0.0, score)
    else:
        _, last = segment_bounds(traj)
        r = np.where(last, R, 0.0)
    r = r - settings.invalid_action_penalty_coef * invalid_actions(batch, step_row)
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
