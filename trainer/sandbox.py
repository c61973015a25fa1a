"""The OS-level sandbox that runs candidate programs for the `code_tests` verifier (registered here).

A verification is two sandboxes and the caller between them (`execute(cand_job, ref_job)`):
- the candidate's sandbox runs the program and answers calls of its functions, one line each;
- the reference sandbox runs the tests (never candidate code); each call of a candidate name it sends as a
  line, which this process passes to the candidate's sandbox, and passes the answer line back;
- this process relays one call at a time (a line the candidate writes outside an answer is a crash), bounds
  the bytes each side writes (`output_bytes`) and the wall time of the pair (`wall_s`), and decodes only the
  reference's final document (bounded, see pipeline.verifiers.wire). Expected values live in the reference
  sandbox and here; the candidate's sandbox gets its program and its call arguments, nothing else.

Each sandbox is one `bwrap` (bubblewrap) process tree:
- namespaces: new pid, network (no interfaces but a downed loopback), ipc, uts, cgroup; as root no user
  namespace (bubblewrap mounts with real privileges, the child then drops to `nobody`, so RLIMIT_NPROC is
  enforced and file permissions apply); as another user `--unshare-all` (user namespace included);
- filesystem: a fresh root holding only /usr (read-only), the interpreter's prefix (read-only), the child
  script, a private size-limited tmpfs /tmp, a new /proc of its own pid namespace (no /proc/<ppid>/environ of
  the caller) and a minimal /dev; the working tree, the lake and /root are not there;
- environment: --clearenv (PATH and LANG only); `python -I -S` (no site-packages: the standard library only);
- rlimits in the child: address space, CPU, processes, file size, open files, no core files;
- memory of the whole tree: the caller sums the resident memory of every process of a sandbox every 50 ms
  (/proc children; setsid children, and orphans, which reparent to the namespace's init, included) and kills
  the tree past `mem_bytes`; RLIMIT_AS alone is per process (a hard bound of mem_bytes x nproc);
- output: at most `output_bytes` read from each sandbox (16 KiB kept from stderr), then both trees are killed;
- time: at `wall_s` bwrap's process group is killed; its pid-namespace init dies with it and the kernel kills
  every process in the namespace (a child that called setsid and kept the pipes open included).
The pass/fail decision is not made here: see pipeline.verifiers.code (this module only executes).

Without bubblewrap the verifier refuses to run candidate code (`SandboxUnavailable`) unless the setting
`sandbox.unsafe_no_sandbox` (or the environment variable CREDITFLOW_UNSAFE_NO_SANDBOX=1) allows plain
subprocesses with the same rlimits, output bound and wall limit (process groups only: no boundary; a program
running as the caller's user could then also reach the reference process).
"""

from __future__ import annotations

import functools
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
from typing import IO

from pipeline.verifiers import register_verifier, wire
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
        settings = config.settings(SandboxSettings)
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


@functools.cache
def _wire_source() -> str:
    return Path(wire.__file__).read_text()


def execute(cand_job: dict, ref_job: dict, limits: SandboxSettings | None = None) -> Outcome:
    """Run the candidate's program and the tests, each in its own sandbox, and relay the calls between them
    (see the module docstring); the reference's document, or why there is none."""
    limits = limits or _settings
    problem = sandbox_problem()
    lim = {
        "mem_bytes": limits.mem_bytes,
        "cpu_s": limits.cpu_s,
        "fsize_bytes": limits.fsize_bytes,
        "nproc": limits.nproc,
        "drop_root": problem is None,
    }
    source = _wire_source()
    payloads = [
        json.dumps({**job, "role": role, "wire": source, "limits": lim}).encode() + b"\n"
        for role, job in (("candidate", cand_job), ("reference", ref_job))
    ]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    if problem is None:
        return _relay([bwrap_command(limits)] * 2, payloads, limits, env, ["/", "/"])
    if not _unsafe_allowed(limits):
        raise SandboxUnavailable(
            f"refusing to run candidate code: the bubblewrap sandbox is unavailable ({problem}); install it "
            "(apt-get install bubblewrap) or accept the risk with --set sandbox.unsafe_no_sandbox=true "
            f"or {UNSAFE_ENV}=1"
        )
    with (
        tempfile.TemporaryDirectory(prefix="cf-unsafe-") as cand_dir,
        tempfile.TemporaryDirectory(prefix="cf-unsafe-") as ref_dir,
    ):
        cmd = [os.path.realpath(sys.executable), "-I", "-S", str(CHILD)]
        return _relay([cmd, cmd], payloads, limits, env, [cand_dir, ref_dir])


