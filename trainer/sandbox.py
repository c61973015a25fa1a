"""The OS-level sandbox that runs candidate programs for the `code_tests` verifier (registered here).

Each run is one `bwrap` (bubblewrap) process tree:
- namespaces: new pid, network (no interfaces but a downed loopback), ipc, uts, cgroup; as root no user
  namespace (bubblewrap mounts with real privileges, the child then drops to `nobody`, so RLIMIT_NPROC is
  enforced and file permissions apply); as another user `--unshare-all` (user namespace included);
- filesystem: a fresh root holding only /usr (read-only), the interpreter's prefix (read-only), the child
  script, a private size-limited tmpfs /tmp, a new /proc of its own pid namespace (no /proc/<ppid>/environ of
  the caller) and a minimal /dev; the working tree, the lake and /root are not there;
- environment: --clearenv (PATH and LANG only); `python -I -S` (no site-packages: the standard library only);
- rlimits in the child: address space, CPU, processes, file size, open files, no core files;
- output: at most `output_bytes` read from stdout (16 KiB kept from stderr), then the tree is killed;
- time: at `wall_s` bwrap's process group is killed; its pid-namespace init dies with it and the kernel kills
  every process in the namespace (a child that called setsid and kept the pipes open included).
The pass/fail decision is not made here: see pipeline.verifiers.code (this module only executes).

Without bubblewrap the verifier refuses to run candidate code (`SandboxUnavailable`) unless the setting
`sandbox.unsafe_no_sandbox` (or the environment variable CREDITFLOW_UNSAFE_NO_SANDBOX=1) allows a plain
subprocess with the same rlimits, output bound and wall limit (a process group only: no boundary).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pipeline.verifiers import register_verifier
from pipeline.verifiers.code import (
    DEFAULT_LIMITS,
    Outcome,
    SandboxLimits,
    SandboxSettings,
    code_tests_with,
    run_plan,
)

CHILD = Path(__file__).with_name("_sandbox_child.py")
CHILD_IN_SANDBOX = "/run/cf/child.py"
STDERR_KEEP = 16 << 10
SHELLS = tuple(f"/usr/bin/{s}" for s in ("sh", "bash", "dash", "rbash", "zsh", "ksh", "busybox"))
UNSAFE_ENV = "CREDITFLOW_UNSAFE_NO_SANDBOX"

__all__ = ["SandboxLimits", "SandboxSettings", "SandboxUnavailable", "configure", "execute", "run_tests"]


class SandboxUnavailable(RuntimeError):
    pass


_settings = DEFAULT_LIMITS
_probe: dict[str, str | None] = {}
_lock = threading.Lock()


def configure(settings: SandboxSettings | None = None, *, config=None) -> SandboxSettings:
    """Set the defaults of later runs (flows pass the round's `sandbox` settings)."""
    global _settings
    if config is not None:
        settings = config.stage("sandbox")
    _settings = settings or DEFAULT_LIMITS
    return _settings


def current_settings() -> SandboxSettings:
    return _settings


def _interpreter() -> tuple[str, list[str]]:
    exe = os.path.realpath(sys.executable)
    roots = {os.path.realpath(sys.base_prefix)}
    return exe, sorted(r for r in roots if not r.startswith("/usr/") and r != "/usr")


def bwrap_command(limits: SandboxSettings) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
    exe, roots = _interpreter()
    cmd = [bwrap]
    if os.geteuid() == 0:
        cmd += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    else:
        cmd += ["--unshare-all"]
    cmd += ["--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
    cmd += ["--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/tmp", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64", "lib32", "sbin"):
        p = Path("/") / name
        if p.is_symlink():
            cmd += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            cmd += ["--ro-bind", str(p), str(p)]
    made: set[str] = set()
    for target in [*roots, CHILD_IN_SANDBOX]:  # bwrap makes missing parents 0700: nobody could not pass
        for parent in reversed(Path(target).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                cmd += ["--perms", "0755", "--dir", str(parent)]
    for root in roots:
        cmd += ["--ro-bind", root, root]
    for shell in SHELLS:  # no shell to hand a command line to (a program can still exec the interpreter)
        if os.path.exists(shell):
            cmd += ["--ro-bind", "/dev/null", shell]
    cmd += ["--ro-bind", str(CHILD), CHILD_IN_SANDBOX]
    cmd += ["--perms", "1777", "--size", str(int(limits.tmpfs_bytes)), "--tmpfs", "/tmp"]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp", exe, "-I", "-S", CHILD_IN_SANDBOX]
    return cmd


def sandbox_problem() -> str | None:
    """None when bubblewrap runs here (probed once per process), else why not."""
    with _lock:
        if "bwrap" not in _probe:
            try:
                cmd = bwrap_command(DEFAULT_LIMITS)
                cmd[-1:] = ["-c", "pass"]
                r = subprocess.run(cmd, capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
                _probe["bwrap"] = (
                    None if r.returncode == 0 else r.stderr.decode(errors="replace").strip()[:300]
                )
            except (SandboxUnavailable, OSError, subprocess.SubprocessError) as exc:
                _probe["bwrap"] = str(exc)
        return _probe["bwrap"]


def _unsafe_allowed(limits: SandboxSettings) -> bool:
    return bool(limits.unsafe_no_sandbox) or os.environ.get(UNSAFE_ENV, "") in ("1", "true", "yes")


def execute(job: dict, limits: SandboxSettings | None = None) -> Outcome:
    """Run one child job in the sandbox; the child's JSON document, or why there is none."""
    limits = limits or _settings
    problem = sandbox_problem()
    lim = {
        "mem_bytes": limits.mem_bytes,
        "cpu_s": limits.cpu_s,
        "fsize_bytes": limits.fsize_bytes,
        "nproc": limits.nproc,
        "drop_root": problem is None,
    }
    payload = json.dumps({**job, "limits": lim}).encode()
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    if problem is None:
        return _run(bwrap_command(limits), payload, limits, env, cwd="/")
    if not _unsafe_allowed(limits):
        raise SandboxUnavailable(
            f"refusing to run candidate code: the bubblewrap sandbox is unavailable ({problem}); install it "
            "(apt-get install bubblewrap) or accept the risk with --set sandbox.unsafe_no_sandbox=true "
            f"or {UNSAFE_ENV}=1"
        )
    with tempfile.TemporaryDirectory(prefix="cf-unsafe-") as work:
        cmd = [os.path.realpath(sys.executable), "-I", "-S", str(CHILD)]
        return _run(cmd, payload, limits, env, cwd=work)


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the process has exited, without reaping it (so its pid, the group's id, is not reused yet)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _finish(proc: subprocess.Popen, grace_s: float) -> None:
    """Give the process `grace_s` to exit (bwrap reaps its namespace's init itself; killing it early orphans a
    zombie), then kill its whole process group, then reap it."""
    deadline = time.monotonic() + grace_s
    while not _exited(proc) and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _run(cmd: list[str], payload: bytes, limits: SandboxSettings, env: dict, cwd: str) -> Outcome:
    """Feed the job, read bounded output until the child exits or the wall limit; kill the tree always."""
    deadline = time.monotonic() + float(limits.wall_s)
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    out, err, total = bytearray(), bytearray(), 0
    status, detail = "ok", None
    sel = selectors.DefaultSelector()
    try:
        for f in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        view, exited_at = memoryview(payload), None
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                status = "timeout"
                break
            if exited_at is None and _exited(proc):
                exited_at = now
            events = sel.select(timeout=min(0.05, deadline - now))
            if not events and exited_at is not None and now - exited_at > 0.2:
                break  # the child is gone and its output drained; a descendant holding the pipes is not waited for
            for key, _ in events:
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        view = view[os.write(f.fileno(), view[: 1 << 16]) :]
                    except (BrokenPipeError, OSError):
                        view = memoryview(b"")
                    if not view:
                        sel.unregister(f)
                        f.close()
                    continue
                chunk = os.read(f.fileno(), 1 << 16)
                if not chunk:
                    sel.unregister(f)
                    continue
                if f is proc.stdout:
                    out += chunk
                elif len(err) < STDERR_KEEP:
                    err += chunk[: STDERR_KEEP - len(err)]
                total += len(chunk)
                if total > limits.output_bytes:
                    status, detail = "output_limit", f"more than {limits.output_bytes} bytes of output"
                    break
            if status != "ok":
                break
    finally:
        sel.close()
        _finish(proc, 1.0 if status == "ok" else 0.0)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
    if status == "timeout":
        return Outcome(None, "timeout", f"after {limits.wall_s}s")
    if status != "ok":
        return Outcome(None, status, detail)
    try:
        doc = json.loads(out)
    except (ValueError, RecursionError):  # not a document (the program wrote over it, or nested it to death)
        rc = proc.returncode
        why = (
            "killed by the CPU limit" if rc in (-signal.SIGXCPU, -signal.SIGKILL, 137, 152) else f"exit {rc}"
        )
        tail = err.decode(errors="replace").strip()[-300:]
        return Outcome(None, "crash", f"{why}: {tail}" if tail else why)
    return Outcome(doc if isinstance(doc, dict) else None, "ok" if isinstance(doc, dict) else "crash")


def _execute_checked(job: dict, limits: SandboxSettings) -> Outcome:
    return execute(job, limits)


code_tests = register_verifier("code_tests")(code_tests_with(_execute_checked, current_settings))


def run_tests(
    program: str,
    *,
    tests: list[str] | None = None,
    test_code: str | None = None,
    entry_point: str | None = None,
    prompt: str | None = None,
    limits: SandboxSettings | None = None,
) -> dict:
    """Run the tests on a program: {"passed", "total", "errors", "timeout", "crash"} (the repair env's API)."""
    meta = {"tests": tests, "test": test_code, "entry_point": entry_point, "prompt": prompt}
    return run_plan(program, meta, execute, limits or _settings)
