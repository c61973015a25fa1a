"""The caller's safe evaluator of an assert's skeleton (`pipeline.verifiers.code_plan.split_expr`): literals,
displays, arithmetic, comparisons, boolean logic, subscripts, a few pure builtins and `math` functions, over
plain data decoded from the reference run; it never runs user code and bounds the size of what it builds."""

from __future__ import annotations

import ast
import math
from typing import Any

from pipeline.verifiers.code_plan import (
    MATH_CONSTS,
    SAFE_FUNCS,
    SAFE_TYPES,
    is_isinstance,
    is_math,
    safe_callee,
)
from pipeline.verifiers.wire import Opaque

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


def plain(value: Any) -> Any:
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
        return {plain(ev(e, env)) for e in node.elts}
    if isinstance(node, ast.Dict):
        return {
            plain(ev(k, env)): ev(v, env)
            for k, v in zip(node.keys, node.values, strict=True)
            if k is not None
        }
    if isinstance(node, ast.UnaryOp):
        x = ev(node.operand, env)
        if isinstance(node.op, ast.Not):
            return not x
        return {ast.USub: lambda v: -v, ast.UAdd: lambda v: +v, ast.Invert: lambda v: ~v}[type(node.op)](
            plain(x)
        )
    if isinstance(node, ast.BinOp):
        a, b = plain(ev(node.left, env)), plain(ev(node.right, env))
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
        return plain(ev(node.value, env))[plain(ev(node.slice, env))]
    if isinstance(node, ast.Slice):
        return slice(*(None if p is None else plain(ev(p, env)) for p in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Attribute) and is_math(node.value) and node.attr in MATH_CONSTS:
        return getattr(math, node.attr)
    if isinstance(node, ast.Call) and safe_callee(node.func):
        return _call(node, env)
    raise EvalError(f"cannot evaluate {type(node).__name__}")


def _call(node: ast.Call, env: dict[str, Any]) -> Any:
    """A call of a safe builtin or `math` function (isinstance only against builtin types; key= only a safe
    function), its arguments plain data."""
    func: Any = node.func
    fn = SAFE_FUNCS[func.id] if isinstance(func, ast.Name) else getattr(math, func.attr)
    if fn is isinstance:
        if not is_isinstance(node):
            raise EvalError("isinstance against a type that is not a builtin")
        t: Any = node.args[1]
        elts: list[Any] = t.elts if isinstance(t, ast.Tuple) else [t]
        types = tuple(SAFE_TYPES[e.id] for e in elts)
        return isinstance(safe_eval(node.args[0], env), types)
    args = [plain(safe_eval(a, env)) for a in node.args]
    kwargs: dict[str, Any] = {}
    for k in node.keywords:
        kv: Any = k.value
        if k.arg == "key":  # key=len / key=abs / key=str: only the safe functions
            if not isinstance(kv, ast.Name) or kv.id not in SAFE_FUNCS:
                raise EvalError("key= is not a safe function")
            kwargs["key"] = SAFE_FUNCS[kv.id]
        elif k.arg is not None:
            kwargs[k.arg] = plain(safe_eval(kv, env))
    return fn(*args, **kwargs)