def _exit_status(proc: subprocess.Popen) -> int | None:
    """The exit status (negative: the signal) once the process has exited, without reaping it (its pid, the
    group's id, is not reused yet); None while it runs."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.returncode if proc.returncode is not None else -1
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _exited(proc: subprocess.Popen) -> bool:
    return _exit_status(proc) is not None


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


PAGE = os.sysconf("SC_PAGE_SIZE")
MEMORY_EVERY_S = 0.05


def tree_rss(root: int, most: int = 4096) -> int:
    """Resident bytes of a process and all its descendants (walked through /proc/<pid>/task/*/children, so a
    child that called setsid or was orphaned to the namespace's init is still counted); 0 for what is gone."""
    total, todo, seen = 0, [root], set[int]()
    while todo and len(seen) < most:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def _pipes(proc: subprocess.Popen) -> tuple[IO[bytes], IO[bytes], IO[bytes]]:
    """stdin, stdout and stderr of a process started with all three as subprocess.PIPE."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    return proc.stdin, proc.stdout, proc.stderr


class _Side:
    """One sandbox of the pair: its process, what it wrote (bounded) and what waits to be written to it."""

    def __init__(self, proc: subprocess.Popen, payload: bytes) -> None:
        self.proc = proc
        self.out, self.err, self.total = bytearray(), bytearray(), 0
        self.pending = payload
        self.stdout_eof = False
        self.exited_at: float | None = None

    def send(self, data: bytes) -> None:
        """Queue `data` for the process's stdin and write what the pipe takes now (the rest when it drains)."""
        self.pending += data
        if self.proc.stdin is None or len(self.pending) != len(data):
            return
        try:
            n = os.write(self.proc.stdin.fileno(), self.pending[: 1 << 16])
        except BlockingIOError:
            n = 0
        except OSError:  # the process is gone: what it missed does not matter
            n = len(self.pending)
        self.pending = self.pending[n:]

    def lines(self) -> list[bytes]:
        *done, rest = bytes(self.out).split(b"\n")
        self.out = bytearray(rest)
        return done

    def gone(self, now: float) -> bool:
        """Exited, and its output drained (EOF, or 0.2 s of quiet: a descendant may hold the pipe)."""
        if self.exited_at is None and _exited(self.proc):
            self.exited_at = now
        return self.exited_at is not None and (self.stdout_eof or now - self.exited_at > 0.2)

    def why(self) -> str:
        rc = _exit_status(self.proc)
        killed = rc in (-signal.SIGXCPU, -signal.SIGKILL, 137, 152)
        why = "killed by the CPU or memory limit" if killed else f"exit {rc}"
        tail = self.err.decode(errors="replace").strip()[-300:]
        return f"{why}: {tail}" if tail else why


def _relay(
    cmds: list[list[str]], payloads: list[bytes], limits: SandboxSettings, env: dict, cwds: list[str]
) -> Outcome:
    """Feed both jobs, pass each call of the reference to the candidate and each answer back (one at a time;
    anything else the candidate writes is a crash), bound every byte and the wall time, kill both trees
    always. The candidate's answers are forwarded as they are: the reference decodes them under its bounds."""
    deadline = time.monotonic() + float(limits.wall_s)
    sides: list[_Side] = []
    sel = selectors.DefaultSelector()
    outcome: Outcome | None = None
    try:
        _start_sides(cmds, payloads, env, cwds, sel, sides)
        cand, ref = sides
        proto = _Protocol()
        memory_at = 0.0
        while outcome is None:
            now = time.monotonic()
            if now >= deadline:
                outcome = Outcome(None, "timeout", f"after {limits.wall_s}s")
                break
            if now >= memory_at:  # RLIMIT_AS bounds each process; this bounds a sandbox's processes together
                memory_at = now + MEMORY_EVERY_S
                if any(tree_rss(side.proc.pid) > limits.mem_bytes for side in sides):
                    outcome = Outcome(
                        None,
                        "crash",
                        f"more than {limits.mem_bytes} bytes resident in one sandbox's processes",
                    )
                    break
            if cand.gone(now) and (not proto.hello or proto.busy or proto.queued):
                outcome = Outcome(None, "crash", cand.why())
                break
            if ref.gone(now) and proto.done is None:
                outcome = Outcome(None, "reference_error", f"the reference run ended early ({ref.why()})")
                break
            if proto.hello and not proto.busy and proto.queued:
                cand.send(proto.queued.pop(0) + b"\n")
                proto.busy = True
            outcome = _pump(sel, sides, deadline, now, limits)
            if outcome is None:
                outcome = _from_candidate(cand, ref, proto)
            if outcome is None:
                outcome = _from_reference(ref, cand, proto)
            if outcome is None and proto.hello and proto.done is not None:
                outcome = _document(proto.done)
    finally:
        sel.close()
        for side in sides:
            _finish(side.proc, 0.0 if outcome is None or outcome.status != "ok" or side is sides[0] else 1.0)
            for f in (side.proc.stdin, side.proc.stdout, side.proc.stderr):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
    return outcome if outcome is not None else Outcome(None, "crash", "no outcome")


class _Protocol:
    """Where the relay stands: the candidate said hello, a call of the reference awaits its answer (busy), the
    reference's calls not yet passed on (queued), the reference's final line held until the hello (done).

    The outcome never depends on which side is faster: no call reaches the candidate and no document of the
    reference is accepted before the candidate's hello, and a program error in the hello always wins. (A
    program that does not run defines nothing the reference can ask for, so the reference's tests fail on
    their own, with NameError, and its document may come first.)"""

    def __init__(self) -> None:
        self.hello = False
        self.busy = False
        self.queued: list[bytes] = []
        self.done: bytes | None = None


def _start_sides(
    cmds: list[list[str]], payloads: list[bytes], env: dict, cwds: list[str], sel, sides: list[_Side]
) -> None:
    """Start the candidate and the reference (each its own session), pipes non-blocking, their output watched;
    each side is added to `sides` as soon as it runs, so the caller stops it whatever happens next."""
    for cmd, payload, cwd in zip(cmds, payloads, cwds, strict=True):
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        side = _Side(proc, payload)
        sides.append(side)
        stdin, stdout, stderr = _pipes(proc)
        for pipe in (stdin, stdout, stderr):
            os.set_blocking(pipe.fileno(), False)
        sel.register(stdout, selectors.EVENT_READ, (side, "out"))
        sel.register(stderr, selectors.EVENT_READ, (side, "err"))


def _pump(sel, sides: list[_Side], deadline: float, now: float, limits: SandboxSettings) -> Outcome | None:
    """One round of I/O: what is pending goes to each side's stdin, what each wrote is read (stderr kept up to
    STDERR_KEEP); an Outcome when a side wrote more than `output_bytes`."""
    for side in sides:  # a descriptor waits for writing only while there is something to write
        stdin = _pipes(side.proc)[0]
        registered = stdin in sel.get_map()
        if side.pending and not registered:
            sel.register(stdin, selectors.EVENT_WRITE, (side, "in"))
        elif not side.pending and registered:
            sel.unregister(stdin)
    for key, _ in sel.select(timeout=min(0.05, max(0.0, deadline - now))):
        side, kind = key.data
        if kind == "in":
            if not side.pending:
                continue
            try:
                n = os.write(key.fd, side.pending[: 1 << 16])
            except (BrokenPipeError, OSError):
                n = len(side.pending)
            side.pending = side.pending[n:]
            continue
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
            sel.unregister(key.fileobj)
            if kind == "out":
                side.stdout_eof = True
            continue
        side.total += len(chunk)
        if kind == "out":
            side.out += chunk
        elif len(side.err) < STDERR_KEEP:
            side.err += chunk[: STDERR_KEEP - len(side.err)]
        if side.total > limits.output_bytes:
            return Outcome(None, "output_limit", f"more than {limits.output_bytes} bytes of output")
    return None


def _from_candidate(cand: _Side, ref: _Side, proto: _Protocol) -> Outcome | None:
    """The candidate's lines: first its hello (a program error ends the run), then one answer per call of the
    reference, passed on; anything else is a crash."""
    for line in cand.lines():
        outcome = None
        if not proto.hello:
            try:
                first = json.loads(line)
            except (ValueError, RecursionError):
                first = None
            if not isinstance(first, dict) or "program_error" not in first:
                outcome = Outcome(None, "crash", "the candidate's process did not start its protocol")
            elif first["program_error"]:
                outcome = Outcome({"program_error": str(first["program_error"])[:500], "units": []})
            proto.hello = True
        elif proto.busy:
            ref.send(line + b"\n")
            proto.busy = False
        else:
            outcome = Outcome(None, "crash", "the candidate's process wrote outside an answer")
        if outcome is not None:
            return outcome
    return None


def _from_reference(ref: _Side, cand: _Side, proto: _Protocol) -> Outcome | None:
    """The reference's lines: a call goes to the candidate (or waits its turn); `{"done": ...}` ends the run
    with the reference's document, once the candidate has said hello (until then it is held, see _Protocol)."""
    for line in ref.lines():
        if proto.done is not None:
            return Outcome(None, "reference_error", "the reference run wrote after its document")
        if not line.startswith(b'{"done": '):
            if proto.hello and not proto.busy and not proto.queued:
                cand.send(line + b"\n")
                proto.busy = True
            else:
                proto.queued.append(line)
            continue
        if not proto.hello:
            proto.done = line
            continue
        return _document(line)
    return None


def _document(line: bytes) -> Outcome:
    """The outcome of the reference's final line `{"done": document}`."""
    try:
        doc = json.loads(line)["done"]
    except (ValueError, RecursionError, KeyError, TypeError):
        doc = None
    if not isinstance(doc, dict):
        return Outcome(None, "reference_error", "the reference run sent no document")
    if doc.get("program_error"):
        return Outcome(None, "reference_error", str(doc["program_error"])[:500])
    return Outcome(doc)


def _execute_checked(cand_job: dict, ref_job: dict, limits: SandboxSettings) -> Outcome:
    return execute(cand_job, ref_job, limits)


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
