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
- the *caller* (this module) decides: each `assert E` is split (`split_expr`) into a *skeleton* evaluated
  here by a small safe evaluator (literals, displays, arithmetic, comparisons, boolean logic, subscripts, a
  few pure builtins and `math` functions) and *holes* (calls, test variables) the reference run evaluates and
  returns as plain data, decoded here under bounds (`wire`: size, depth, hash collisions).

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

import ast
import builtins
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from pipeline.config import StageSettings, register_settings
from pipeline.verifiers import Verdict
from pipeline.verifiers.wire import DecodeError, Opaque, check_hashes, decode

__all__ = ["DecodeError", "Opaque", "decode"]  # re-exported: the values a sandbox returns

_FENCE = re.compile(r"```(?:python|py|Python)?[^\n]*\n(.*?)```", re.DOTALL)
RECORDER = "__cf_rec__"  # the child's hole recorder: __cf_rec__(assert_id, [lambda: hole, ...])
HOLE = "__cf_hole_"  # skeleton placeholder names: __cf_hole_0, __cf_hole_1, ...


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


# ---- splitting ------------------------------------------------------------------------------------------


def _hashed(make: Callable[..., Any]) -> Callable[..., Any]:
    """set / frozenset / dict over returned values: refused when many distinct keys share a hash (their
    insertion is quadratic; see wire.check_hashes)."""

    def build(*args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs:
            return make(*args, **kwargs)
        items = list(args[0].items()) if isinstance(args[0], dict) else list(args[0])
        if make is dict:
            check_hashes([p[0] for p in items if isinstance(p, (list, tuple)) and len(p) == 2])
        else:
            check_hashes(items)
        return make(items)

    return build


SAFE_FUNCS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "len": len,
    "round": round,
    "sorted": sorted,
    "set": _hashed(set),
    "frozenset": _hashed(frozenset),
    "list": list,
    "tuple": tuple,
    "dict": _hashed(dict),
    "sum": sum,
    "min": min,
    "max": max,
    "all": all,
    "any": any,
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "isinstance": isinstance,
    "reversed": lambda x: list(reversed(x)),
}
SAFE_TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "list": list,
    "tuple": tuple,
    "dict": dict,
}
SAFE_MATH = {"isclose", "fabs", "sqrt", "floor", "ceil", "isnan", "isinf", "log", "exp", "fsum", "prod"}
MATH_CONSTS = {"pi", "e", "tau", "inf", "nan"}
_SAFE_KW = {"rel_tol", "abs_tol", "reverse", "key", "ndigits", "start", "default"}


class _Splitter:
    """Skeleton + holes of one assert's test expression (see the module docstring)."""

    def __init__(self) -> None:
        self.holes: list[ast.expr] = []

    def hole(self, node: ast.expr) -> ast.expr:
        self.holes.append(node)
        return ast.Name(f"{HOLE}{len(self.holes) - 1}", ast.Load())

    def split(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            if any(isinstance(e, ast.Starred) for e in node.elts):
                return self.hole(node)
            return type(node)(
                [self.split(e) for e in node.elts], *([ast.Load()] if hasattr(node, "ctx") else [])
            )
        if isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None]
            if len(keys) != len(node.keys):  # {**x}
                return self.hole(node)
            return ast.Dict([self.split(k) for k in keys], [self.split(v) for v in node.values])
        if isinstance(node, ast.UnaryOp):
            return ast.UnaryOp(node.op, self.split(node.operand))
        if isinstance(node, ast.BinOp):
            return ast.BinOp(self.split(node.left), node.op, self.split(node.right))
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(node.op, [self.split(v) for v in node.values])
        if isinstance(node, ast.Compare):
            return ast.Compare(self.split(node.left), node.ops, [self.split(c) for c in node.comparators])
        if isinstance(node, ast.IfExp):
            return ast.IfExp(self.split(node.test), self.split(node.body), self.split(node.orelse))
        if isinstance(node, ast.Subscript):
            return ast.Subscript(self.split(node.value), self.split(node.slice), ast.Load())
        if isinstance(node, ast.Slice):
            return ast.Slice(
                *(None if p is None else self.split(p) for p in (node.lower, node.upper, node.step))
            )
        if isinstance(node, ast.Attribute) and _is_math(node.value) and node.attr in MATH_CONSTS:
            return node
        if isinstance(node, ast.Call) and _safe_callee(node.func) and _safe_keywords(node):
            if isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                if not _is_isinstance(node):
                    return self.hole(node)  # isinstance(x, int) / (int, float): the type names stay names
                return ast.Call(node.func, [self.split(node.args[0]), node.args[1]], [])
            return ast.Call(
                node.func,
                [self.split(a) for a in node.args],
                [
                    ast.keyword(k.arg, k.value if k.arg == "key" else self.split(k.value))
                    for k in node.keywords
                ],
            )
        return self.hole(node)


