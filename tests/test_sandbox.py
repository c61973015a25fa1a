"""The code verifier against hostile programs (issue #22): the score cannot be forged, the sandbox holds.

Every probe of the issue is a candidate program here: reading the caller's frame and writing a forged result,
os.truncate/remove/rename outside the sandbox, _posixsubprocess.fork_exec of /bin/sh, a setsid child that
keeps the pipes open past the wall limit, /proc/<ppid>/environ, a 100 MB stdout flood. Normal programs (LDB's
given tests checked against LDB's own execution feedback, HumanEval check()) score as before.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline.verifiers.code as sandbox_code
from pipeline.ingest.ldb import visible_pass_fraction
from pipeline.verifiers import verify, wire
from pipeline.verifiers.code import (
    DEFAULT_LIMITS,
    candidate_surface,
    decode,
    jobs_for,
    plan_tests,
    safe_eval,
    score_plan,
    split_expr,
)
from trainer import sandbox
from trainer.sandbox import SandboxUnavailable, execute, run_tests

needs_bwrap = pytest.mark.sandbox  # skipped, with the reason, where bwrap cannot run (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[1]
FAST = DEFAULT_LIMITS.model_copy(update={"wall_s": 5.0, "cpu_s": 5})


def observe(program: str, limits=FAST, tests=("assert obs() == 0",), meta=None):
    """Run `program` in the sandbox and return the value of the first hole of the first assert (by default its
    `obs()`: what the program could see or do)."""
    plan = plan_tests(list(tests), None)
    out = execute(*jobs_for(plan, program, meta or {}), limits)
    assert out.status == "ok", out
    assert out.result["program_error"] is None, out.result
    ok, value = out.result["units"][0]["rec"]["0"][0][0]
    assert ok == 1, value
    return decode(value)


def meta_with(tests):
    return {"verifier": "code_tests", "tests": tests}


NOBODY = "65534"
PR_SET_CHILD_SUBREAPER = 36


def _process_table() -> dict[int, tuple[str, str, int]]:
    """pid -> (uid, state, parent pid) of every process this /proc shows."""
    table = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                status = (p / "status").read_text()
            except OSError:
                continue
            fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
            try:
                uid, state, ppid = fields["Uid"].split()[0], fields["State"].split()[0], int(fields["PPid"])
            except (KeyError, IndexError, ValueError):
                continue
            table[int(p.name)] = (uid, state, ppid)
    return table


def nobody_processes(root: int | None = None) -> list[int]:
    """The live (not zombie) uid-65534 processes that descend from `root` (this process by default), found by
    walking each one's parent chain. The sandboxes of other processes (another xdist worker, another user of
    the machine) are not counted. A sandbox process orphaned out of this process's tree reparents to init and
    is missed, unless this process adopts orphans while the check runs: see the `reaper` fixture."""
    root = os.getpid() if root is None else root
    table = _process_table()

    def descends(pid: int) -> bool:
        # a parent chain is no longer than the table (this bounds a loop through a pid reused mid-scan)
        for _ in range(len(table)):
            pid = table[pid][2] if pid in table else 0
            if pid == root:
                return True
            if pid <= 1:
                return False
        return False

    return sorted(
        pid for pid, (uid, state, _) in table.items() if uid == NOBODY and state != "Z" and descends(pid)
    )


def _subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@pytest.fixture
def reaper():
    """For one test this process adopts the orphans of its descendants (PR_SET_CHILD_SUBREAPER), so a sandbox
    process that outlived its bwrap stays in this process's tree and nobody_processes() sees it. Afterwards the
    uid-65534 processes left in the tree are killed and the adopted ones reaped (a failed check leaves none)."""
    _subreaper(True)
    try:
        yield
    finally:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            table = _process_table()
            left = [pid for pid in nobody_processes() if pid in table]
            adopted = [p for p, (uid, _, ppid) in table.items() if uid == NOBODY and ppid == os.getpid()]
            if not left and not adopted:
                break
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            for pid in adopted:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            time.sleep(0.02)
        _subreaper(False)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="starting a uid-65534 process needs root")


def _nobody(script: str, **kw) -> subprocess.Popen:
    """`sh -c script` as uid/gid 65534 (no supplementary groups), stdout piped."""
    return subprocess.Popen(
        ["sh", "-c", script],
        user=65534,
        group=65534,
        extra_groups=[],
        stdout=subprocess.PIPE,
        text=True,
        **kw,
    )


LONG_SLEEP = "sleep 30 </dev/null >/dev/null 2>&1 &"


@needs_root
def test_nobody_processes_sees_what_this_process_leaked(reaper):
    """A uid-65534 child, grandchild and orphaned grandchild of this process count as leaked."""
    child = _nobody("exec sleep 30")
    parent = _nobody(LONG_SLEEP + " echo $!; wait")
    grandchild = int(parent.stdout.readline())
    orphaner = _nobody(LONG_SLEEP + " echo $!")
    orphan = int(orphaner.communicate(timeout=10)[0])  # its shell exited: this process adopted the sleep
    try:
        assert _process_table()[orphan][2] == os.getpid()
        assert {child.pid, parent.pid, grandchild, orphan} <= set(nobody_processes())
        child.kill()
        child.wait(timeout=5)
        assert child.pid not in nobody_processes() and grandchild in nobody_processes()
    finally:
        for proc in (child, parent):
            proc.kill()
            proc.wait(timeout=5)


@needs_root
def test_nobody_processes_ignores_a_uid_65534_process_outside_this_process_tree():
    """Another sandbox on the machine (another xdist worker's, another user's) is not this test's leak: a
    uid-65534 process orphaned out of this process's tree (not a subreaper here) is running but not counted."""
    orphaner = _nobody(LONG_SLEEP + " echo $!", start_new_session=True)
    foreign = int(orphaner.communicate(timeout=10)[0])
    try:
        uid, state, ppid = _process_table()[foreign]
        assert uid == NOBODY and state != "Z" and ppid not in (os.getpid(), orphaner.pid)
        assert foreign not in nobody_processes()
        assert foreign in nobody_processes(root=1)  # the whole machine's walk does find it
    finally:
        os.kill(foreign, signal.SIGKILL)


