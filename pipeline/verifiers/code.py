"""Python code verifier, the pure half: program extraction, test splitting, the score.

The half that runs programs is `trainer.sandbox` (an OS-level sandbox, bubblewrap); it registers the
`code_tests` verifier as `code_tests_with(its executor)`. Three processes, and what each may see:

- the *candidate's* sandbox runs the program and nothing else: it is asked for calls of its own functions
  (the arguments cross, nothing else: no test, no expected value) and answers with its return values;
- the *reference* sandbox never runs candidate code: it runs the task's prompt, its own imports of the
  standard-library modules the program imports, and the tests, with each name of the program the tests use
  (`candidate`, the entry point, a function the tests call; never a builtin, a standard-library module, a
  name the prompt or the tests bind) bound to a stub that sends the call to the candidate's sandbox and
  decodes the answer as plain data (exact builtin types; anything else is an opaque value that equals
  nothing). So an expected side `pow(2, 3)`, `math.comb(5, 2)` or `poly(xs, candidate(xs))` is computed with
  the reference's own `pow`, `math` and `poly`, whatever the program defines or patches;
- the *caller* (this module) decides: each `assert E` is split (`split_expr`, in code_plan.py with the rest
  of the test plan) into a *skeleton* evaluated here by a small safe evaluator (safe_eval.py: literals,
  displays, arithmetic, comparisons, boolean logic, subscripts, a few pure builtins and `math` functions) and
  *holes* (calls, test variables) the reference run evaluates and returns as plain data, decoded here under
  bounds (`wire`: size, depth, hash collisions).

Tests come from the trajectory's meta: `tests` (assert statements, e.g. LDB's given_tests) or `test` +
`entry_point` (a HumanEval `check(candidate)`; each top-level statement of `check` that contains an assert is
one test, the others are setup run in order). score = passed tests / total tests, in [0, 1]. `random` is
seeded identically before every test unit (in both sandboxes). Limits: arguments cross as plain data (an
object built by the tests, e.g. a tree of a class the prompt defines, reaches the candidate as an opaque
value); an object the candidate returns stays in its sandbox as a handle (its methods can be called, it can
be iterated; it equals nothing); a test that compares two functions the program defines compares the
candidate with itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from pipeline.config import StageSettings, register_settings
from pipeline.verifiers import Verdict
from pipeline.verifiers.code_plan import HOLE, TestPlan, Unit, candidate_surface, plan_tests, split_expr
from pipeline.verifiers.safe_eval import plain, safe_eval
from pipeline.verifiers.wire import DecodeError, Opaque, decode

__all__ = [  # re-exported: the values a sandbox returns, and the plan and evaluator tests reach through here
    "DecodeError",
    "Opaque",
    "candidate_surface",
    "decode",
    "plan_tests",
    "safe_eval",
    "split_expr",
]

_FENCE = re.compile(r"```(?:python|py|Python)?[^\n]*\n(.*?)```", re.DOTALL)


@register_settings("sandbox")
class SandboxSettings(StageSettings):
    """The code verifier's sandbox (trainer.sandbox): limits per run of a candidate program."""

    wall_s: float = Field(10.0, gt=0, description="wall-clock limit per run; the whole process tree dies")
    cpu_s: int = Field(10, gt=0, description="RLIMIT_CPU seconds")
    mem_bytes: int = Field(
        1 << 30,
        gt=0,
        description="RLIMIT_AS bytes of each process, and the resident bytes of one sandbox's processes together "
        "(summed every 50 ms; the tree is killed past it)",
    )
    nproc: int = Field(64, gt=0, description="RLIMIT_NPROC of the sandbox user (no fork bombs)")
    fsize_bytes: int = Field(16 << 20, gt=0, description="RLIMIT_FSIZE bytes (largest file written)")
    tmpfs_bytes: int = Field(64 << 20, gt=0, description="size of the private /tmp")
    output_bytes: int = Field(8 << 20, gt=0, description="bytes read from the sandbox before it is killed")
    unsafe_no_sandbox: bool = Field(
        False,
        description="run candidate programs WITHOUT the OS sandbox when bubblewrap is unavailable "
        "(rlimits and process groups only: the host is not protected, and a program running as the caller's "
        "user can reach the reference process, so neither is the score)",
    )


SandboxLimits = SandboxSettings  # the old name (trainer/envs/repair.py, tests)
DEFAULT_LIMITS = SandboxSettings()


