"""Verifiers: the sandboxed code verifier on real LDB HumanEval repair programs, plus QA and math."""

from __future__ import annotations

import json
import threading
import time

import pytest

from pipeline.verifiers import VERIFIERS, verifier_name, verify
from trainer.sandbox import SandboxLimits, code_tests


@pytest.fixture(scope="module")
def ldb(real_data):
    path = real_data / "ldb_code_repair" / "humaneval-gpt-3.5-turbo-0613.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def meta_of(row) -> dict:
    return {
        "verifier": "code_tests",
        "test": row["test"],
        "entry_point": row["entry_point"],
        "prompt": row["prompt"],
    }


@pytest.mark.sandbox
def test_ldb_passing_and_failing_programs(ldb):
    solved = [r for r in ldb if r["is_solved"]][:3]
    for r in solved:  # the final program of a solved task passes every hidden test
        v = verify(r["solution"], "code", meta_of(r))
        assert v.ok and v.score == 1.0, (r["task_id"], v)
    unsolved = [r for r in ldb if not r["is_solved"]][:3]
    assert unsolved
    for r in unsolved:  # LDB's program of an unsolved task fails some hidden test
        v = verify(r["implementations"][-1], "code", meta_of(r))
        assert v.ok and v.score < 1.0, (r["task_id"], v)
        assert v.detail is not None and v.detail["total"] >= 1


@pytest.mark.sandbox
def test_fraction_of_tests_passed(ldb):
    r = next(x for x in ldb if x["task_id"] == "HumanEval/45")  # triangle_area: three asserts
    wrong_one = "def triangle_area(a, h):\n    return 7.5 if (a, h) == (5, 3) else a * h\n"
    v = verify(wrong_one, "code", meta_of(r))
    assert v.detail == {"passed": 1, "total": 3} and v.score == pytest.approx(1 / 3)
    # completion style: the body alone gets the prompt prepended
    assert verify(r["canonical_solution"], "code", meta_of(r)).score == 1.0
    # LDB's visible tests (a list of assert statements) work as well
    assert verify(r["solution"], "code", {"verifier": "code_tests", "tests": r["given_tests"]}).score == 1.0


@pytest.mark.sandbox
def test_infinite_loop_times_out_and_scores_zero(ldb):
    r = next(x for x in ldb if x["task_id"] == "HumanEval/45")
    t0 = time.perf_counter()
    v = code_tests(
        "def triangle_area(a, h):\n    while True:\n        pass\n",
        meta_of(r),
        limits=SandboxLimits(wall_s=1.5, cpu_s=5),
    )
    assert v.score == 0.0 and "timeout" in v.error
    assert time.perf_counter() - t0 < 5


@pytest.mark.sandbox
def test_network_is_unreachable(ldb):
    r = next(x for x in ldb if x["task_id"] == "HumanEval/45")
    at_import = (
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\n"
        "def triangle_area(a, h):\n    return a * h / 2\n"
    )
    v = verify(at_import, "code", meta_of(r))
    assert v.score == 0.0 and v.error.startswith("program: OSError")
    in_call = (
        "import socket\ndef triangle_area(a, h):\n"
        "    socket.create_connection(('127.0.0.1', 9), timeout=2)\n    return a * h / 2\n"
    )
    v = verify(in_call, "code", meta_of(r))
    assert v.score == 0.0 and "Error" in v.error


def test_memory_subprocess_and_writes_are_limited(ldb, tmp_path):
    r = next(x for x in ldb if x["task_id"] == "HumanEval/45")
    ok_body = "\ndef triangle_area(a, h):\n    return a * h / 2\n"
    assert verify("x = bytearray(4 * 1024**3)" + ok_body, "code", meta_of(r)).score == 0.0
    shell = "import subprocess\nsubprocess.run(['sh', '-c', 'true'], check=True)"  # no shell in the sandbox
    assert verify(shell + ok_body, "code", meta_of(r)).score == 0.0
    target = tmp_path / "written"
    assert verify(f"open({str(target)!r}, 'w').write('x')" + ok_body, "code", meta_of(r)).score == 0.0
    assert not target.exists()
    # printing a fake result line cannot forge the score
    forged = 'print(\'{"passed": 3, "total": 3, "errors": []}\')\ndef triangle_area(a, h):\n    return 0\n'
    assert verify(forged, "code", meta_of(r)).score == 0.0


def test_qa_and_math():
    assert (
        verify(
            "<think>x</think><answer> The Eiffel Tower. </answer>",
            "search_r1",
            {"golden_answers": ["eiffel tower"]},
        ).score
        == 1.0
    )
    assert (
        verify(
            "<answer>a</answer> then <answer>Paris</answer>", "search_r1", {"golden_answers": "paris"}
        ).score
        == 1.0
    )
    assert verify("<answer>London</answer>", "search_r1", {"golden_answers": ["Paris"]}).score == 0.0
    f1 = verify("<answer>Eiffel</answer>", "chat", {"verifier": "f1", "golden_answers": ["eiffel tower"]})
    assert f1.score == pytest.approx(2 / 3)
    assert (
        verify(
            "So the answer is $\\boxed{\\frac{1}{2}}$.", "chat", {"verifier": "math", "answer": "0.5"}
        ).score
        == 1.0
    )
    assert verify("The answer is \\boxed{3}", "chat", {"verifier": "math", "answer": "2"}).score == 0.0
    # off the main thread (the stage verifies in a pool) math-verify still answers
    out = {}
    th = threading.Thread(
        target=lambda: out.setdefault(
            "v", verify("\\boxed{x^2+2x+1}", "chat", {"verifier": "math", "answer": "(x+1)^2"})
        )
    )
    th.start()
    th.join(30)
    assert out["v"].score == 1.0


def test_registry_choice_and_failures_never_raise():
    assert {"em", "f1", "math", "code_tests"} <= set(VERIFIERS)
    assert verifier_name("search_r1", None) == "em"
    assert verifier_name("code", "{}") == "code_tests"
    assert verifier_name("chat", json.dumps({"verifier": "math"})) == "math"
    assert verifier_name("chat", {"tests": ["assert True"]}) == "code_tests"
    v = verify("x", "chat", {})
    assert not v.ok and v.score == 0.0 and "no verifier" in v.error
    v = verify("x", "chat", {"verifier": "em"})
    assert not v.ok and "gold" in v.error
    VERIFIERS["_boom"] = lambda out, meta: 1 / 0
    try:
        v = verify("x", "chat", {"verifier": "_boom"})
        assert not v.ok and v.score == 0.0 and "ZeroDivisionError" in v.error
    finally:
        del VERIFIERS["_boom"]