# ---- the score is decided outside the sandbox ------------------------------------------------------------


def test_split_hand_computed():
    skel, holes = split_expr(ast.parse("f(1) == 2", mode="eval").body)
    assert [ast.unparse(h) for h in holes] == ["f(1)"] and ast.unparse(skel) == "__cf_hole_0 == 2"
    skel, holes = split_expr(ast.parse("abs(candidate(1.5) - 0.5) < 1e-06", mode="eval").body)
    assert [ast.unparse(h) for h in holes] == ["candidate(1.5)"]
    assert safe_eval(skel, {"__cf_hole_0": 0.5}) is True and safe_eval(skel, {"__cf_hole_0": 0.4}) is False
    plan = plan_tests(
        None, "def check(candidate):\n    for x in range(3):\n        assert candidate(x) == str(x)\n"
    )
    (unit,) = plan.units
    (ap,) = unit.asserts.values()
    assert [ast.unparse(h) for h in ap.holes] == ["candidate(x)", "x"] and not unit.bare
    assert plan.bound == {"x"} and {"candidate", "range", "str", "x"} <= plan.used


def test_the_caller_bounds_what_it_computes_on_returned_values():
    skel, _ = split_expr(ast.parse("f(1) ** 4096 == 0", mode="eval").body)
    with pytest.raises(ValueError, match="too large"):
        safe_eval(skel, {"__cf_hole_0": 1 << 100_000})
    skel, _ = split_expr(ast.parse("f(1) * 10**9 == []", mode="eval").body)
    with pytest.raises(ValueError, match="too large"):
        safe_eval(skel, {"__cf_hole_0": [0] * 100})
    assert decode({"i": hex(1 << 100)}) == 1 << 100 and decode({"t": [1, {"s": [2]}]}) == (1, {2})


def test_expected_values_never_reach_the_sandbox():
    plan = plan_tests(
        [
            "assert f(1) == 98765",
            "assert f(2) != 'secret-expected'",
            "for x, y in [(3, 55555)]:\n    assert f(x) == y",
        ],
        None,
    )
    cand, ref = jobs_for(plan, "def f(x):\n    return x\n", {"prompt": "secret-prompt"})
    assert set(cand) == {"program", "seed"}  # the candidate's sandbox gets its program, nothing of the tests
    # a literal expected value stays in the caller's skeleton; a loop's table goes to the reference alone
    assert "98765" not in json.dumps(ref) and "55555" in json.dumps(ref) and ref["remote"] == ["f"]


@pytest.mark.parametrize(
    ("program", "tests", "meta", "remote", "imports"),
    [
        # the forge: the expected side calls a builtin the program redefines
        ("def f(x): return 0\ndef pow(*a): return 0\n", ["assert f(3) == pow(2, 3)"], {}, ["f"], []),
        # a standard-library module the program imports (and may patch): the reference imports its own
        (
            "import math\nmath.comb = len\ndef f(x): return 0\n",
            ["assert f(3) == math.comb(5, 2)"],
            {},
            ["f"],
            ["import math"],
        ),
        (
            "from math import comb as c, factorial\nimport os.path, numpy\ndef f(x): return 0\n",
            ["assert f(c(5, 2)) == factorial(3)"],
            {},
            ["f"],
            ["from math import comb as c, factorial"],
        ),
        # the tests' own variables and the prompt's helpers are never the candidate's
        (
            "expected = 0\ndef f(x): return 0\ndef poly(x): return 0\n",
            ["expected = 1\nassert f(1) == expected"],
            {},
            ["f"],
            [],
        ),
        (
            "def poly(xs, x): return 0\ndef find_zero(xs): return 0\n",
            None,
            {
                "entry_point": "find_zero",
                "prompt": "def poly(xs, x):\n    return 1\n",
                "test": "def check(candidate):\n    assert poly([1], candidate([1])) == 0\n",
            },
            ["find_zero"],
            [],
        ),
    ],
)
def test_the_candidates_surface(program, tests, meta, remote, imports):
    """Which names the reference asks the candidate's sandbox for: the program's names the tests read, never a
    builtin, a standard-library name, a test variable or a name of the task's prompt."""
    plan = plan_tests(tests, meta.get("test"))
    ep = meta.get("entry_point")
    assert candidate_surface(program, plan, ep, meta.get("prompt")) == (remote, imports)