def extract_program(output: str) -> str:
    blocks = _FENCE.findall(output)
    return blocks[-1] if blocks else output


def program_for(output: str, meta: dict) -> str:
    """The program to run: the last fenced block; a HumanEval prompt is prepended to a bare completion."""
    program = extract_program(output)
    ep = meta.get("entry_point")
    if ep and meta.get("prompt") and not re.search(rf"def\s+{re.escape(ep)}\s*\(", program):
        program = meta["prompt"] + program
    return program


# ---- the score ----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a verification's sandboxes returned: `result` is the reference's document ({"program_error",
    "units"}; only "program_error" when the candidate's program failed), or None when there is none."""

    result: dict | None
    status: str = "ok"  # ok | timeout | output_limit | crash | reference_error
    detail: str | None = None


def _records(run: dict | None, index: int) -> tuple[bool, str | None, dict[int, list]]:
    units = run.get("units") if isinstance(run, dict) else None
    if not isinstance(units, list) or index >= len(units) or not isinstance(units[index], dict):
        return False, "no result for this test", {}
    u = units[index]
    recs = u.get("rec") if isinstance(u.get("rec"), dict) else {}
    out: dict[int, list] = {}
    for k, occ in recs.items():
        if isinstance(occ, list):
            try:
                out[int(k)] = occ
            except ValueError:
                continue
    return bool(u.get("ok")), (str(u.get("err"))[:300] if u.get("err") else None), out


def _hole_value(occ: Any, j: int) -> tuple[bool, Any]:
    """(ok, value or error) of hole j in one recorded occurrence: [[1, value] | [0, "error"], ...]."""
    if not isinstance(occ, list) or j >= len(occ) or not isinstance(occ[j], list) or len(occ[j]) != 2:
        return False, "malformed record"
    ok, val = occ[j]
    if ok == 1:
        try:
            return True, decode(val)
        except (DecodeError, ValueError, TypeError, RecursionError) as exc:
            return False, f"undecodable value: {exc}"
    return False, str(val)[:300]


def score_plan(plan: TestPlan, doc: dict | None) -> tuple[int, list[str]]:
    """Tests passed (decided here, from the reference run's values alone) and the first errors."""
    passed, errors = 0, list[str]()
    for i, unit in enumerate(plan.units):
        if not unit.is_test:
            continue
        err = unit.error or _unit_error(unit, i, doc)
        if err is None:
            passed += 1
        elif len(errors) < 10:
            errors.append(err[:300])
    return min(passed, plan.total), errors


def _unit_error(unit: Unit, i: int, doc: dict | None) -> str | None:
    ok, err, recs = _records(doc, i)
    if not ok:
        return err or "test did not run"
    ran = 0
    for aid, ap in unit.asserts.items():
        occs = recs.get(aid, [])
        if unit.bare and len(occs) != 1:
            return f"{ap.source}: ran {len(occs)} times"
        for occ in occs:
            env = {}
            for j in range(len(ap.holes)):
                good, val = _hole_value(occ, j)
                if not good:
                    return f"{ap.source}: {val}"
                env[f"{HOLE}{j}"] = val
            try:
                if not _truthy(safe_eval(ap.skeleton, env)):
                    return f"{ap.source}: assertion failed"
            except Exception as exc:  # noqa: BLE001 - the returned values did not fit the test
                return f"{ap.source}: {type(exc).__name__}: {exc}"
            ran += 1
    if unit.asserts and ran == 0:
        return "no assert ran"
    return None


def _truthy(value: Any) -> bool:
    return bool(plain(value))


def jobs_for(plan: TestPlan, program: str, meta: dict) -> tuple[dict, dict]:
    """The two sandboxes' jobs: the candidate's holds the program alone; the reference's holds the tests,
    the task's prompt, the program's standard-library imports and the names to ask the candidate for."""
    entry_point = meta.get("entry_point")
    prompt = meta.get("prompt") if entry_point else None
    remote, imports = candidate_surface(program, plan, entry_point, prompt)
    cand = {"program": program, "seed": 1234}
    ref = {
        "prompt": prompt,
        "imports": imports,
        "remote": remote,
        "entry_point": entry_point,
        "setup": plan.setup,
        "units": [u.src for u in plan.units],
        "seed": 1234,
    }
    return cand, ref


