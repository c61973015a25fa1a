"""Runs inside the sandbox (started by trainer.sandbox as `python -I -S`; stdlib only; never imported).

Reads one JSON job line from stdin: {"role", "wire", "limits", ...}; `wire` is the source of
pipeline/verifiers/wire.py (the value format), exec'd here. Sets the rlimits, drops to the `nobody` user when
started as root (bubblewrap runs as root without a user namespace, so RLIMIT_NPROC counts a real, unprivileged
user), points fds 0-1 at /dev/null and then speaks one JSON document per line on the saved descriptors:

- role "candidate" ({"program"}): runs the program, answers {"program_error": str | null}, then serves calls
  {"target": [name | handle, attr, ...], "op": "call" | "iter", "args", "kwargs", "unit"} with
  {"ok": 1, "value", "post": [[i, value], ...]} (the list, dict and set arguments after the call) or
  {"ok": 0, "exc": type name, "msg"}. Values it cannot send as plain data stay here as handles. It never sees
  a test, an expected value or the reference's namespace: only the arguments of its calls.
- role "reference" ({"prompt", "imports", "remote", "entry_point", "setup", "units", "seed"}): never runs
  candidate code. It runs the task's prompt, the program's standard-library imports (its own copies of the
  modules), binds each name in `remote` to a stub that sends the call to the candidate (through the caller)
  and decodes the answer as plain data, then runs the setup and each unit (asserts were rewritten by the
  caller into `__cf_rec__(id, [lambda: hole, ...])`) and sends {"done": {"program_error", "units": [{"ok",
  "err", "rec": {id: [[[1, value] | [0, error], ...], ...]}}]}}. It decides nothing: the caller does.
"""

import builtins
import json
import os
import resource

TYPE_CHECKING = (
    False  # the child imports nothing it does not use (typing included); its annotations are local
)
if TYPE_CHECKING:
    from typing import Any

NOBODY = 65534
MAX_LINE = 64 << 20
MAX_HANDLES = 10_000
MAX_ITEMS = 1_000_000


def _limits(lim):
    def cap(which, value):
        value = int(value)
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_AS, lim["mem_bytes"])
    cpu = int(lim["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    cap(resource.RLIMIT_FSIZE, lim["fsize_bytes"])
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NOFILE, 64)
    if os.getuid() == 0 and lim.get("drop_root"):
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)  # all capabilities go with uid 0
        if os.getuid() != NOBODY or os.geteuid() != NOBODY:
            raise SystemExit("sandbox: could not drop root")
    cap(resource.RLIMIT_NPROC, lim["nproc"])


class Lines:
    """Newline-delimited JSON on two raw descriptors."""

    def __init__(self, rfd, wfd):
        self.rfd, self.wfd, self.buf = rfd, wfd, b""

    def read(self):
        while b"\n" not in self.buf:
            chunk = os.read(self.rfd, 1 << 16)
            if not chunk:
                raise SystemExit(0)  # the caller is gone
            self.buf += chunk
            if len(self.buf) > MAX_LINE:
                raise SystemExit("sandbox: line too long")
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, doc):
        data = json.dumps(doc).encode() + b"\n"
        view = memoryview(data)
        while view:
            view = view[os.write(self.wfd, view) :]


def _err(exc):
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except BaseException:  # noqa: BLE001 - a hostile __str__
        return type(exc).__name__[:100]


def _wire(source):
    mod = {"__name__": "cf_wire"}
    exec(compile(source, "<wire>", "exec"), mod)
    return mod


def serve_candidate(job, io, wire):
    import random  # noqa: PLC0415 - after the limits

    ns: dict[str, Any] = {"__name__": "__candidate__"}
    try:
        exec(compile(job["program"] or "", "<program>", "exec"), ns)
    except BaseException as exc:  # noqa: BLE001
        io.send({"program_error": _err(exc)})
        return
    io.send({"program_error": None})
    handles: list[Any] = []

    def keep(obj):
        if len(handles) >= MAX_HANDLES:
            return None
        handles.append(obj)
        return {"h": len(handles) - 1, "o": wire["_type_name"](type(obj))}

    def resolve(n, _type_name):
        return handles[n] if 0 <= n < len(handles) else wire["Opaque"]("unknown handle")

    unit = None
    while True:
        req = io.read()
        if req.get("unit") != unit:
            unit = req.get("unit")
            random.seed(job.get("seed", 0))
        try:
            root, *path = req["target"]
            if type(root) is int:
                target = resolve(root, "")
            elif root in ns:
                target = ns[root]
            else:
                raise NameError(f"name {root!r} is not defined")
            for attr in path:
                target = getattr(target, attr)
            args = [wire["decode"](a, resolve) for a in req.get("args") or []]
            kwargs = {str(k): wire["decode"](a, resolve) for k, a in req.get("kwargs") or []}
            if req.get("op") == "iter":
                value, it = [], iter(target)
                for item in it:
                    value.append(item)
                    if len(value) > MAX_ITEMS:
                        raise MemoryError("more than a million items")
            else:
                value = target(*args, **kwargs)
            reply = {"ok": 1, "value": wire["encode"](value, keep)}
            reply["post"] = [
                [i, wire["encode"](a, keep)] for i, a in enumerate(args) if type(a) in (list, dict, set)
            ]
        except BaseException as exc:  # noqa: BLE001 - the candidate's failure is a value
            reply = {"ok": 0, "exc": type(exc).__name__[:80], "msg": _err(exc)}
        try:
            io.send(reply)
        except BaseException as exc:  # noqa: BLE001 - e.g. an int past the str conversion limit
            io.send({"ok": 0, "exc": "ValueError", "msg": f"value not serializable: {_err(exc)}"})


