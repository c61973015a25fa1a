"""Method preconditions, checked before a round starts (issue 24): what each estimator / refiner needs from the
round's steps, and which trajectories lack it.

A method declares its requirements where it is registered, `@estimator(name, requires=(Requirement(...),))`; `unmet(methods, step_flags, config)` is a pure function of a per-step flag table and
returns every method whose requirement some trajectory does not meet, with the missing column and the
trajectories affected. `creditflow process` runs it before any work: it stops with one line per unmet method,
or, with `--skip-unmet`, computes the other methods and records what it skipped in the round's summary.

The step flags (one row per step; `step_flags` computes them from the round's steps columns in Arrow, only
the ones the methods need, and no read at all when no method has a requirement): traj_id, role, n_tokens, and has_<column> per required column
(has_verifier_score, has_values, has_logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from pipeline.credit.registry import Requirement, parse_method


@dataclass(frozen=True)
class Unmet:
    method: str
    stage: str
    column: str
    what: str
    trajectories: tuple[str, ...]  # the trajectories lacking it, sorted
    total: int  # trajectories in the round

    def line(self) -> str:
        shown = ", ".join(self.trajectories[:5]) + (", ..." if len(self.trajectories) > 5 else "")
        return (
            f"{self.method}: {self.stage} needs {self.what} (steps.{self.column}); "
            f"{len(self.trajectories)} of {self.total} trajectories lack it: {shown}"
        )


def grouped_lines(problems: list[Unmet]) -> list[str]:
    """One short line per missing input (the methods that need it, how many trajectories lack it), for a
    summary where `Unmet.line` per method would repeat the same trajectories for every method."""
    groups: dict[tuple[str, str, tuple[str, ...], int], list[str]] = {}
    for p in problems:
        methods = groups.setdefault((p.column, p.what, p.trajectories, p.total), [])
        if p.method not in methods:
            methods.append(p.method)
    return [
        f"{', '.join(methods)}: need {what} (steps.{column}), missing on {len(trajs)} of {total} trajectories"
        for (column, what, trajs, total), methods in groups.items()
    ]


FLAG_OF = {"verifier_score": "has_verifier_score", "values": "has_values", "logprobs": "has_logprobs"}


def steps_columns(columns) -> list[str]:
    """The steps columns `step_flags` reads for these required columns."""
    return ["traj_id", "role", "token_offsets", *sorted(columns)]


def step_flags(steps, columns):
    """The step flags from an Arrow table of the round's steps (`steps_columns(columns)`): `len(token_offsets)`
    and `column IS NOT NULL` per column, whole-column. A required column the table lacks (an older lake whose
    parts never held it) is null on every step, so its flag is false everywhere."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    flags = {
        "traj_id": steps.column("traj_id"),
        "role": steps.column("role"),
        "n_tokens": pc.list_value_length(steps.column("token_offsets")),
    }
    for c in sorted(columns):
        held = c in steps.column_names
        flags[FLAG_OF[c]] = pc.is_valid(steps.column(c)) if held else pa.array(np.zeros(steps.num_rows, bool))
    return pa.table(flags)


REQUIREMENTS: dict[str, tuple[Requirement, ...]] = {}  # extra ones for a stage registered elsewhere


def declare(stage: str, *requirements: Requirement) -> None:
    """Add requirements to stage `stage` (an estimator or refiner); a method's own module declares them with
    `@estimator(..., requires=...)` instead."""
    REQUIREMENTS[stage] = REQUIREMENTS.get(stage, ()) + tuple(requirements)


def applicable(methods: list[str], config) -> list[tuple[str, str, Requirement]]:
    """(method, stage, requirement) for every requirement of `methods` that applies under `config`."""
    out = []
    for method in methods:
        est, refs = parse_method(method)
        for stage in (est, *refs):
            reqs = stage.requires + REQUIREMENTS.get(stage.name, ())
            out += [(method, stage.name, r) for r in reqs if r.applies(config)]
    return out


def required_columns(methods: list[str], config) -> set[str]:
    """The steps columns the methods' requirements check (empty: nothing to check, no query needed)."""
    return {r.column for _, _, r in applicable(methods, config)}


def unmet(methods: list[str], step_flags, config) -> list[Unmet]:
    """The requirements of `methods` that the round's steps do not meet (see the module doc)."""
    flags = step_flags if isinstance(step_flags, pl.DataFrame) else pl.DataFrame(step_flags)
    total = flags["traj_id"].n_unique()
    acting = flags.filter((pl.col("role") == "assistant") & (pl.col("n_tokens") > 0))
    out: list[Unmet] = []
    lacking_cache: dict[str, tuple[str, ...]] = {}
    for method, stage, req in applicable(methods, config):
        if req.column not in lacking_cache:
            lacking = acting.filter(~pl.col(FLAG_OF[req.column]))["traj_id"].unique().sort()
            lacking_cache[req.column] = tuple(lacking.to_list())
        if lacking_cache[req.column]:
            out.append(Unmet(method, stage, req.column, req.what, lacking_cache[req.column], total))
    return out
