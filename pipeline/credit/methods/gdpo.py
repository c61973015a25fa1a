"""GDPO, Group reward-Decoupled normalization (spec 2.2; NVIDIA arXiv 2601.05242, TRL and verl patches).

Each reward component is group-normalised on its own, the weighted sum is whitened over the batch:
    (1) A_i^c = (R_i^c - mean_g^c) / (std_g^c + eps)        (std unbiased; size-1 group: A = R, verl)
    (2) pre_i = sum_c w_c A_i^c
    (3) A_i   = (pre_i - mean_batch) / (std_batch + eps)    (TRL; `whiten="tokens"`: verl masked_whiten)

Components come from `trajectories.reward_components`; a trajectory without them (or a batch where none has
them) uses its `reward` as the single component "reward". A missing or NaN component value counts as 0
(TRL's nan_to_num). The components are the round's (every name any trajectory of the round has), or the
batch's with `scope="batch"`. The batch of Eq. 3 is the round (`scope="round"`, default: every trajectory of the round,
however it was split into parts) or the processing batch (`scope="batch"`: config `batch_groups` whole
groups); fewer than 2 trajectories are not whitened (their std is undefined)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import Moments, group_normalize, whiten
from pipeline.credit.registry import RoundStatistics, estimator
from pipeline.credit.result import CreditResult
from pipeline.settings import StageSettings, register_settings


@register_settings("gdpo")
class GDPOSettings(StageSettings):
    weights: dict[str, float] = Field(
        default_factory=dict, description="w_c per component name; components not named get 1.0"
    )
    components: list[str] | None = Field(None, description="components to use (None: every one in the batch)")
    eps: float = Field(1e-4, description="added to the unbiased group std and the batch std")
    whiten: Literal["trajectories", "tokens", "none"] = Field(
        "trajectories",
        description="batch whitening: TRL over trajectories, verl masked_whiten over tokens, or none",
    )
    scope: Literal["round", "batch"] = Field(
        "round", description="the batch of Eq. 3: the round (every batch) or the processing batch"
    )


def _long_components(batch: CreditBatch) -> tuple[np.ndarray, pa.Array, np.ndarray]:
    """(trajectory row, key, value) of every trajectory's reward components (no entries without the column),
    the entries in order; a value null -> NaN. Flattened once per batch (the names and the matrix of one call,
    the statistics pass's and credit's of a kept batch), in Arrow: the batch's few thousand entries, no frame."""
    memo = batch.memo.get(_long_components)
    if isinstance(memo, tuple):
        return memo
    lists = batch.component_entries()
    if lists is None:
        out: tuple[np.ndarray, pa.Array, np.ndarray] = (
            np.zeros(0, np.int64),
            pa.array([], pa.string()),
            np.zeros(0),
        )
    else:
        # list<struct<key, value>> (CreditBatch: a map's entries)
        rows = pc.list_parent_indices(lists)
        entries = pc.list_flatten(lists)
        key = pc.struct_field(entries, "key")
        keep = pc.is_valid(key)  # an entry without a key is no component
        value = pc.struct_field(entries, "value").cast(pa.float64()).fill_null(np.nan)
        out = (
            rows.filter(keep).to_numpy().astype(np.int64),
            key.filter(keep),
            value.filter(keep).to_numpy(zero_copy_only=False),
        )
    batch.memo[_long_components] = out
    return out


def component_names(batch: CreditBatch) -> list[str]:
    """The component names this batch's trajectories have, sorted."""
    return sorted(pc.unique(_long_components(batch)[1]).to_pylist())


def component_matrix(
    batch: CreditBatch, names: list[str] | None = None
) -> tuple[list[str], np.ndarray, bool]:
    """R^c as a (trajectories x components) matrix; missing / NaN -> 0. The components are `names`, else
    every one the batch has; none at all: [reward] (the third value says so)."""
    rows, key, value = _long_components(batch)
    names = list(names or component_names(batch))
    if not names:
        return ["reward"], np.nan_to_num(batch.rewards())[:, None], True
    distinct = list(dict.fromkeys(names))  # (a name given twice gets its values twice)
    R_c = np.zeros((batch.n_traj, len(distinct)), dtype=np.float64)
    if len(key):
        column = pc.index_in(key, value_set=pa.array(distinct, key.type))  # null: not among `names`
        named = pc.is_valid(column).to_numpy(zero_copy_only=False)
        R_c[rows[named], column.filter(named).to_numpy().astype(np.int64)] = value[named]
    if len(distinct) < len(names):
        R_c = R_c[:, [distinct.index(n) for n in names]]
    return names, np.nan_to_num(R_c, nan=0.0, posinf=0.0, neginf=0.0), False


