"""The code verifier's wire format: plain values as tagged JSON, both ways (standard library only).

Three processes speak it: the candidate's sandbox (returns the candidate's values), the reference sandbox (runs
the tests, never candidate code) and the caller (decides). The sandboxes get this module's source in their job
and exec it (they run `python -I -S` with no package on their path), so it imports nothing but builtins.

Tags: lists {"l"}, tuples {"t"}, sets {"s"}, frozensets {"fs"}, dicts {"d": [[k, v], ...]}, bytes {"b": hex},
complex {"c"}, ints past 62 bits {"i": hex}, an object kept by the process that made it {"h": handle, "o": type
name} and anything else {"o": type name}. Only exact builtin types are plain: a subclass (an int whose
`__eq__` says yes to everything) is an object.

Decoding is bounded: at most `max_nodes` values, nesting at most 200, and a set, frozenset or dict is refused
when more than `MAX_COLLIDING` of its distinct keys share one hash (inserting n keys of one hash costs n^2
comparisons: 80,000 such ints took 42 s of the caller's CPU before this bound).
"""

MAX_NODES = 2_000_000
MAX_DEPTH = 200
MAX_COLLIDING = 64


class DecodeError(ValueError):
    pass


class Opaque:
    """A value that is not plain data: it equals nothing and has no truth value."""

    __slots__ = ("type_name",)

    def __init__(self, type_name):
        self.type_name = str(type_name)[:80]

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    def __hash__(self):
        return hash(("opaque", self.type_name))

    def __bool__(self):
        raise TypeError(f"a {self.type_name} object returned by the program is not plain data")

    def __repr__(self):
        return f"<{self.type_name}>"


def _type_name(t):
    name = getattr(t, "__name__", None)
    return name[:80] if type(name) is str else "object"


def encode(value, handle=None, max_nodes=MAX_NODES):
    """Tagged JSON of `value`; a non-plain value becomes handle(value) (a dict) when that is given and returns
    one, else {"o": type name}. Raises DecodeError past `max_nodes` values or 150 levels."""
    budget = [max_nodes]

    def enc(v, depth):
        budget[0] -= 1
        if budget[0] < 0 or depth > 150:
            raise DecodeError("value too large or nested too deep")
        t = type(v)
        if v is None or t is bool or t is str or t is float:
            return v
        if t is int:
            return v if -(1 << 62) < v < (1 << 62) else {"i": hex(v)}
        if t is list:
            return {"l": [enc(e, depth + 1) for e in v]}
        if t is tuple:
            return {"t": [enc(e, depth + 1) for e in v]}
        if t is set:
            return {"s": [enc(e, depth + 1) for e in v]}
        if t is frozenset:
            return {"fs": [enc(e, depth + 1) for e in v]}
        if t is dict:
            return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
        if t is bytes:
            return {"b": v.hex()}
        if t is complex:
            return {"c": [v.real, v.imag]}
        tagged = handle(v) if handle is not None else None
        return tagged if type(tagged) is dict else {"o": _type_name(t)}

    return enc(value, 0)


def check_hashes(keys):
    """Refuse keys (about to go into a set or dict) where more than MAX_COLLIDING distinct ones share a hash.
    Hashes are grouped by sorting (no hashing of the hashes); equal keys (duplicates) are free."""
    if len(keys) <= MAX_COLLIDING:
        return
    order = sorted(range(len(keys)), key=lambda i: hash(keys[i]))
    hashes = [hash(keys[i]) for i in order]
    start = 0
    for end in range(1, len(order) + 1):
        if end < len(order) and hashes[end] == hashes[start]:
            continue
        if end - start > MAX_COLLIDING:
            first = keys[order[start]]
            differ = sum(1 for i in order[start:end] if not keys[i] == first)
            if differ >= MAX_COLLIDING:
                raise DecodeError(f"{differ + 1} distinct keys share one hash")
        start = end


def decode(v, handle=None, max_nodes=MAX_NODES):
    """Plain values from tagged JSON (see the module docstring); {"h": n} is handle(n) when that is given, else
    an Opaque. Raises DecodeError on anything malformed or past the bounds."""
    budget = [max_nodes]

    def hashed(items):
        try:
            check_hashes(items)
        except TypeError as exc:
            raise DecodeError("unhashable set element or dict key") from exc
        return items

    def dec(v, depth):
        budget[0] -= 1
        if budget[0] < 0 or depth > MAX_DEPTH:
            raise DecodeError("value too large or nested too deep")
        t = type(v)
        if v is None or t is bool or t is int or t is float or t is str:
            return v
        if t is not dict or len(v) not in (1, 2):
            raise DecodeError("malformed value")
        if len(v) == 2:
            if "h" not in v or "o" not in v or type(v["h"]) is not int:
                raise DecodeError("malformed value")
            return handle(v["h"], str(v["o"])) if handle is not None else Opaque(v["o"])
        ((tag, x),) = v.items()
        d = depth + 1
        if tag == "l" and type(x) is list:
            return [dec(e, d) for e in x]
        if tag == "t" and type(x) is list:
            return tuple(dec(e, d) for e in x)
        if tag in ("s", "fs") and type(x) is list:
            items = hashed([dec(e, d) for e in x])
            try:
                return set(items) if tag == "s" else frozenset(items)
            except TypeError as exc:
                raise DecodeError("unhashable set element") from exc
        if tag == "d" and type(x) is list:
            if not all(type(p) is list and len(p) == 2 for p in x):
                raise DecodeError("malformed dict")
            keys = hashed([dec(p[0], d) for p in x])
            try:
                return dict(zip(keys, [dec(p[1], d) for p in x], strict=True))
            except TypeError as exc:
                raise DecodeError("unhashable dict key") from exc
        if tag == "b" and type(x) is str:
            try:
                return bytes.fromhex(x)
            except ValueError as exc:
                raise DecodeError("malformed bytes") from exc
        if tag == "c" and type(x) is list and len(x) == 2:
            try:
                return complex(float(x[0]), float(x[1]))
            except (TypeError, ValueError) as exc:
                raise DecodeError("malformed complex") from exc
        if tag == "i" and type(x) is str and len(x) <= 1 << 16:
            try:
                return int(x, 16)
            except ValueError as exc:
                raise DecodeError("malformed int") from exc
        if tag == "o":
            return Opaque(x)
        raise DecodeError(f"unknown tag {str(tag)[:20]!r}")

    return dec(v, 0)
