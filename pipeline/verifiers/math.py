"""Math final-answer equivalence with HuggingFace math-verify (LaTeX/expression parsing into SymPy).

math-verify's own timeouts use SIGALRM, which works only in the main thread; elsewhere the check runs in a
daemon worker thread joined with a wall timeout, so the caller never hangs (a stuck SymPy call is left
running in that thread and the verdict is 0 with error 'timeout')."""

from __future__ import annotations

import threading

from pipeline.verifiers import Verdict, gold_answers, register_verifier

TIMEOUT_S = 5.0


def _gold_text(g: str) -> str:
    g = g.strip()
    return g if ("$" in g or "\\boxed" in g) else f"${g}$"


def _check(output: str, golds: list[str], main_thread: bool) -> bool:
    try:
        from math_verify import parse, verify
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "the math verifier needs math-verify: pip install 'creditflow[verify]'"
        ) from exc

    t = int(TIMEOUT_S) if main_thread else None
    pred = parse(output, parsing_timeout=t) if main_thread else parse(output, parsing_timeout=None)
    if not pred:
        return False
    for g in golds:
        gold = (
            parse(_gold_text(g), parsing_timeout=t)
            if main_thread
            else parse(_gold_text(g), parsing_timeout=None)
        )
        if gold and verify(gold, pred, timeout_seconds=t):
            return True
    return False


@register_verifier("math")
def math_equivalence(output: str, meta: dict) -> Verdict:
    golds = gold_answers(meta)
    if not golds:
        return Verdict(0.0, "math", ok=False, error="no gold answer in meta (answer/answers/golden_answers)")
    if threading.current_thread() is threading.main_thread():
        return Verdict(1.0 if _check(output, golds, True) else 0.0, "math")
    box: dict = {}

    def work():
        try:
            box["ok"] = _check(output, golds, False)
        except Exception as exc:  # recorded below
            box["err"] = f"{type(exc).__name__}: {exc}"

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    if worker.is_alive():
        return Verdict(0.0, "math", error=f"timeout after {TIMEOUT_S}s")
    if "err" in box:
        return Verdict(0.0, "math", ok=False, error=box["err"])
    return Verdict(1.0 if box["ok"] else 0.0, "math")