@pytest.mark.parametrize(
    "forge",
    [
        # the probe: the caller's frame, a forged result line on every descriptor
        "import sys, os, json\n"
        "def f(x):\n"
        "    fr, seen = sys._getframe(1), []\n"
        "    while fr is not None:\n"
        "        seen.append(dict(fr.f_locals)); fr = fr.f_back\n"
        "    line = json.dumps({'passed': 50, 'total': 2}) + '\\n'\n"
        "    for fd in range(1, 16):\n"
        "        try: os.write(fd, line.encode())\n"
        "        except OSError: pass\n"
        "    print(line)\n"
        "    return 0\n",
        # an object equal to everything, an int subclass equal to everything
        "class E:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
        "def f(x):\n    return E()\n",
        "class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
        "def f(x):\n    return I(0)\n",
        # the builtins the test uses, patched
        "import builtins\nbuiltins.abs = lambda v: 0\nbuiltins.isinstance = lambda *a: True\ndef f(x):\n    return 0\n",
        # a forged document of the child's protocol, then exit before the real one
        "import os, json\n"
        "def f(x):\n"
        "    doc = {'program_error': None, 'units': [{'ok': 1, 'err': None, 'rec': {'0': [[[1, True]]]}}] * 9}\n"
        "    for fd in range(1, 16):\n"
        "        try: os.write(fd, json.dumps(doc).encode())\n"
        "        except OSError: pass\n"
        "    os._exit(0)\n",
        # the recorder, replaced from inside the candidate
        "def f(x):\n"
        "    g = globals()\n"
        "    real = g['__cf_rec__']\n"
        "    g['__cf_rec__'] = lambda aid, thunks: [real(aid, [lambda: 2]) for _ in range(5)]\n"
        "    return 0\n",
    ],
)
@needs_bwrap
def test_forged_results_score_what_the_program_returns(forge):
    tests = ["assert f(1) == 2", "assert abs(f(2) - 4) < 1e-9", "assert isinstance(f(3), int) and f(3) == 6"]
    v = verify(forge, "code", meta_with(tests))
    assert 0.0 <= v.score <= 1.0
    assert v.score == 0.0, v
    good = "def f(x):\n    return 2 * x\n"
    assert verify(good, "code", meta_with(tests)).score == 1.0


# the forges of issue #33: the expected side of an assert evaluated by the candidate, loop tables read
SNOOP = """
import gc, sys
def _seen():
    out, fr = [], sys._getframe(1)
    while fr is not None:
        out.append(repr(fr.f_locals)[:200000])
        fr = fr.f_back
    for o in gc.get_objects():
        if isinstance(o, (dict, list, tuple)):
            try:
                out.append(repr(o)[:20000])
            except Exception:
                pass
    return "\\n".join(out)
"""


@needs_bwrap
@pytest.mark.parametrize(
    ("forge", "tests"),
    [
        # the probe: a builtin the expected side calls, redefined by the program
        ("def f(x):\n    return 0\ndef pow(*a):\n    return 0\n", ["assert f(3) == pow(2, 3)"]),
        (
            "def f(x):\n    return 0\ndef sorted(*a, **k):\n    return 0\n",
            ["assert f(3) == sorted([3, 1])[0] + 1"],
        ),
        # a standard-library module the program imports, patched (as a module, or a name from it)
        (
            "import math\nmath.comb = lambda *a: 0\ndef f(x):\n    return 0\n",
            ["assert f(3) == math.comb(5, 2)"],
        ),
        (
            "import math as m\nm.factorial = lambda *a: 0\ndef f(x):\n    return 0\n",
            ["assert f(3) == m.factorial(3)"],
        ),
        (
            "from math import comb\ncomb = lambda *a: 0\ndef f(x):\n    return 0\n",
            ["assert f(3) == comb(5, 2)"],
        ),
        (
            "import sys\nsys.modules['math'].comb = lambda *a: 0\ndef f(x):\n    return 0\n",
            ["import math\nassert f(3) == math.comb(5, 2)"],
        ),
        # the expected side through a helper the program also defines (the tests' variable, the helper)
        (
            "def f(x):\n    return 0\ndef g(x):\n    return 0\n",
            ["def g(x):\n    return x * 2\nassert f(5) == g(5)"],
        ),
        # a loop's table of expected values, read from the frames or the heap of the candidate's process
        (
            SNOOP + "import re\ndef f(x):\n    m = re.search(r'\\(' + str(x) + r', (-?\\d+)\\)', _seen())\n"
            "    return int(m.group(1)) if m else -1\n",
            ["for x, want in [(1, 71), (2, 72), (3, 73)]:\n    assert f(x) == want"],
        ),
        (
            "import sys\ndef f(x):\n    fr = sys._getframe(1)\n    while fr is not None:\n"
            "        job = fr.f_locals.get('job')\n        if isinstance(job, dict) and 'units' in job:\n"
            "            for u in job['units']:\n                if f'({x}, ' in u:\n"
            "                    return int(u.split(f'({x}, ')[1].split(')')[0])\n        fr = fr.f_back\n"
            "    return -1\n",
            ["for x, want in [(1, 71), (2, 72), (3, 73)]:\n    assert f(x) == want"],
        ),
    ],
)
def test_the_expected_side_is_never_the_candidates(forge, tests):
    v = verify(forge, "code", meta_with(tests))
    assert v.ok and v.score == 0.0, v