def _is_math(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "math"


def _is_isinstance(node: ast.Call) -> bool:
    if not (isinstance(node.func, ast.Name) and node.func.id == "isinstance" and len(node.args) == 2):
        return False
    t = node.args[1]
    elts = t.elts if isinstance(t, ast.Tuple) else [t]
    return all(isinstance(e, ast.Name) and e.id in SAFE_TYPES for e in elts)


def _safe_callee(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in SAFE_FUNCS
    return isinstance(func, ast.Attribute) and _is_math(func.value) and func.attr in SAFE_MATH


def _safe_keywords(node: ast.Call) -> bool:
    return not any(isinstance(a, ast.Starred) for a in node.args) and all(
        k.arg in _SAFE_KW and not (k.arg == "key" and not isinstance(k.value, ast.Name))
        for k in node.keywords
    )


def split_expr(expr: ast.expr) -> tuple[ast.Expression, list[ast.expr]]:
    """(skeleton, holes): the skeleton names hole i `__cf_hole_i`."""
    sp = _Splitter()
    skeleton = ast.Expression(sp.split(expr))
    return ast.fix_missing_locations(skeleton), sp.holes


@dataclass
class AssertPlan:
    skeleton: ast.Expression
    holes: list[ast.expr]
    source: str  # for error messages


@dataclass
class Unit:
    src: str  # what the child runs: the statement with each assert replaced by a recorder call
    is_test: bool
    bare: bool  # the statement is one assert (it must run exactly once)
    asserts: dict[int, AssertPlan] = field(default_factory=dict)
    error: str | None = None  # unparsable test: it fails


@dataclass
class TestPlan:
    setup: list[str]  # the test module's prelude (HumanEval: imports, METADATA), run before the units
    units: list[Unit]
    total: int
    used: set[str] = field(default_factory=set)  # every name the tests read
    bound: set[str] = field(default_factory=set)  # every name the tests bind


class _AssertRewriter(ast.NodeTransformer):
    def __init__(self, start: int) -> None:
        self.plans: dict[int, AssertPlan] = {}
        self.next = start

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        skeleton, holes = split_expr(node.test)
        aid = self.next
        self.next += 1
        self.plans[aid] = AssertPlan(skeleton, holes, ast.unparse(node)[:200])
        call = ast.Call(
            ast.Name(RECORDER, ast.Load()),
            [ast.Constant(aid), ast.List([ast.Lambda(_no_args(), h) for h in holes], ast.Load())],
            [],
        )
        return ast.copy_location(ast.Expr(call), node)


def _no_args() -> ast.arguments:
    return ast.arguments(
        posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
    )


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def defined_names(program: str) -> set[str]:
    """Top-level names a program binds (functions, classes, assignments, imports); empty if it does not parse."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError):
        return set()
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            out |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return out


def _bound_names(nodes: list[Any]) -> set[str]:
    """Every name the test code binds (assignments, loop targets, imports, definitions), at any depth."""
    out: set[str] = set()
    for tree in nodes:
        for n in ast.walk(tree):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                out |= {(a.asname or a.name).split(".")[0] for a in n.names}
            elif isinstance(n, ast.arg):
                out.add(n.arg)
    return out


def plan_tests(tests: list[str] | None, test_code: str | None) -> TestPlan:
    """Split the tests into units (as the old runner counted them) and every assert into skeleton + holes."""
    setup: list[str] = []
    stmts: list[ast.stmt | str] = []
    if tests:
        for t in tests:
            try:
                body = ast.parse(t).body
            except (SyntaxError, ValueError) as exc:
                stmts.append(f"SyntaxError: {exc}")
                continue
            stmts.append(body[0] if len(body) == 1 else ast.Module(body, []))  # type: ignore[arg-type]
    else:
        tree = ast.parse(test_code or "")
        check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
        if check is None:
            stmts = list(tree.body)
        else:
            setup = [ast.unparse(n) for n in tree.body if n is not check]
            stmts = list(check.body)
    trees = [ast.parse(s) for s in setup] + [s for s in stmts if not isinstance(s, str)]
    used = set().union(*(_names(t) for t in trees)) if trees else set()
    units: list[Unit] = []
    aid = 0
    for st in stmts:
        if isinstance(st, str):
            units.append(Unit("", True, True, error=st))
            continue
        is_test = any(isinstance(x, ast.Assert) for x in ast.walk(st))
        rw = _AssertRewriter(aid)
        new = rw.visit(st)
        aid = rw.next
        module = new if isinstance(new, ast.Module) else ast.Module([new], [])
        src = ast.unparse(ast.fix_missing_locations(module))
        units.append(Unit(src, is_test, isinstance(st, ast.Assert), rw.plans))
    return TestPlan(setup, units, sum(u.is_test for u in units), used, _bound_names(trees))


# standard-library modules the reference does not import for a program that does (they act on the desktop)
NOT_REIMPORTED = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "webbrowser"}


# modules whose names a program may not hand to the reference (`from os import _exit as f` would end the
# reference run, a verifier failure): such a name stays the candidate's, called in its own sandbox
PROCESS_MODULES = {
    "os",
    "posix",
    "sys",
    "signal",
    "subprocess",
    "_thread",
    "threading",
    "multiprocessing",
    "ctypes",
    "resource",
    "faulthandler",
    "atexit",
    "pty",
    "_posixsubprocess",
    "gc",
    "builtins",
    "importlib",
    "time",
}


def _stdlib_root(name: str | None) -> bool:
    root = (name or "").split(".")[0]
    return root in sys.stdlib_module_names and root not in NOT_REIMPORTED


def candidate_surface(
    program: str, plan: TestPlan, entry_point: str | None, prompt: str | None
) -> tuple[list[str], list[str]]:
    """(names the reference binds to the candidate's sandbox, the program's standard-library imports that the
    reference runs itself). A name is the candidate's when the program binds it at top level, the tests read
    it, and it is not a builtin, a module (or a name from one) the program imports from the standard library,
    a name the tests bind or a name the task's prompt defines; the entry point always is."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError):
        tree = ast.Module([], [])
    imports, imported = [], set()
    for node in tree.body:
        if isinstance(node, ast.Import) and all(_stdlib_root(a.name) for a in node.names):
            imports.append(ast.unparse(node))
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and _stdlib_root(node.module)
            and (node.module or "").split(".")[0] not in PROCESS_MODULES
        ):
            imports.append(ast.unparse(node))
            imported |= {a.asname or a.name for a in node.names}
    theirs = defined_names(prompt or "") if entry_point else set()
    names = defined_names(program) & plan.used
    names -= set(dir(builtins)) | imported | plan.bound | theirs | {"candidate", RECORDER}
    names -= {n for n in names if n.startswith(HOLE)}
    if entry_point:
        names.add(entry_point)
    return sorted(names), imports


# ---- the values a sandbox returns: pipeline.verifiers.wire (Opaque, decode, DecodeError) -------------------


# ---- the safe evaluator -------------------------------------------------------------------------------------

_BIN = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
    ast.BitAnd: lambda a, b: a & b,
    ast.BitOr: lambda a, b: a | b,
    ast.BitXor: lambda a, b: a ^ b,
    ast.LShift: lambda a, b: a << b,
    ast.RShift: lambda a, b: a >> b,
}
_CMP = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_MAX_ITEMS = 10_000_000


