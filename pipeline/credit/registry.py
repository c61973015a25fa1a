"""The method registry. An estimator makes token advantages from rewards; a refiner transforms them.
A method is a chain `estimator(+refiner)*`, e.g. `grpo`, `gae+c3`, `grpo+iapo+c3`.

    @estimator("grpo", settings="grpo", components=("a_hat", "score"))
    def grpo(batch: CreditBatch, settings: GRPOSettings) -> CreditResult: ...

    @refiner("c3", settings="c3", needs=("spans",), step_columns=("logprobs",), components=(...))
    def c3(batch: CreditBatch, base: CreditResult, settings: C3Settings) -> CreditResult: ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pipeline.credit.batch import CreditBatch
from pipeline.credit.ops import Moments
from pipeline.credit.result import CreditResult
from pipeline.settings import named_settings


@dataclass(frozen=True)
class Requirement:
    """What a method needs from the round's steps: every assistant step with tokens has `column` (a steps
    column: verifier_score | values | logprobs), unless `applies(config)` is false. Checked before a round
    starts (pipeline.credit.preconditions)."""

    column: str
    what: str  # in words, for the one-line message
    applies: Callable[[object], bool] = field(default=lambda config: True)


@dataclass(frozen=True)
class RoundStatistics:
    """A statistic an estimator takes over the whole batch (whitening, GDPO's batch normalisation), declared
    beside it: `fn(batch, settings)` returns this batch's sufficient statistics by key, the very moments the
    estimator reads back with `batch.moments(key, ...)`. Where the `settings` model's `scope` is "round" (the
    default), the statistics pass (process.batch_statistics) runs `fn` on every batch of the round, merges the
    moments, and the credit pass reads the round's; `step_columns`: the steps columns `fn` reads beyond
    STATISTICS_COLUMNS (None: the estimator's own; or a function of its settings), so the statistics pass reads no
    more than it needs;
    `tokens(settings)` (of the `settings` model): whether `fn` reads the batch's tokens (their positions, the
    assistant mask, per-token columns). Where no statistic of the pass does, it reads no `n_tokens` (GDPO
    whitening over trajectories needs only the trajectories) and `fn` gets a
    batch whose steps hold no tokens; `active(settings)`: whether there is a statistic to take at all under these
    settings (gae with `whiten=false` takes none: no statistics pass reads the round for it). Both are checked
    against `fn` on full batches (tests/test_credit_scope.py)."""

    settings: str  # the settings model whose `scope` ("round" | "batch") says where the statistic is taken
    fn: Callable[[CreditBatch, Any], dict[str, Moments]]
    step_columns: tuple[str, ...] | Callable[[Any], tuple[str, ...]] | None = None
    tokens: Callable[[Any], bool] = field(default=lambda settings: True)
    active: Callable[[Any], bool] = field(default=lambda settings: True)


@dataclass(frozen=True)
class ChainLink:
    """One registered link of a method chain (`grpo+iapo+c3`): an estimator or a refiner, as declared. (Not a
    batch stage, pipeline.stages.BatchStage: the credit batch stage runs whole chains.)"""

    name: str
    kind: str  # "estimator" | "refiner"
    fn: Callable
    settings: str | None  # settings stage name
    needs: tuple[str, ...]  # annotations the stage reads: spans, nodes, edges, counterfactuals
    doc: str
    step_columns: tuple[str, ...] = ()  # steps columns beyond STEP_COLUMNS the stage reads (e.g. content)
    statistics: RoundStatistics | None = None  # a statistic over the whole batch (estimators only)
    requires: tuple[Requirement, ...] = ()  # checked against the round before any work
    components: tuple[str, ...] = ()  # the CreditResult components it fills (schemas/advantages.py)
    reads: tuple[
        str, ...
    ] = ()  # other settings models it reads (`batch.settings(Model)`: grpo_pr reads grpo's)


def _register(table: dict[str, ChainLink], stage: ChainLink) -> None:
    """Add a stage; a second stage of the same name is an error (a silent overwrite would change a method)."""
    from schemas.advantages import COMPONENT_FIELDS

    old = table.get(stage.name)
    if old is not None and (old.fn.__module__, old.fn.__qualname__) != (
        stage.fn.__module__,
        stage.fn.__qualname__,
    ):
        raise ValueError(
            f"{stage.kind} {stage.name!r} is registered twice ({old.fn.__module__} and {stage.fn.__module__})"
        )
    if not stage.components:
        raise ValueError(
            f"{stage.kind} {stage.name!r} declares no components: name the CreditResult components it fills "
            "(components=(...), from schemas/advantages.py COMPONENT_FIELDS)"
        )
    unknown = [c for c in stage.components if c not in COMPONENT_FIELDS]
    if unknown:
        raise ValueError(
            f"{stage.kind} {stage.name!r} declares components {unknown} that schemas/advantages.py "
            "COMPONENT_FIELDS does not list: add them there (one line each, with their meaning)"
        )
    table[stage.name] = stage


# the steps columns the statistics pass reads (a statistic adds its own `step_columns`; n_tokens only where a
# statistic reads tokens, `RoundStatistics.tokens`)
STATISTICS_COLUMNS = ("traj_id", "step_idx", "role", "n_tokens")
# the steps columns every method may read; others are read only when a stage lists them in `step_columns`:
# the per-token lists `logprobs` (batch.logprobs) and `values` (batch.values), and content, offsets and tool
# calls. A step's tokens are its `n_tokens` (one int32 per step, which the lake computes on every write): credit
# never reads the token ids themselves, the biggest column of the table. A stage that reads batch.logprobs / batch.values without
# declaring the column sees NaN (unknown) there: the batch builder reads only the declared ones.
STEP_COLUMNS = ("traj_id", "step_idx", "role", "turn", "is_error", "verifier_score", "n_tokens")


ESTIMATORS: dict[str, ChainLink] = {}
REFINERS: dict[str, ChainLink] = {}


class MethodError(ValueError):
    pass


def estimator(
    name: str,
    settings: str | None = None,
    needs: tuple[str, ...] = (),
    step_columns: tuple[str, ...] = (),
    statistics: RoundStatistics | None = None,
    requires: tuple[Requirement, ...] = (),
    components: tuple[str, ...] = (),
    reads: tuple[str, ...] = (),
):
    def deco(fn: Callable) -> Callable:
        stage = ChainLink(
            name,
            "estimator",
            fn,
            settings,
            tuple(needs),
            (fn.__doc__ or "").strip(),
            tuple(step_columns),
            statistics,
            tuple(requires),
            tuple(components),
            tuple(reads),
        )
        _register(ESTIMATORS, stage)
        return fn

    return deco


def refiner(
    name: str,
    settings: str | None = None,
    needs: tuple[str, ...] = (),
    step_columns: tuple[str, ...] = (),
    requires: tuple[Requirement, ...] = (),
    components: tuple[str, ...] = (),
    reads: tuple[str, ...] = (),
):
    def deco(fn: Callable) -> Callable:
        stage = ChainLink(
            name,
            "refiner",
            fn,
            settings,
            tuple(needs),
            (fn.__doc__ or "").strip(),
            tuple(step_columns),
            requires=tuple(requires),
            components=tuple(components),
            reads=tuple(reads),
        )
        _register(REFINERS, stage)
        return fn

    return deco


def parse_method(method: str) -> tuple[ChainLink, list[ChainLink]]:
    """`grpo+iapo+c3` -> (grpo, [iapo, c3]); names an unknown stage clearly."""
    parts = [p.strip() for p in method.strip().split("+") if p.strip()]
    if not parts:
        raise MethodError("empty method")
    head, *rest = parts
    if head not in ESTIMATORS:
        raise MethodError(f"method {method!r}: unknown estimator {head!r}; estimators: {sorted(ESTIMATORS)}")
    refs = []
    for r in rest:
        if r not in REFINERS:
            raise MethodError(f"method {method!r}: unknown refiner {r!r}; refiners: {sorted(REFINERS)}")
        refs.append(REFINERS[r])
    return ESTIMATORS[head], refs


def method_needs(method: str) -> set[str]:
    est, refs = parse_method(method)
    out = set(est.needs)
    for r in refs:
        out |= set(r.needs)
    return out


def method_step_columns(methods: list[str]) -> list[str]:
    """The steps columns a set of methods reads (so a batch read skips content, offsets and tool calls)."""
    cols = list(STEP_COLUMNS)
    for method in methods:
        est, refs = parse_method(method)
        for stage in (est, *refs):
            cols += [c for c in stage.step_columns if c not in cols]
    return cols


def method_settings(methods: list[str]) -> set[str]:
    """The settings models a set of methods reads: each stage's own, the one its batch statistic's `scope`
    comes from, and those it `reads` besides (what the credit stages declare, so their cache keys hold them)."""
    names: set[str] = set()
    for method in methods:
        est, refs = parse_method(method)
        for stage in (est, *refs):
            stat = stage.statistics.settings if stage.statistics else None
            names |= {n for n in (stage.settings, stat, *stage.reads) if n}
    return names


def round_statistics_methods(methods: list[str], config) -> list[ChainLink]:
    """The estimators of `methods` whose batch statistics are taken over the round (settings scope="round") and
    take one under their settings (`RoundStatistics.active`): what the statistics pass runs. Empty: the round
    needs no statistics pass."""
    out: list[ChainLink] = []
    for method in methods:
        est, _ = parse_method(method)
        if est.statistics and est not in out:
            own = config.settings_named(est.statistics.settings)
            if getattr(own, "scope", "round") == "round" and est.statistics.active(own):
                out.append(est)
    return out


def statistics_step_columns(methods: list[str], config=None) -> list[str]:
    """The steps columns the statistics pass of these estimators reads: STATISTICS_COLUMNS and each statistic's
    own (the estimator's columns where the statistic names none); without `n_tokens` where no statistic reads
    tokens under `config`'s settings (None: every stage's defaults; `RoundStatistics.tokens`); none at all where,
    besides, no statistic names a steps column (its batch then has the trajectories and no steps)."""
    cols = list(STATISTICS_COLUMNS)
    tokens = reads_steps = False
    for method in methods:
        est, _ = parse_method(method)
        if est.statistics is None:
            continue
        stat = est.statistics
        tokens = tokens or stat.tokens(named_settings(config, stat.settings))
        declared = stat.step_columns
        if callable(declared):  # of its settings (gae at gamma = lam = 1: the steps' value moments)
            declared = declared(named_settings(config, stat.settings))
        more: Sequence[str] = method_step_columns([est.name]) if declared is None else declared
        reads_steps = reads_steps or bool(more)
        cols += [c for c in more if c not in cols]
    if not tokens and not reads_steps:
        return []  # no statistic reads the steps (GDPO whitening over trajectories): the pass reads none
    return cols if tokens else [c for c in cols if c != "n_tokens"]


def _settings(batch: CreditBatch, stage: ChainLink):
    return batch.settings_named(stage.settings) if stage.settings else None


def run_methods(batch: CreditBatch, methods: list[str]) -> dict[str, CreditResult]:
    """Compute every method on the batch; shared chain prefixes (grpo in grpo, grpo+c3) run once."""
    memo: dict[str, CreditResult] = {}
    for method in methods:
        est, refs = parse_method(method)
        key = est.name
        declared = set(est.components)
        if key not in memo:
            memo[key] = _finish(batch, est.fn(batch, _settings(batch, est)), est, declared)
        for r in refs:
            prev = memo[key]
            key = f"{key}+{r.name}"
            declared |= set(r.components)
            if key not in memo:
                memo[key] = _finish(batch, r.fn(batch, prev, _settings(batch, r)), r, declared)
    return {m: memo["+".join(s.strip() for s in m.split("+") if s.strip())] for m in methods}


def _finish(
    batch: CreditBatch, result: CreditResult, stage: ChainLink | None = None, declared: set[str] | None = None
) -> CreditResult:
    """Enforce the contract: one value per token, zero off the assistant mask, finite; the components those
    its chain declares (a component it does not declare would be dropped by no one, or silently by a schema)."""
    undeclared = sorted(set(result.components) - declared) if declared is not None else []
    if stage is not None and undeclared:
        raise MethodError(
            f"{stage.kind} {stage.name!r} returned components {undeclared} it does not declare "
            f"(components={tuple(stage.components)})"
        )
    for name, comp in result.components.items():
        if np.shape(comp) != (batch.n_steps,):
            raise MethodError(f"component {name!r} has shape {np.shape(comp)}, expected ({batch.n_steps},)")
    if result.step_adv is not None:
        # per step (CreditResult.per_step): check the steps, the tokens follow; steps without tokens hold 0
        step = np.asarray(result.step_adv, dtype=np.float64)
        if step.shape != (batch.n_steps,):
            raise MethodError(f"estimator returned {step.shape} step advantages for {batch.n_steps} steps")
        n_tok = batch.step_tokens
        step = np.where(batch.step_is_assistant & (n_tok > 0), step, 0.0)
        if not np.isfinite(step.sum()) and not np.isfinite(step).all():
            bad = int(np.flatnonzero(~np.isfinite(step))[0])
            traj = batch.trajectories["traj_id"][int(batch.step_traj[bad])]
            raise MethodError(
                f"non-finite advantage on trajectory {traj!r} (token {int(batch.steps['tok_start'][bad])})"
            )
        return replace(result, step_adv=step)
    if result.mask_adv is not None:
        # on the assistant tokens (CreditResult.on_mask): zero elsewhere by construction; check those
        adv = result.mask_adv
        n_mask = int(batch.step_tokens[batch.step_is_assistant].sum())
        if adv.shape != (n_mask,):
            raise MethodError(f"estimator returned {adv.shape} advantages for {n_mask} assistant tokens")
        if not np.isfinite(adv.sum()) and not np.isfinite(adv).all():
            bad = int(np.flatnonzero(batch.tok_mask)[np.flatnonzero(~np.isfinite(adv))[0]])
            traj = batch.trajectories["traj_id"][int(batch.token_trajs()[bad])]
            raise MethodError(f"non-finite advantage on trajectory {traj!r} (token {bad})")
        return result
    if result.tok_adv is None:
        raise MethodError(f"{stage.name if stage else 'a method'} returned no advantages")
    adv = np.asarray(result.tok_adv, dtype=np.float64)
    if adv.shape != (batch.n_tokens,):
        raise MethodError(f"estimator returned {adv.shape} token advantages for {batch.n_tokens} tokens")
    adv = np.where(batch.tok_mask, adv, 0.0)
    if not np.isfinite(adv.sum()) and not np.isfinite(adv).all():  # the sum is NaN/inf if any value is
        bad = int(np.flatnonzero(~np.isfinite(adv))[0])
        traj = batch.trajectories["traj_id"][int(batch.token_trajs()[bad])]
        raise MethodError(f"non-finite advantage on trajectory {traj!r} (token {bad})")
    return replace(result, tok_adv=adv)
