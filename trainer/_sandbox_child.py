"""Runs inside the sandbox (started by trainer.sandbox as `python -I -S`; stdlib only; never imported).

Reads one JSON job from stdin: {"program", "entry_point", "stubs", "setup", "units", "seed", "limits"}.
Sets the rlimits, drops to the `nobody` user when started as root (the sandbox's bubblewrap runs as root
without a user namespace, so RLIMIT_NPROC counts a real, unprivileged user), points fds 0-2 at /dev/null,
runs the program, the test setup and each unit (asserts were rewritten by the parent into
`__cf_rec__(id, [lambda: hole, ...])`), and writes one JSON document to the saved stdout:
{"program_error": str | null, "units": [{"ok", "err", "rec": {id: [[[1, value] | [0, error], ...], ...]}}]}.
It decides nothing: the values are plain data (exact builtin types, tagged; anything else is {"o": type}),
and the parent, which alone holds the expected values, compares them.
"""

import json
import os
import resource
import sys

NOBODY = 65534
MAX_NODES = 2_000_000


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


class _TooBig(Exception):
    pass


def encode(value):
    budget = [MAX_NODES]

    def enc(v, depth):
        budget[0] -= 1
        if budget[0] < 0 or depth > 150:
            raise _TooBig("value too large or nested too deep")
        t = type(v)
        if v is None or t is bool or t is str:
            return v
        if t is int:
            return v if -(1 << 62) < v < (1 << 62) else {"i": hex(v)}
        if t is float:
            return v
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
        return {"o": t.__name__ if isinstance(getattr(t, "__name__", None), str) else "object"}

    return enc(value, 0)


def _err(exc):
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except BaseException:  # noqa: BLE001 - a hostile __str__
        return type(exc).__name__[:100]


def _stub(name):
    def stub(*args, **kwargs):
        raise NameError(f"{name} is not available in the reference run")

    return stub


def main():
    raw = sys.stdin.buffer.read()
    job = json.loads(raw)
    _limits(job["limits"])
    out = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    import random  # noqa: PLC0415 - after the limits

    result = {"program_error": None, "units": []}
    ns = {"__name__": "__candidate__"}
    current = {}

    def rec(aid, thunks):
        row = []
        for thunk in thunks:
            try:
                row.append([1, encode(thunk())])
            except BaseException as exc:  # noqa: BLE001 - the candidate's failure is a value
                row.append([0, _err(exc)])
        current.setdefault(str(aid), []).append(row)

    if job.get("program"):
        try:
            exec(compile(job["program"], "<program>", "exec"), ns)
        except BaseException as exc:  # noqa: BLE001
            result["program_error"] = _err(exc)
    if result["program_error"] is None:
        for name in job.get("stubs") or []:
            ns[name] = _stub(name)
        ep = job.get("entry_point")
        if ep and not job.get("stubs"):
            ns["candidate"] = ns.get(ep)
        for src in job.get("setup") or []:
            try:
                exec(compile(src, "<tests>", "exec"), ns)
            except BaseException:  # noqa: BLE001, S110 - a broken prelude shows in the tests that need it
                pass
        for src in job["units"]:
            current = {}
            ns["__cf_rec__"] = rec
            random.seed(job.get("seed", 0))
            unit = {"ok": 1, "err": None, "rec": current}
            try:
                exec(compile(src, "<tests>", "exec"), ns)
            except BaseException as exc:  # noqa: BLE001
                unit.update(ok=0, err=_err(exc))
            result["units"].append(unit)
    try:
        data = json.dumps(result).encode()
    except BaseException as exc:  # noqa: BLE001 - e.g. an int past the str conversion limit
        data = json.dumps({"program_error": f"result not serializable: {_err(exc)}", "units": []}).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(out, view) :]
    os._exit(0)  # no atexit handlers or threads of the program run after the result


if __name__ == "__main__":
    main()