def gdpo_pre(
    batch: CreditBatch, settings: GDPOSettings, names: list[str] | None
) -> tuple[list[str], np.ndarray, bool, np.ndarray, np.ndarray | None]:
    """Eq. 1-2 over `names` (None: the components this batch has): (names, R^c, no components, pre, the
    trajectories' weights in Eq. 3: their assistant tokens with `whiten="tokens"`, else None). Computed once
    per batch and settings for the components it resolves to (the statistics pass's and credit's of a kept
    batch, when the round's names are the batch's own): keyed by those names, not by `names` as given, so a
    batch without components (its stand-in "reward", from R) and a component named "reward" (R^c, zeros on
    such a batch) never share an entry."""
    resolved = tuple(names or component_names(batch))
    key = (gdpo_pre, resolved, settings.eps, settings.whiten, tuple(sorted(settings.weights.items())))
    memo = batch.memo.get(key)
    if isinstance(memo, tuple):
        return memo
    out = _gdpo_pre(batch, settings, list(resolved))
    for value in out:
        if isinstance(value, np.ndarray):
            value.setflags(write=False)  # shared by both calls: neither may change it
    batch.memo[key] = out
    return out


def _gdpo_pre(
    batch: CreditBatch, settings: GDPOSettings, names: list[str]
) -> tuple[list[str], np.ndarray, bool, np.ndarray, np.ndarray | None]:
    names, R_c, no_components = component_matrix(batch, names)
    w = np.array([settings.weights.get(c, 1.0) for c in names], dtype=np.float64)
    A_c = np.column_stack(
        [group_normalize(R_c[:, j], batch.traj_group, eps=settings.eps) for j in range(len(names))]
    )  # Eq. 1
    pre = A_c @ w if batch.n_traj else np.zeros(0)  # Eq. 2
    L_i = np.bincount(batch.mask_trajs(), minlength=batch.n_traj) if settings.whiten == "tokens" else None
    return names, R_c, no_components, pre, L_i


def gdpo_statistics(batch: CreditBatch, settings: GDPOSettings) -> dict[str, Moments]:
    """Eq. 3's moments on this batch, and the names of its components (keys `gdpo:<name>`, so the round's are
    known). A round without components whitens R (statistic "gdpo.reward"); a batch without any also adds its
    zeros to "gdpo", what it contributes if another batch has components (a component absent from a batch
    normalises to exactly 0 there)."""
    names, _, no_components, pre, L_i = gdpo_pre(batch, settings, settings.components)
    named = no_components or settings.components  # the round's names matter only when the batch finds them
    out = {} if named else {f"gdpo:{name}": Moments(1.0) for name in names}
    if settings.whiten == "none":
        return out
    if no_components:
        out["gdpo"] = Moments.of(np.zeros(batch.n_traj), L_i)
        out["gdpo.reward"] = Moments.of(pre, L_i)
    else:
        out["gdpo"] = Moments.of(pre, L_i)
    return out


@estimator(
    "gdpo",
    settings="gdpo",
    statistics=RoundStatistics(
        "gdpo", gdpo_statistics, step_columns=(), tokens=lambda settings: settings.whiten == "tokens"
    ),
    components=("a_hat", "score"),
)
def gdpo(batch: CreditBatch, settings: GDPOSettings) -> CreditResult:
    """Per-component group normalisation, weighted sum, batch whitening."""
    names = settings.components or batch.names("gdpo", component_names(batch), settings.scope)
    names, R_c, no_components, pre, L_i = gdpo_pre(batch, settings, names)
    w = np.array([settings.weights.get(c, 1.0) for c in names], dtype=np.float64)
    A = pre
    if settings.whiten != "none":
        # Eq. 3: TRL over the trajectories, or verl's masked_whiten over the tokens (trajectories by length)
        moments = batch.moments("gdpo.reward" if no_components else "gdpo", pre, L_i, scope=settings.scope)
        if L_i is None:
            A = whiten(pre, moments, var_eps=0.0, std_eps=settings.eps, min_count=2)
        else:
            A = whiten(pre, moments)
    score = R_c @ w
    a_step = batch.traj_to_steps(A)
    return CreditResult.per_step(
        batch,
        a_step,
        {"a_hat": a_step, "score": batch.traj_to_steps(score)},
        notes={"components": float(len(names)), "singleton_batch": float(batch.n_traj < 2)},
    )