def run_reference(job, io, wire):
    import random  # noqa: PLC0415 - after the limits

    decode, encode = wire["decode"], wire["encode"]
    state: dict[str, int | None] = {"unit": None}

    class Remote:
        """The candidate's function (or object) in the reference: calls go to the candidate's process."""

        __slots__ = ("_cf_target",)

        def __init__(self, target):
            object.__setattr__(self, "_cf_target", target)

        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Remote([*self._cf_target, attr])

        def __call__(self, *args, **kwargs):
            return _ask("call", self._cf_target, args, kwargs)

        def __iter__(self):
            return iter(_ask("iter", self._cf_target, (), {}))

        def __eq__(self, other):
            return False

        def __ne__(self, other):
            return True

        __hash__ = object.__hash__

        def __bool__(self):
            raise TypeError("an object of the candidate's is not plain data")

        def __repr__(self):
            return f"<candidate {'.'.join(map(str, self._cf_target))}>"

    def as_handle(obj):
        if isinstance(obj, Remote) and len(obj._cf_target) == 1 and type(obj._cf_target[0]) is int:
            return {"h": obj._cf_target[0], "o": "handle"}
        return None

    def _ask(op, target, args, kwargs):
        io.send(
            {
                "op": op,
                "target": target,
                "args": [encode(a, as_handle) for a in args],
                "kwargs": [[k, encode(v, as_handle)] for k, v in kwargs.items()],
                "unit": state["unit"],
            }
        )
        reply = io.read()
        if reply.get("ok") != 1:
            name = str(reply.get("exc"))
            cls = getattr(builtins, name, None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = RuntimeError
            raise cls(str(reply.get("msg"))[:300])

        def handle(n, type_name):
            return Remote([n])

        for i, new in reply.get("post") or []:
            arg: Any = args[i] if type(i) is int and 0 <= i < len(args) else None
            value = decode(new, handle)
            if type(arg) is list and type(value) is list:
                arg[:] = value
            elif type(arg) in (dict, set) and type(value) is type(arg):
                arg.clear()
                arg.update(value)
        return decode(reply.get("value"), handle)

    result: dict[str, Any] = {"program_error": None, "units": []}
    ns: dict[str, Any] = {"__name__": "__tests__"}
    current: dict[str, list[Any]] = {}

    def rec(aid, thunks):
        row = []
        for thunk in thunks:
            try:
                row.append([1, encode(thunk(), lambda obj: None)])
            except BaseException as exc:  # noqa: BLE001 - a failure is a value
                row.append([0, _err(exc)])
        current.setdefault(str(aid), []).append(row)

    for src in job.get("imports") or []:  # the program's standard-library imports, this process's own copies
        try:
            exec(compile(src, "<imports>", "exec"), ns)
        except BaseException:  # noqa: BLE001, S110 - a missing module shows in the tests that need it
            pass
    if job.get("prompt"):
        try:
            exec(compile(job["prompt"], "<prompt>", "exec"), ns)
        except BaseException as exc:  # noqa: BLE001
            result["program_error"] = f"the task's prompt: {_err(exc)}"
            io.send({"done": result})
            return
    for name in job.get("remote") or []:
        ns[name] = Remote([name])
    ep = job.get("entry_point")
    if ep:
        ns["candidate"] = ns[ep] = Remote([ep])
    for src in job.get("setup") or []:
        try:
            exec(compile(src, "<tests>", "exec"), ns)
        except BaseException:  # noqa: BLE001, S110 - a broken prelude shows in the tests that need it
            pass
    for i, src in enumerate(job["units"]):
        current = {}
        state["unit"] = i
        ns["__cf_rec__"] = rec
        random.seed(job.get("seed", 0))
        unit = {"ok": 1, "err": None, "rec": current}
        try:
            exec(compile(src, "<tests>", "exec"), ns)
        except BaseException as exc:  # noqa: BLE001
            unit.update(ok=0, err=_err(exc))
        result["units"].append(unit)
    try:
        io.send({"done": result})
    except BaseException as exc:  # noqa: BLE001 - e.g. an int past the str conversion limit
        io.send({"done": {"program_error": f"result not serializable: {_err(exc)}", "units": []}})


def main():
    first = Lines(0, 1)
    job = first.read()
    wire = _wire(job["wire"])
    _limits(job["limits"])
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    io = Lines(rfd, wfd)
    io.buf = first.buf
    if job.get("role") == "candidate":
        serve_candidate(job, io, wire)
    else:
        run_reference(job, io, wire)
    os._exit(0)  # no atexit handlers or threads of the program run after the last line


if __name__ == "__main__":
    main()
