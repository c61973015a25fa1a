"""Python code verifier: run the candidate program against its tests in a sandboxed subprocess.

score = passed tests / total tests. Tests come from the trajectory's meta: `tests` (a list of assert
statements, e.g. LDB's given_tests) or `test` + `entry_point` (a HumanEval `check(candidate)` function;
each top-level statement of `check` that contains an assert is one test). The program is the last
```python fenced block of the output, or the whole output; a HumanEval `prompt` in meta is prepended when
the output does not define the entry point (completion-style answers).

The sandbox, honestly: a fresh `python -I` subprocess in an empty temporary folder, own session (killed as
a process group), environment reduced to PATH/LANG (no proxies, no PYTHONPATH), with
- RLIMIT_AS (default 1 GiB) and RLIMIT_CPU (default = wall timeout) and RLIMIT_FSIZE 16 MiB, no core files;
- a wall timeout (default 10 s) after which the group is killed: the candidate scores 0, error 'timeout';
- a PEP 578 audit hook that raises on socket, subprocess/exec/spawn/fork, ctypes and file writes outside
  the temporary folder.
This stops accidental network use, runaway loops and memory blow-ups from model-written code. It is not a
security boundary against deliberately hostile code (an audit hook can be evaded from C, and the process
runs as the same user): for untrusted adversarial code run the verifier inside a container or nsjail.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.verifiers import Verdict, register_verifier

RUNNER = Path(__file__).with_name("_sandbox_runner.py")
_FENCE = re.compile(r"```(?:python|py|Python)?[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    mem_bytes: int = 1 << 30


DEFAULT_LIMITS = SandboxLimits()


def extract_program(output: str) -> str:
    blocks = _FENCE.findall(output)
    return blocks[-1] if blocks else output


def run_tests(
    program: str,
    *,
    tests: list[str] | None = None,
    test_code: str | None = None,
    entry_point: str | None = None,
    limits: SandboxLimits = DEFAULT_LIMITS,
) -> dict:
    """Run in the sandbox; returns {"passed", "total", "errors", "timeout": bool, "crash": str | None}."""
    nonce = secrets.token_hex(16)
    job = {
        "nonce": nonce,
        "program": program,
        "tests": tests,
        "test_code": test_code,
        "entry_point": entry_point,
        "mem_bytes": limits.mem_bytes,
        "cpu_s": limits.cpu_s,
    }
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory(prefix="cf-sandbox-") as work:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(RUNNER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=work,
            env=env,
            start_new_session=True,
            text=True,
        )
        try:
            stdout, stderr = proc.communicate(json.dumps(job), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.communicate()
            return {"passed": 0, "total": 0, "errors": [], "timeout": True, "crash": None}
        finally:
            _kill(proc)
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce):
            res = json.loads(line[len(nonce) :])
            return {**res, "timeout": False, "crash": None}
    why = (
        "killed by CPU limit"
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
        else f"exit {proc.returncode}"
    )
    return {
        "passed": 0,
        "total": 0,
        "errors": [],
        "timeout": False,
        "crash": f"{why}: {stderr.strip()[-300:]}",
    }


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()


@register_verifier("code_tests")
def code_tests(output: str, meta: dict, limits: SandboxLimits | None = None) -> Verdict:
    tests = meta.get("tests") or meta.get("given_tests")
    test_code = meta.get("test")
    entry_point = meta.get("entry_point")
    if not tests and not test_code:
        return Verdict(0.0, "code_tests", ok=False, error="no tests in meta (tests or test + entry_point)")
    program = extract_program(output)
    if entry_point and meta.get("prompt") and not re.search(rf"def\s+{re.escape(entry_point)}\s*\(", program):
        program = meta["prompt"] + program
    cfg = meta.get("sandbox") or {}
    limits = limits or SandboxLimits(
        wall_s=float(cfg.get("wall_s", DEFAULT_LIMITS.wall_s)),
        cpu_s=int(cfg.get("cpu_s", DEFAULT_LIMITS.cpu_s)),
        mem_bytes=int(cfg.get("mem_bytes", DEFAULT_LIMITS.mem_bytes)),
    )
    res = run_tests(
        program,
        tests=list(tests) if tests else None,
        test_code=test_code,
        entry_point=entry_point,
        limits=limits,
    )
    if res["timeout"]:
        return Verdict(0.0, "code_tests", error=f"timeout after {limits.wall_s}s")
    if res["crash"]:
        return Verdict(0.0, "code_tests", error=res["crash"])
    total = int(res["total"])
    if total == 0:
        return Verdict(0.0, "code_tests", ok=False, error="no test statements found")
    detail = {"passed": int(res["passed"]), "total": total}
    err = "; ".join(res["errors"][:3]) or None
    return Verdict(res["passed"] / total, "code_tests", error=err, detail=detail)