@needs_bwrap
@needs_bwrap
@pytest.mark.parametrize(
    "program",
    [
        "from os import _exit as f\n",
        "from time import sleep as f\n",
        "from signal import raise_signal as f\n",
    ],
)
def test_a_program_cannot_hand_the_reference_a_process_call(program):
    """A name the program imports from the standard library is the reference's own, except from modules that
    control the process: `from os import _exit as f` would end the reference run (a verifier failure)."""
    v = sandbox.code_tests(
        program, meta_with(["assert f(9) == 2"]), limits=FAST.model_copy(update={"wall_s": 3.0})
    )
    assert v.ok and v.score == 0.0, v


@needs_bwrap
def test_a_table_lookup_program_sees_no_expected_value():
    """What the candidate's process holds while its function runs: its arguments, never the tests."""
    prog = SNOOP + "def f(x):\n    return _seen()\n"
    seen = observe(
        prog, tests=["for x, want in [(1, 987654), (2, 'secret-expected')]:\n    assert f(x) == want"]
    )
    assert "987654" not in seen and "secret-expected" not in seen and "f(x) == want" not in seen


@needs_bwrap
def test_humaneval_expected_values_from_the_prompts_helpers():
    """HumanEval/32 checks `poly(coeffs, candidate(coeffs))`: `poly` is the prompt's, whatever the program
    defines under that name (before: the program's own poly decided)."""
    prompt = "import math\n\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n\n\ndef find_zero(xs):\n    pass\n"
    test = "def check(candidate):\n    for xs in ([1, 2], [-6, 11, -6, 1]):\n        assert math.fabs(poly(xs, candidate(xs))) < 1e-4\n"
    meta = {
        "verifier": "code_tests",
        "entry_point": "find_zero",
        "prompt": prompt,
        "test": "import math\n" + test,
    }
    forge = "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 12345.0\n"
    assert verify(forge, "code", meta).score == 0.0
    good = (
        "def find_zero(xs):\n    lo, hi = -100.0, 100.0\n"
        "    f = lambda x: sum(c * x**i for i, c in enumerate(xs))\n"
        "    for _ in range(200):\n        mid = (lo + hi) / 2\n"
        "        if (f(lo) < 0) == (f(mid) < 0):\n            lo = mid\n        else:\n            hi = mid\n"
        "    return lo\n"
    )
    assert verify(good, "code", meta).score == 1.0


@needs_bwrap
def test_objects_methods_and_in_place_arguments_still_work():
    """What crossed freely when tests ran beside the program: a returned object's methods, a generator, a
    list the candidate sorts in place. An object is a handle in the candidate's sandbox: it equals nothing."""
    prog = (
        "class Solution:\n    def twice(self, x):\n        return 2 * x\n"
        "def gen(n):\n    yield from range(n)\n"
        "def sort_in_place(xs):\n    xs.sort()\n"
        "def boom(x):\n    raise ValueError('no')\n"
        "class Eq:\n    def __eq__(self, o):\n        return True\n"
        "def eq():\n    return Eq()\n"
    )
    tests = [
        "assert Solution().twice(4) == 8",
        "assert [v for v in gen(3)] == [0, 1, 2]",  # (`list(gen(3))` is the caller's list of an opaque value)
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
        "try:\n    boom(1)\n    ok = False\nexcept ValueError:\n    ok = True\nassert ok",
        "assert eq() == 1",
    ]
    res = run_tests(prog, tests=tests, limits=FAST)
    assert res["passed"] == 4 and "eq() == 1" in res["errors"][0], res


@needs_bwrap
def test_a_program_cannot_rebind_the_tests_variables():
    """`expected` is the tests' variable: the candidate's global of that name (set from inside its function,
    after the setup ran) is not what the assert compares with."""
    meta = {
        "verifier": "code_tests",
        "entry_point": "f",
        "test": "def check(candidate):\n    expected = 10\n    assert candidate(1) == expected\n",
    }
    forge = "expected = 0\ndef f(x):\n    globals()['expected'] = 99\n    return 99\n"
    assert verify(forge, "code", meta).score == 0.0
    assert verify("def f(x):\n    return 10\n", "code", meta).score == 1.0


_JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)


def _json_containers(inner):
    """A level of JSON containers over `inner` (a named function: hypothesis reads an extend function's source
    to check that it recurses, and warns (deprecated) when it cannot see `inner` used, as with some lambdas)."""
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)


_json = st.recursive(_JSON_LEAVES, _json_containers, max_leaves=30)


def test_the_json_strategy_validates_without_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a HypothesisDeprecationWarning fails here
        st.recursive(_JSON_LEAVES, _json_containers, max_leaves=30).validate()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cand=_json, ref=_json, units=st.lists(_json, max_size=4))