class EvalError(ValueError):
    pass


def _size_guard(op: ast.operator, a: Any, b: Any) -> None:
    """No huge results from the candidate's values: repetition, products, powers and shifts are bounded."""
    ints = isinstance(a, int) and isinstance(b, int)
    if isinstance(op, ast.Mult):
        for seq, n in ((a, b), (b, a)):
            if (
                isinstance(seq, (str, bytes, list, tuple))
                and isinstance(n, int)
                and len(seq) * n > _MAX_ITEMS
            ):
                raise EvalError("repetition too large")
        if ints and a.bit_length() + b.bit_length() > 1 << 22:
            raise EvalError("product too large")
    if isinstance(op, ast.Pow) and ints and b > 0 and max(a.bit_length(), 1) * b > 1 << 22:
        raise EvalError("power too large")
    if isinstance(op, ast.LShift) and ints and b + a.bit_length() > 1 << 22:
        raise EvalError("shift too large")


def _plain(value: Any) -> Any:
    if isinstance(value, Opaque):
        raise EvalError(f"{value!r} is not plain data")
    return value


def safe_eval(node: ast.AST, env: dict[str, Any]) -> Any:
    """Evaluate a skeleton: only the node kinds `split_expr` keeps, over plain data; never runs user code."""
    ev = safe_eval
    if isinstance(node, ast.Expression):
        return ev(node.body, env)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        raise EvalError(f"unknown name {node.id}")
    if isinstance(node, ast.Tuple):
        return tuple(ev(e, env) for e in node.elts)
    if isinstance(node, ast.List):
        return [ev(e, env) for e in node.elts]
    if isinstance(node, ast.Set):
        return {_plain(ev(e, env)) for e in node.elts}
    if isinstance(node, ast.Dict):
        return {
            _plain(ev(k, env)): ev(v, env)
            for k, v in zip(node.keys, node.values, strict=True)
            if k is not None
        }
    if isinstance(node, ast.UnaryOp):
        x = ev(node.operand, env)
        if isinstance(node.op, ast.Not):
            return not x
        return {ast.USub: lambda v: -v, ast.UAdd: lambda v: +v, ast.Invert: lambda v: ~v}[type(node.op)](
            _plain(x)
        )
    if isinstance(node, ast.BinOp):
        a, b = _plain(ev(node.left, env)), _plain(ev(node.right, env))
        _size_guard(node.op, a, b)
        return _BIN[type(node.op)](a, b)
    if isinstance(node, ast.BoolOp):
        value: Any = None
        for v in node.values:
            value = ev(v, env)
            if isinstance(node.op, ast.And) and not value:
                return value
            if isinstance(node.op, ast.Or) and value:
                return value
        return value
    if isinstance(node, ast.Compare):
        left = ev(node.left, env)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = ev(comp, env)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return ev(node.body, env) if ev(node.test, env) else ev(node.orelse, env)
    if isinstance(node, ast.Subscript):
        return _plain(ev(node.value, env))[_plain(ev(node.slice, env))]
    if isinstance(node, ast.Slice):
        return slice(
            *(None if p is None else _plain(ev(p, env)) for p in (node.lower, node.upper, node.step))
        )
    if isinstance(node, ast.Attribute) and _is_math(node.value) and node.attr in MATH_CONSTS:
        return getattr(math, node.attr)
    if isinstance(node, ast.Call) and _safe_callee(node.func):
        func: Any = node.func
        fn = SAFE_FUNCS[func.id] if isinstance(func, ast.Name) else getattr(math, func.attr)
        if fn is isinstance:
            if not _is_isinstance(node):
                raise EvalError("isinstance against a type that is not a builtin")
            t: Any = node.args[1]
            elts: list[Any] = t.elts if isinstance(t, ast.Tuple) else [t]
            types = tuple(SAFE_TYPES[e.id] for e in elts)
            return isinstance(ev(node.args[0], env), types)
        args = [_plain(ev(a, env)) for a in node.args]
        kwargs: dict[str, Any] = {}
        for k in node.keywords:
            kv: Any = k.value
            if k.arg == "key":  # key=len / key=abs / key=str: only the safe functions
                if not isinstance(kv, ast.Name) or kv.id not in SAFE_FUNCS:
                    raise EvalError("key= is not a safe function")
                kwargs["key"] = SAFE_FUNCS[kv.id]
            elif k.arg is not None:
                kwargs[k.arg] = _plain(ev(kv, env))
        return fn(*args, **kwargs)
    raise EvalError(f"cannot evaluate {type(node).__name__}")


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
    return bool(_plain(value))


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
