"""`ldb`: LDB (LLMDebugger) code-repair results, one JSON object per line with `task_id`, `prompt`,
`entry_point`, `test`, `given_tests`, `implementations` (the program at each debugging iteration),
`test_feedback` (per iteration, the visible tests that failed, each as
`assert ... # Real Execution Output: <actual>`), `is_passing` (visible tests), `is_solved` (hidden tests).

`test_feedback[i]` belongs to `implementations[i]`: in the shipped HumanEval file the last entry is empty
exactly when `is_passing`, and every failing line is one of `given_tests`.

Steps: the prompt as a user step; then per iteration an assistant step (the program, verbatim) and a user
step with that iteration's feedback (the failing visible tests verbatim, or a line saying all passed).
verifier_score of iteration i = (visible tests - failing tests) / visible tests. reward = float(is_solved).
traj_id = `<run>:<task_id>`, the run being the file's stem, or for LLMDebugger's own layout
(`<dataset>/<model>/results.jsonl`) its two folders (`SourceRecord.run`): models ingested together stay apart.
"""

from __future__ import annotations

from pipeline.ingest.readers import read_jsonl
from pipeline.ingest.records import (
    INVALID_VALUE,
    LENGTH_MISMATCH,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    require,
)
from pipeline.ingest.registry import adapter

ALL_PASSED = "All visible tests passed."
FAILED_HEADER = "Failing visible tests:"
OUTPUT_MARK = " # Real Execution Output:"


def feedback_text(failing: list[str]) -> str:
    return ALL_PASSED if not failing else FAILED_HEADER + "\n" + "\n".join(failing)


def visible_pass_fraction(given_tests: list[str], failing: list[str]) -> float:
    failed = {line.split(OUTPUT_MARK, 1)[0].strip() for line in failing}
    passed = sum(1 for t in given_tests if t.strip() not in failed)
    return passed / len(given_tests)


def _str_list(value, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise Reject(INVALID_VALUE, f"{name} is not a list of strings", name)
    return value


@adapter("ldb", reader=read_jsonl, action_format="code", extensions=(".jsonl",))
def ldb(record: SourceRecord) -> TrajectoryDraft:
    """LDB code-repair results JSONL (one debugging run per line)."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an object")
    task_id = str(require(data, "task_id"))
    prompt = require(data, "prompt")
    implementations = _str_list(require(data, "implementations"), "implementations")
    feedback = require(data, "test_feedback")
    given_tests = _str_list(require(data, "given_tests"), "given_tests")
    is_solved = require(data, "is_solved")
    if not isinstance(feedback, list) or len(feedback) != len(implementations):
        raise Reject(
            LENGTH_MISMATCH,
            f"{len(implementations)} implementations but "
            f"{len(feedback) if isinstance(feedback, list) else 'no'} test_feedback entries",
            "test_feedback",
        )
    if not implementations:
        raise Reject(INVALID_VALUE, "no implementations", "implementations")
    if not given_tests:
        raise Reject(INVALID_VALUE, "no given_tests", "given_tests")
    steps = [StepDraft(role="user", content=str(prompt))]
    for i, (program, failing) in enumerate(zip(implementations, feedback, strict=True)):
        failing = _str_list(failing, f"test_feedback[{i}]")
        steps.append(
            StepDraft(
                role="assistant", content=program, verifier_score=visible_pass_fraction(given_tests, failing)
            )
        )
        steps.append(StepDraft(role="user", content=feedback_text(failing)))
    meta = {k: data.get(k) for k in ("task_id", "entry_point", "prompt", "test", "given_tests")}
    meta.update(
        {
            k: data.get(k)
            for k in ("is_passing", "is_solved", "debug_iter", "canonical_solution", "seed")
            if k in data
        }
    )
    return TrajectoryDraft(
        traj_id=f"{record.run}:{task_id}",
        group_id=task_id,
        sample_idx=0,
        reward=float(bool(is_solved)) if isinstance(is_solved, bool) else is_solved,
        meta=meta,
        steps=steps,
    )