def test_any_child_document_scores_in_range(cand, ref, units):
    """The child's document is untrusted: whatever it says, the score is in [0, 1] and nothing raises."""
    plan = plan_tests(["assert f(1) == 2", "for x in range(2):\n    assert f(x) == y", "assert f(0)"], None)
    for doc in (cand, ref, {"units": units}, {"units": [{"ok": 1, "rec": {"0": u}} for u in units]}):
        passed, _ = score_plan(plan, doc if isinstance(doc, dict) else None)
        assert 0 <= passed <= plan.total == 3


# ---- the sandbox is a boundary ---------------------------------------------------------------------------


@needs_bwrap
def test_files_outside_are_unchanged(tmp_path):
    victims = {name: tmp_path / name for name in ("truncate", "remove", "rename", "write", "chmod")}
    for p in victims.values():
        p.write_text("keep")
    prog = f"""
import os
V = {json.dumps({k: str(p) for k, p in victims.items()})}
def attempt(fn):
    try:
        fn()
        return "done"
    except BaseException as exc:
        return type(exc).__name__
def obs():
    return [
        attempt(lambda: os.truncate(V["truncate"], 0)),
        attempt(lambda: os.remove(V["remove"])),
        attempt(lambda: os.rename(V["rename"], V["rename"] + ".moved")),
        attempt(lambda: open(V["write"], "w").write("pwned")),
        attempt(lambda: os.chmod(V["chmod"], 0o777)),
        attempt(lambda: open("/usr/cf-sandbox-probe", "w")),
        attempt(lambda: os.truncate("/run/cf/child.py", 0)),
    ]
"""
    seen = observe(prog)
    assert "done" not in seen, seen
    for p in victims.values():
        assert p.read_text() == "keep" and oct(p.stat().st_mode)[-3:] != "777"
    assert not (tmp_path / "rename.moved").exists()


@needs_bwrap
def test_no_shell_and_fork_exec_is_contained(tmp_path):
    marker = tmp_path / "marker"
    prog = f"""
import os, sys, subprocess, _posixsubprocess
def attempt(fn):
    try:
        return repr(fn())
    except BaseException as exc:
        return type(exc).__name__
def fork_exec_sh():
    r, w = os.pipe()
    errpipe_read, errpipe_write = os.pipe()
    pid = _posixsubprocess.fork_exec(
        [b"/bin/sh", b"-c", b"echo shell-ran; touch {marker}"], [b"/bin/sh"], True,
        tuple(sorted((w, errpipe_write))), None, None,
        -1, -1, -1, w, -1, -1, errpipe_read, errpipe_write, False, False, -1, None, None, None, -1, None, False)
    os.close(errpipe_write)
    os.close(w)
    err = os.read(errpipe_read, 200).decode(errors="replace")
    out = os.read(r, 200).decode(errors="replace")
    os.waitpid(pid, 0)
    return out or err[:60]
def obs():
    return [
        attempt(fork_exec_sh),
        attempt(lambda: subprocess.run(["/bin/sh", "-c", "true"]).returncode),
        attempt(lambda: os.system("touch {marker}")),
        attempt(lambda: subprocess.run([sys.executable, "-c", "open({str(marker)!r}, 'w')"]).returncode),
    ]
"""
    seen = observe(prog)
    assert (
        "shell-ran" not in seen[0]
        and "OSError" in seen[0]
        and seen[1] == "PermissionError"
        and seen[2] != "0"
    ), seen
    assert seen[3] == "1"  # the interpreter runs, inside: the host's folder is not there
    assert not marker.exists()


@needs_bwrap
@pytest.mark.parametrize("hang", [False, True])
def test_wall_limit_holds_with_a_setsid_child_on_the_pipes(hang, reaper):
    prog = (
        "import os, time, subprocess, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "def f(x):\n" + ("    while True:\n        pass\n" if hang else "    return 2 * x\n")
    )
    limits = DEFAULT_LIMITS.model_copy(update={"wall_s": 2.0, "cpu_s": 10})
    t0 = time.perf_counter()
    res = run_tests(prog, tests=["assert f(1) == 2"], limits=limits)
    took = time.perf_counter() - t0
    assert took < limits.wall_s + 1.0, took
    assert res["timeout"] if hang else res["passed"] == 1
    deadline = time.time() + 2
    while nobody_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert nobody_processes() == []  # the setsid children died with the sandbox


@needs_bwrap
def test_fork_bomb_is_capped_and_cleaned_up(reaper):
    prog = (
        "import os\n"
        "n = 0\n"
        "for _ in range(10000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            import time; time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "def obs():\n    return n\n"
    )
    forked = observe(prog)
    assert 0 < forked < DEFAULT_LIMITS.nproc
    deadline = time.time() + 2
    while nobody_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert nobody_processes() == []


@needs_bwrap
def test_no_environment_or_caller_leaks(monkeypatch):
    monkeypatch.setenv("CF_SANDBOX_SECRET", "s3cret-probe-value")
    prog = f"""
import os
def obs():
    seen = [repr(dict(os.environ))]
    for pid in os.listdir("/proc"):
        for f in ("environ", "cmdline"):
            try:
                seen.append(open(f"/proc/{{pid}}/{{f}}", "rb").read().decode(errors="replace"))
            except OSError:
                pass
    for pid in ({os.getpid()}, {os.getppid()}):
        try:
            seen.append(open(f"/proc/{{pid}}/environ", "rb").read().decode(errors="replace"))
        except OSError:
            pass
    return [sorted(os.environ), sorted(os.listdir("/")), "\\n".join(seen), os.getuid()]
"""
    env, root, seen, uid = observe(prog)
    assert "s3cret-probe-value" not in seen
    assert set(env) <= {"PATH", "LANG", "HOME", "PWD", "LC_CTYPE"}
    assert "work" not in root and "home" not in root and "etc" not in root
    assert uid != 0