Executor = Callable[[dict, dict, SandboxSettings], Outcome]


def run_plan(program: str, meta: dict, execute: Executor, settings: SandboxSettings) -> dict:
    """Run the tests of `meta` on `program` through `execute`; {"passed", "total", "errors", "timeout", "crash"}
    (and "reference_error" when the tests failed without the candidate's fault)."""
    tests = meta.get("tests") or meta.get("given_tests")
    try:
        plan = plan_tests(list(tests) if tests else None, meta.get("test"))
    except (SyntaxError, ValueError) as exc:
        return {
            "passed": 0,
            "total": 0,
            "errors": [f"tests do not parse: {exc}"],
            "timeout": False,
            "crash": None,
        }
    base = {"passed": 0, "total": plan.total, "errors": [], "timeout": False, "crash": None}
    out = execute(*jobs_for(plan, program, meta), settings)
    if out.status == "timeout":
        return {**base, "timeout": True}
    if out.status == "reference_error":
        return {
            **base,
            "reference_error": f"the reference run (no candidate code) failed: {out.detail}"[:500],
        }
    if out.status != "ok" or not isinstance(out.result, dict):
        return {**base, "crash": f"{out.status}: {out.detail or ''}".strip()}
    perr = out.result.get("program_error")
    if perr:
        return {**base, "errors": [f"program: {str(perr)[:500]}"]}
    passed, errors = score_plan(plan, out.result)
    return {**base, "passed": passed, "errors": errors}


TIGHTENABLE = ("wall_s", "cpu_s", "mem_bytes", "nproc", "fsize_bytes", "tmpfs_bytes", "output_bytes")


class LimitError(ValueError):
    pass


def tightened(ceiling: SandboxSettings, requested: Any) -> SandboxSettings:
    """The operator's limits are ceilings: a record's `meta.sandbox` may lower any of TIGHTENABLE, never raise
    one or switch anything off; a value that is not a positive finite number (or a key not in the list) is
    the record's error (LimitError), not the run's."""
    if requested is None or requested == {}:
        return ceiling
    if not isinstance(requested, dict):
        raise LimitError(f"meta.sandbox must be an object of limits, got {type(requested).__name__}")
    update: dict[str, Any] = {}
    for key, value in requested.items():
        if key not in TIGHTENABLE:
            raise LimitError(
                f"meta.sandbox.{str(key)[:40]}: not a limit a record may set ({', '.join(TIGHTENABLE)})"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise LimitError(f"meta.sandbox.{key}: {str(value)[:40]!r} is not a positive number")
        current = getattr(ceiling, key)
        wanted = value if isinstance(current, float) else int(value)
        if wanted <= 0:
            raise LimitError(f"meta.sandbox.{key}: {value!r} is below one")
        update[key] = min(current, wanted)
    return ceiling.model_copy(update=update)


def code_tests_with(execute: Executor, settings: Callable[[], SandboxSettings]) -> Callable[..., Verdict]:
    """The `code_tests` verifier over an executor (trainer.sandbox registers it): fraction of tests passed."""

    def code_tests(output: str, meta: dict, limits: SandboxSettings | None = None) -> Verdict:
        if not (meta.get("tests") or meta.get("given_tests")) and not meta.get("test"):
            return Verdict(
                0.0, "code_tests", ok=False, error="no tests in meta (tests or test + entry_point)"
            )
        try:
            s = tightened(limits or settings(), meta.get("sandbox"))
        except LimitError as exc:
            return Verdict(0.0, "code_tests", ok=False, error=str(exc))
        res = run_plan(program_for(output, meta), meta, execute, s)
        if res.get("reference_error"):  # the tests themselves failed without the candidate: not its fault
            return Verdict(0.0, "code_tests", ok=False, error=res["reference_error"])
        if res["timeout"]:
            return Verdict(0.0, "code_tests", error=f"timeout after {s.wall_s}s")
        if res["crash"]:
            return Verdict(0.0, "code_tests", error=res["crash"][:500])
        total = int(res["total"])
        if total == 0:
            return Verdict(0.0, "code_tests", ok=False, error="no test statements found")
        passed = max(0, min(int(res["passed"]), total))
        err = "; ".join(res["errors"][:3]) or None
        return Verdict(passed / total, "code_tests", error=err, detail={"passed": passed, "total": total})

    return code_tests
