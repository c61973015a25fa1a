"""The two-sandbox relay's outcome does not depend on which sandbox is faster (trainer.sandbox._relay).

A program that does not run (a syntax error, an exception at import) defines nothing the reference can ask
for, so the reference's tests fail on their own with NameError and its document may arrive before the
candidate's hello. The relay holds that document until the hello, and a program error in the hello wins:
the same program gives the same result every run.
"""

from __future__ import annotations

import pytest

from pipeline.verifiers.code import DEFAULT_LIMITS
from trainer.sandbox import run_tests

needs_bwrap = pytest.mark.sandbox  # skipped, with the reason, where bwrap cannot run (tests/conftest.py)
FAST = DEFAULT_LIMITS.model_copy(update={"wall_s": 10.0, "cpu_s": 5})
TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
RUNS = 20


def _run(program: str) -> dict:
    return run_tests(program, tests=TESTS, limits=FAST)


@needs_bwrap
def test_a_late_program_error_wins_over_an_early_reference_document():
    """The candidate sleeps before it raises: the reference (nothing to ask) is done long before the hello.
    Before the fix this was reported as two NameErrors every time."""
    out = _run("import time\ntime.sleep(0.5)\nraise ValueError('late')\n")
    assert out == {
        "passed": 0,
        "total": 2,
        "errors": ["program: ValueError: late"],
        "timeout": False,
        "crash": None,
    }


@needs_bwrap
def test_a_candidate_that_exits_before_its_hello_is_a_crash_every_time():
    """No hello at all (the program leaves the process at import): a crash, never the reference's NameErrors."""
    for _ in range(3):
        out = _run("import os\nos._exit(3)\n")
        assert out["passed"] == 0 and out["errors"] == [], out
        assert out["crash"] is not None and out["crash"].startswith("crash: exit 3"), out


PROGRAMS = {
    "syntax error": ("def add(a, b)\n    return a + b\n", "program: SyntaxError: "),
    "raises at import": (
        "raise RuntimeError('boom')\ndef add(a, b):\n    return a + b\n",
        "program: RuntimeError: boom",
    ),
    "defines nothing the tests call": ("def plus(a, b):\n    return a + b\n", None),
}


@needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_same_program_gives_the_same_result_every_run(name):
    program, program_error = PROGRAMS[name]
    results = [_run(program) for _ in range(RUNS)]
    first = results[0]
    assert all(r == first for r in results), [r["errors"] for r in results]
    assert first["passed"] == 0 and first["total"] == 2 and not first["timeout"] and first["crash"] is None
    if program_error is not None:
        assert len(first["errors"]) == 1 and first["errors"][0].startswith(program_error), first
    else:  # the program ran: each test fails on its own, with NameError, in the reference
        assert len(first["errors"]) == 2 and all(
            "NameError" in e and "'add'" in e for e in first["errors"]
        ), first


@needs_bwrap
def test_a_program_that_hangs_at_import_times_out_even_when_the_tests_need_nothing_from_it():
    """The reference's document waits for the hello: a program stuck at import is a timeout, not the
    reference's NameErrors (which it was when the reference happened to finish first)."""
    limits = DEFAULT_LIMITS.model_copy(update={"wall_s": 1.5, "cpu_s": 5})
    out = run_tests("while True:\n    pass\n", tests=TESTS, limits=limits)
    assert out == {"passed": 0, "total": 2, "errors": [], "timeout": True, "crash": None}
