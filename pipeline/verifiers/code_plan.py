"""The code verifier's test plan: each assert of the tests split into a skeleton (evaluated by the caller,
`pipeline.verifiers.safe_eval`) and holes (what the reference run computes), the units the tests are counted
in, and the names of the program the reference asks the candidate's sandbox for (see pipeline.verifiers.code)."""

from __future__ import annotations

import ast
import builtins
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.verifiers.wire import check_hashes

RECORDER = "__cf_rec__"  # the child's hole recorder: __cf_rec__(assert_id, [lambda: hole, ...])
HOLE = "__cf_hole_"  # skeleton placeholder names: __cf_hole_0, __cf_hole_1, ...


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
        if isinstance(node, ast.Attribute) and is_math(node.value) and node.attr in MATH_CONSTS:
            return node
        if isinstance(node, ast.Call) and safe_callee(node.func) and _safe_keywords(node):
            if isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                if not is_isinstance(node):
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


def is_math(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "math"


def is_isinstance(node: ast.Call) -> bool:
    if not (isinstance(node.func, ast.Name) and node.func.id == "isinstance" and len(node.args) == 2):
        return False
    t = node.args[1]
    elts = t.elts if isinstance(t, ast.Tuple) else [t]
    return all(isinstance(e, ast.Name) and e.id in SAFE_TYPES for e in elts)


def safe_callee(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in SAFE_FUNCS
    return isinstance(func, ast.Attribute) and is_math(func.value) and func.attr in SAFE_MATH


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