@needs_bwrap
def test_network_is_not_there():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        prog = f"""
import socket
def obs():
    out = []
    for addr in (("127.0.0.1", {port}), ("1.1.1.1", 53)):
        try:
            socket.create_connection(addr, timeout=2).close()
            out.append("connected")
        except OSError as exc:
            out.append(type(exc).__name__)
    return out
"""
        assert "connected" not in observe(prog)
    finally:
        server.close()


@needs_bwrap
def test_tmp_is_private_and_root_read_only():
    prog = """
import os
def obs():
    had = os.path.exists("/tmp/cf-left-behind")
    open("/tmp/cf-left-behind", "w").write("x")
    try:
        open("/usr/lib/cf-probe", "w")
        ro = "writable"
    except OSError as exc:
        ro = type(exc).__name__
    return [had, ro]
"""
    assert observe(prog) == [False, "OSError"]
    assert observe(prog) == [False, "OSError"]  # the next run gets a fresh /tmp
    assert not Path("/tmp/cf-left-behind").exists()


@needs_bwrap
def test_stdout_flood_is_bounded_and_the_caller_stays_small():
    prog = (
        "import os\n"
        "block = b'x' * (1 << 20)\n"
        "for _ in range(100):\n"
        "    for fd in (1, 2, 3, 4, 5):\n"
        "        try: os.write(fd, block)\n"
        "        except OSError: pass\n"
        "def f(x):\n    return 2 * x\n"
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    v = verify(prog, "code", meta_with(["assert f(1) == 2"]))
    took = time.perf_counter() - t0
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert v.score == 0.0 and "output" in v.error, v
    assert grew_mb < 64, grew_mb
    assert took < 5


@needs_bwrap
def test_memory_limit():
    prog = "def obs():\n    try:\n        bytearray(3 << 30)\n        return 'allocated'\n    except MemoryError:\n        return 'MemoryError'\n"
    assert observe(prog) == "MemoryError"


@needs_bwrap
def test_memory_limit_holds_for_the_whole_sandbox(reaper):
    """Issue #33: RLIMIT_AS is per process; 5 children x 900 MB took 3.96 GB with mem_bytes = 1 GiB. The
    caller sums the resident memory of each sandbox's process tree and kills it past mem_bytes."""
    limits = FAST.model_copy(update={"mem_bytes": 256 << 20})
    prog = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(5):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.setsid()\n"
        "        block = b'\\x01' * (120 << 20)\n"
        "        time.sleep(20)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "time.sleep(2)\n"
        "def f(x):\n    return 2 * x\n"
    )
    t0 = time.perf_counter()
    res = run_tests(prog, tests=["assert f(1) == 2"], limits=limits)
    assert res["passed"] == 0 and "resident" in (res["crash"] or ""), res
    assert time.perf_counter() - t0 < 4
    deadline = time.time() + 2
    while nobody_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert nobody_processes() == []
    # one process within the limit is fine
    one = "block = b'\\x01' * (120 << 20)\ndef f(x):\n    return 2 * x\n"
    assert run_tests(one, tests=["assert f(1) == 2"], limits=limits)["passed"] == 1


def test_refuses_without_the_sandbox_unless_told(monkeypatch):
    monkeypatch.setitem(sandbox._probe, "bwrap", "bwrap: not installed (test)")
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    good = "def f(x):\n    return 2 * x\n"
    v = verify(good, "code", meta_with(["assert f(1) == 2"]))
    assert not v.ok and v.score == 0.0 and "refusing to run candidate code" in v.error
    with pytest.raises(SandboxUnavailable, match="unsafe_no_sandbox"):
        run_tests(good, tests=["assert f(1) == 2"])
    unsafe = DEFAULT_LIMITS.model_copy(update={"unsafe_no_sandbox": True})
    assert run_tests(good, tests=["assert f(1) == 2", "assert f(2) == 5"], limits=unsafe)["passed"] == 1
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    assert verify(good, "code", meta_with(["assert f(1) == 2"])).score == 1.0
    forged = "class E:\n    __eq__ = lambda s, o: True\ndef f(x):\n    return E()\n"
    assert verify(forged, "code", meta_with(["assert f(1) == 2"])).score == 0.0  # unforgeable still


def test_settings_are_a_config_stage():
    from pipeline.config import Config, ConfigError, apply_overrides

    data = apply_overrides({}, ["sandbox.wall_s=3", "sandbox.unsafe_no_sandbox=true"])
    cfg = Config(**data)
    cfg.check()
    s = sandbox.configure(config=cfg)
    try:
        assert s.wall_s == 3 and s.unsafe_no_sandbox and sandbox.current_settings() is s
    finally:
        sandbox.configure()
    with pytest.raises(ConfigError, match="sandbox"):
        Config(stages={"sandbox": {"wall_seconds": 3}}).check()


