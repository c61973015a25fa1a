"""Verifiers: score one model output for one trajectory's task in [0,1] (TCPO's r_{i,k} and q_m).

A registry keyed by name; `verifier_for(action_format, meta)` picks one per trajectory: `meta["verifier"]`
when the trajectory names one, else by action format (search_r1 -> em, code -> code_tests), else by the
gold fields present (tests -> code_tests, answer(s) -> em). Every verifier returns a `Verdict`, never raises:
a crash or a timeout scores 0 with `ok=False` (or, for code, the timeout recorded in `error`).

Registered: `em` (Search-R1 exact match after normalize_answer), `f1` (token F1, max over gold answers),
`math` (final-answer equivalence with math-verify). `code_tests` (Python tests in an OS sandbox, fraction
passed) runs candidate programs, so it is registered from the trainer floor by `trainer.sandbox` (flows import
it; pipeline/verifiers/code.py holds its pure half: splitting the tests and deciding pass/fail).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    score: float  # in [0,1]; 0 when the verifier failed
    verifier: str
    ok: bool = True  # False: the verifier itself failed (crash, unusable gold): not the output's fault
    error: str | None = None  # why it failed, or what went wrong with the candidate (timeout, crash)
    detail: dict | None = None  # e.g. {"passed": 3, "total": 4}


VerifyFn = Callable[[str, dict], Verdict]
VERIFIERS: dict[str, VerifyFn] = {}


class VerifierError(ValueError):
    pass


def register_verifier(name: str):
    def deco(fn: VerifyFn) -> VerifyFn:
        VERIFIERS[name] = fn
        return fn

    return deco


def _load() -> None:
    from pipeline.verifiers import code, math, qa  # noqa: F401


def parse_meta(meta) -> dict:
    if meta is None:
        return {}
    if isinstance(meta, dict):
        return meta
    try:
        out = json.loads(meta)
    except (TypeError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


FORMAT_DEFAULTS = {"search_r1": "em", "code": "code_tests"}


def verifier_name(action_format: str | None, meta) -> str:
    meta = parse_meta(meta)
    if meta.get("verifier"):
        return str(meta["verifier"])
    if action_format in FORMAT_DEFAULTS:
        return FORMAT_DEFAULTS[action_format]
    if meta.get("test") or meta.get("tests"):
        return "code_tests"
    if any(meta.get(k) is not None for k in ("golden_answers", "answers", "answer", "gold")):
        return "em"
    raise VerifierError(
        f"no verifier for action_format={action_format!r}: set meta.verifier (one of {sorted(VERIFIERS)})"
    )


def verifier_for(action_format: str | None, meta) -> tuple[str, VerifyFn]:
    _load()
    name = verifier_name(action_format, meta)
    if name not in VERIFIERS:
        hint = (
            "; it runs candidate code: import trainer.sandbox to register it" if name == "code_tests" else ""
        )
        raise VerifierError(f"unknown verifier {name!r}{hint}; known: {sorted(VERIFIERS)}")
    return name, VERIFIERS[name]


def verify(output: str, action_format: str | None, meta) -> Verdict:
    """Score one output for one trajectory's task. Never raises: failures are Verdicts with ok=False."""
    meta = parse_meta(meta)
    try:
        name, fn = verifier_for(action_format, meta)
    except VerifierError as exc:
        return Verdict(0.0, "none", ok=False, error=str(exc))
    try:
        return fn(output, meta)
    except Exception as exc:  # a verifier bug scores 0 and is recorded, never fails the caller
        return Verdict(0.0, name, ok=False, error=f"{type(exc).__name__}: {exc}")


def gold_answers(meta: dict) -> list[str]:
    for key in ("golden_answers", "answers", "answer", "gold"):
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, dict) and "target" in value:  # Search-R1 reward_model.ground_truth
            value = value["target"]
        if isinstance(value, (list, tuple)):
            return [str(v) for v in value]
        return [str(value)]
    return []


_load()
