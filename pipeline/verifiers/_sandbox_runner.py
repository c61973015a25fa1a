"""Runs inside the sandbox subprocess (started by pipeline.verifiers.code). Not imported by the pipeline.

Reads one JSON job from stdin: {"nonce", "program", "tests": [assert statements] | null, "test_code",
"entry_point", "mem_bytes", "cpu_s"}. Sets the resource limits, installs an audit hook that blocks sockets,
subprocesses, ctypes and writes outside the working folder, runs the program, then each test, and prints
`<nonce>{"passed": n, "total": m, "errors": [...]}` as its last line."""

import ast
import json
import os
import resource
import sys


def _limits(job):
    mem = int(job["mem_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = int(job["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


BLOCKED_PREFIXES = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.fork",
    "os.spawn",
    "pty.",
    "ctypes.",
    "os.kill",
    "os.killpg",
)


def _install_guard(workdir):
    workdir = os.path.realpath(workdir)

    def hook(event, args):
        if event.startswith(BLOCKED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is blocked")
        if event == "open" and len(args) >= 2:
            path, mode = args[0], args[1]
            writing = isinstance(mode, str) and any(c in mode for c in "wax+")
            if isinstance(args[2] if len(args) > 2 else None, int) and (args[2] & (os.O_WRONLY | os.O_RDWR)):
                writing = True
            if writing and isinstance(path, (str, bytes)):
                p = os.path.realpath(os.fsdecode(path))
                if not (p == workdir or p.startswith(workdir + os.sep) or p == os.devnull):
                    raise PermissionError(f"sandbox: write to {p} is blocked")

    sys.addaudithook(hook)


def _split_check(test_code, entry_point):
    """HumanEval `check(candidate)`: its top-level statements; those containing an assert are the tests."""
    tree = ast.parse(test_code)
    prelude, body = [], None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            body = node.body
        else:
            prelude.append(node)
    if body is None:  # plain assert statements at module level
        return [], [
            (ast.Module([n], []), any(isinstance(x, ast.Assert) for x in ast.walk(n))) for n in tree.body
        ]
    stmts = [(ast.Module([n], []), any(isinstance(x, ast.Assert) for x in ast.walk(n))) for n in body]
    return [ast.Module(prelude, [])], stmts


def main():
    job = json.loads(sys.stdin.read())
    nonce = job["nonce"]
    out = sys.__stdout__
    sys.stdout = open(os.devnull, "w")  # the program's prints never reach the result channel
    _limits(job)
    _install_guard(os.getcwd())
    result = {"passed": 0, "total": 0, "errors": []}
    ns = {"__name__": "__candidate__"}
    tests = job.get("tests")
    if tests:
        units = [(ast.parse(t), True) for t in tests]
        prelude = []
    else:
        prelude, units = _split_check(job.get("test_code") or "", job.get("entry_point"))
    result["total"] = sum(1 for _, is_test in units if is_test)
    try:
        exec(compile(job["program"], "<program>", "exec"), ns)
    except BaseException as exc:  # noqa: BLE001 - the candidate's failure is the result
        result["errors"].append(f"program: {type(exc).__name__}: {exc}"[:500])
        out.write(nonce + json.dumps(result) + "\n")
        out.flush()
        return
    ep = job.get("entry_point")
    if ep:
        ns["candidate"] = ns.get(ep)
    for mod in prelude:
        try:
            exec(compile(mod, "<tests>", "exec"), ns)
        except BaseException as exc:  # noqa: BLE001
            result["errors"].append(f"test setup: {type(exc).__name__}: {exc}"[:500])
    for mod, is_test in units:
        try:
            exec(compile(mod, "<tests>", "exec"), ns)
            if is_test:
                result["passed"] += 1
        except BaseException as exc:  # noqa: BLE001
            if len(result["errors"]) < 10:
                result["errors"].append(f"{type(exc).__name__}: {exc}"[:300])
    out.write(nonce + json.dumps(result) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