def test_the_flow_registers_the_code_verifier():
    """pipeline/ cannot import the trainer floor: the flow's stage effects (flows.batch.stage_io) register it."""
    code = (
        "from pipeline.verifiers import VERIFIERS, verify\n"
        "v = verify('def f(x): return x', 'code', {'tests': ['assert f(1) == 1']})\n"
        "assert 'code_tests' not in VERIFIERS and not v.ok and 'trainer.sandbox' in v.error, v\n"
        "from flows.batch import stage_io\n"
        "from pipeline.config import Config\n"
        "stage_io(Config(stages={'sandbox': {'wall_s': 4}}))\n"
        "import trainer.sandbox as sb\n"
        "assert 'code_tests' in VERIFIERS and sb.current_settings().wall_s == 4\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# ---- normal programs score as before ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def ldb(real_data):
    path = real_data / "ldb_code_repair" / "humaneval-gpt-3.5-turbo-0613.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@needs_bwrap
def test_given_tests_agree_with_ldbs_own_execution(ldb):
    """LDB ran each implementation on its visible tests and recorded the failures: the same fractions."""
    cases = [(r, i) for r in ldb for i in range(len(r["implementations"]))]
    for r, i in random.Random(7).sample(cases, 40):
        v = verify(r["implementations"][i], "code", meta_with(r["given_tests"]))
        want = visible_pass_fraction(r["given_tests"], r["test_feedback"][i])
        assert v.ok and v.score == pytest.approx(want), (r["task_id"], i, v, want)


@needs_bwrap
def test_humaneval_check_with_loops_and_setup(ldb):
    """The check() functions that are more than asserts (loops, random inputs, setup) use the reference run."""
    by_id = {r["task_id"]: r for r in ldb}
    for tid in ("HumanEval/44", "HumanEval/53", "HumanEval/151", "HumanEval/38", "HumanEval/50"):
        r = by_id[tid]
        meta = {
            "verifier": "code_tests",
            "test": r["test"],
            "entry_point": r["entry_point"],
            "prompt": r["prompt"],
        }
        assert verify(r["prompt"] + r["canonical_solution"], "code", meta).score == 1.0, tid
        wrong = f"def {r['entry_point']}(*args):\n    return 0\n"
        assert verify(wrong, "code", meta).score < 1.0, tid


# ---- a record's meta.sandbox may tighten the operator's limits, never loosen them (issue #33) -------------

_LIMIT_VALUES = (
    st.none()
    | st.booleans()
    | st.text(max_size=4)
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.lists(st.integers(), max_size=2)
)


@settings(max_examples=300, deadline=None)
@given(
    requested=st.dictionaries(
        st.sampled_from([*sandbox_code.TIGHTENABLE, "unsafe_no_sandbox", "drop_root", "x"]), _LIMIT_VALUES
    )
    | _LIMIT_VALUES
)
def test_record_limits_only_tighten(requested):
    ceiling = DEFAULT_LIMITS.model_copy(update={"wall_s": 7.5, "mem_bytes": 1 << 29})
    try:
        got = sandbox_code.tightened(ceiling, requested)
    except sandbox_code.LimitError:
        return
    for key in sandbox_code.TIGHTENABLE:
        assert 0 < getattr(got, key) <= getattr(ceiling, key), key
        assert type(getattr(got, key)) is type(getattr(ceiling, key))
    assert got.unsafe_no_sandbox is False


@pytest.mark.parametrize(
    "requested",
    [
        {"mem_bytes": -1},
        {"wall_s": "ten"},
        {"wall_s": float("nan")},
        {"cpu_s": 0},
        {"unsafe_no_sandbox": True},
        "fast",
        {"nproc": True},
    ],
)
def test_a_bad_record_limit_is_that_records_error(requested, monkeypatch):
    """Before: {"mem_bytes": -1} removed the memory limit, {"wall_s": "ten"} raised out of code_tests."""
    ran = []
    monkeypatch.setattr(sandbox, "execute", lambda *a, **k: ran.append(a))
    meta = {**meta_with(["assert f(1) == 2"]), "sandbox": requested}
    v = sandbox.code_tests("def f(x):\n    return 2 * x\n", meta)
    assert not v.ok and v.score == 0.0 and "meta.sandbox" in v.error, v
    assert ran == []


@needs_bwrap
def test_a_record_cannot_lift_the_operators_limits():
    limits = DEFAULT_LIMITS.model_copy(update={"wall_s": 2.0, "cpu_s": 5, "mem_bytes": 1 << 30})
    sleeper = "import time\ntime.sleep(25)\ndef f(x):\n    return 2 * x\n"
    t0 = time.perf_counter()
    v = sandbox.code_tests(
        sleeper, {**meta_with(["assert f(1) == 2"]), "sandbox": {"wall_s": 1e9}}, limits=limits
    )
    assert v.score == 0.0 and "timeout" in v.error and time.perf_counter() - t0 < 6, v
    hog = "x = bytearray(2 << 30)\ndef f(x):\n    return 2 * x\n"
    v = sandbox.code_tests(
        hog, {**meta_with(["assert f(1) == 2"]), "sandbox": {"mem_bytes": 8 << 30}}, limits=limits
    )
    assert v.score == 0.0 and "MemoryError" in v.error, v
    # tightening holds: a record may ask for less
    slow = "import time\ndef f(x):\n    time.sleep(1.5)\n    return 2 * x\n"
    assert sandbox.code_tests(slow, meta_with(["assert f(1) == 2"]), limits=limits).score == 1.0
    v = sandbox.code_tests(
        slow, {**meta_with(["assert f(1) == 2"]), "sandbox": {"wall_s": 0.5}}, limits=limits
    )
    assert v.score == 0.0 and "timeout" in v.error, v


# ---- the caller cannot be stalled by what it decodes (issue #33: 80k colliding set elements, 42 s CPU) ------

M61 = (1 << 61) - 1  # CPython hashes an int modulo this: 1 + k * M61 all hash to 1


def _colliding(n):
    return [{"i": hex(1 + k * M61)} for k in range(n)]


def test_colliding_keys_are_refused_not_inserted():
    with pytest.raises(sandbox_code.DecodeError, match="share one hash"):
        decode({"s": _colliding(20_000)})
    with pytest.raises(sandbox_code.DecodeError, match="share one hash"):
        decode({"fs": _colliding(20_000)})
    with pytest.raises(sandbox_code.DecodeError, match="share one hash"):
        decode({"d": [[k, 0] for k in _colliding(20_000)]})
    with pytest.raises(sandbox_code.DecodeError, match="share one hash"):  # inside a tuple: the same hashes
        decode({"s": [{"t": [k]} for k in _colliding(20_000)]})
    # the caller's own set() over a returned list is bounded the same way
    skel, _ = split_expr(ast.parse("set(f(1)) == {1}", mode="eval").body)
    with pytest.raises(ValueError, match="share one hash"):
        safe_eval(skel, {"__cf_hole_0": [1 + k * M61 for k in range(20_000)]})
    # duplicates and ordinary keys are not collisions
    assert decode({"s": [7] * 100_000}) == {7}
    assert len(decode({"s": list(range(100_000))})) == 100_000
    assert decode({"s": _colliding(wire.MAX_COLLIDING)})  # a few collisions are fine


_PLAIN = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=4)
    | st.binary(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.frozensets(st.integers() | st.text(max_size=3), max_size=4)
        | st.dictionaries(st.integers() | st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(value=_PLAIN)
def test_plain_values_cross_unchanged(value):
    assert decode(json.loads(json.dumps(wire.encode(value)))) == value


@needs_bwrap
def test_a_forged_colliding_answer_does_not_stall_anyone():
    """The candidate writes its own answer line, a set of 80,000 colliding ints, on every descriptor."""
    prog = (
        "import os, json\n"
        f"M = {M61}\n"
        "def f(x):\n"
        "    doc = {'ok': 1, 'value': {'s': [{'i': hex(1 + k * M)} for k in range(80000)]}, 'post': []}\n"
        "    line = (json.dumps(doc) + '\\n').encode()\n"
        "    for fd in range(1, 20):\n"
        "        try: os.write(fd, line)\n"
        "        except OSError: pass\n"
        "    return {1}\n"
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    t0 = time.perf_counter()
    res = run_tests(prog, tests=["assert f(1) == {1}", "assert len(f(2)) == 1"], limits=FAST)
    assert res["passed"] == 0, res
    assert time.perf_counter() - t0 < FAST.wall_s + 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_utime - before < 2.0


# ---- the relay's outcome does not depend on which sandbox is faster (was tests/test_sandbox_protocol.py: in
# this file so that under `--dist loadfile` its many sandboxes never run beside the nobody_processes() checks,
# which since count only this process's tree)
# The two-sandbox relay's outcome does not depend on which sandbox is faster (trainer.sandbox._relay).
#
# A program that does not run (a syntax error, an exception at import) defines nothing the reference can ask
# for, so the reference's tests fail on their own with NameError and its document may arrive before the
# candidate's hello. The relay holds that document until the hello, and a program error in the hello wins:
# the same program gives the same result every run.

PROTOCOL_LIMITS = DEFAULT_LIMITS.model_copy(update={"wall_s": 10.0, "cpu_s": 5})
PROTOCOL_TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
PROTOCOL_RUNS = 20


def _protocol_run(program: str) -> dict:
    return run_tests(program, tests=PROTOCOL_TESTS, limits=PROTOCOL_LIMITS)


@needs_bwrap
def test_a_late_program_error_wins_over_an_early_reference_document():
    """The candidate sleeps before it raises: the reference (nothing to ask) is done long before the hello.
    Before the fix this was reported as two NameErrors every time."""
    out = _protocol_run("import time\ntime.sleep(0.5)\nraise ValueError('late')\n")
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
        out = _protocol_run("import os\nos._exit(3)\n")
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
def test_the_same_program_gives_the_same_result_every_protocol_run(name):
    program, program_error = PROGRAMS[name]
    results = [_protocol_run(program) for _ in range(PROTOCOL_RUNS)]
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
    out = run_tests("while True:\n    pass\n", tests=PROTOCOL_TESTS, limits=limits)
    assert out == {"passed": 0, "total": 2, "errors": [], "timeout": True, "crash": None}
