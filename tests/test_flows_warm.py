"""The warm runner (flows/warm*.py): `creditflow process` forked from a process that imported Prefect once.

The runner and the CLI run as real subprocesses. A stand-in server (a `sleep` recorded in prefect.json) keeps
the runner alive where the command stops before any flow run (a missing round, a held round lock); the flow
itself runs against a real `creditflow server start` (slow: the last test)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from api_processes import report, servers_of

from flows import warm, warm_runner, warm_wire

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path: Path) -> dict[str, str]:
    # what an earlier in-process command of this test worker set for itself is not the subprocess's to inherit
    dropped = ("PREFECT_API_URL", "CREDITFLOW_NO_SERVER", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(
        CREDITFLOW_CACHE=str(tmp_path / "cache"),
        CREDITFLOW_WARM_STATS=str(tmp_path / "warm.jsonl"),
        PYTHONPATH=str(ROOT),
    )
    return env


def cli(args: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "from flows.cli import app; app()", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = cli(args, env)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def stats(tmp_path: Path) -> list[dict]:
    path = tmp_path / "warm.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(check, timeout: float = 120.0, what="") -> None:
    """Poll `check` until true; `what` names it in the failure (a callable: called then, to show the state)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def runner(tmp_path):
    """A runner beside a stand-in server; yields (env, runner process, server stand-in)."""
    with _runner(tmp_path, _env(tmp_path)) as started:
        yield started


@contextlib.contextmanager
def _runner(tmp_path: Path, env: dict[str, str]):
    services = tmp_path / "cache" / "services"
    services.mkdir(parents=True)
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)
    state = services / "prefect.json"
    # a URL nothing answers: the command's own `use_running_server` finds no API (it needs none here)
    state.write_text(
        json.dumps({"pid": server.pid, "url": "http://127.0.0.1:9/api", "log": "x", "started": 0})
    )
    log = open(tmp_path / "runner.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.warm_runner", str(server.pid), str(state)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    sock = services / "runner" / "runner.sock"
    try:
        wait_for(lambda: sock.exists() or proc.poll() is not None, what="the runner's socket")
        assert proc.poll() is None, (tmp_path / "runner.log").read_text()
        yield env, proc, server
    finally:
        for p in (proc, server):
            if p.poll() is None:
                p.kill()
            p.wait()
        log.close()
        for pid in servers_of(tmp_path / "cache"):  # a shared API a command recorded (its idle limit: 30 min)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def lake(tmp_path):
    out = tmp_path / "lake"
    env = {**_env(tmp_path), "CREDITFLOW_NO_SERVER": "1"}
    made = run_cli(
        ["synth", "--groups", "2", "--samples", "2", "--turns", "2", "--tokens", "30", "--out", str(out)], env
    )
    assert made.returncode == 0, made.stderr
    return out


def test_the_runner_freezes_what_its_commands_inherit(runner, tmp_path):
    """The runner imports with the collector off, then freezes its heap (flows.runtime.freeze_heap) before it
    forks any command: a command's full collections skip the objects it inherits and leave their pages
    unwritten."""
    import re

    log = tmp_path / "runner.log"
    wait_for(lambda: "objects frozen" in log.read_text(), 60, "the runner's start line")
    frozen = re.search(r"(\d+) objects frozen for the commands", log.read_text())
    assert frozen and int(frozen.group(1)) > 10000, log.read_text()


def test_command_words():
    from flows.warm_wire import command_name

    assert command_name(["process", "--round", "0"]) == "process"
    assert command_name(["--log-level", "debug", "--debug", "process"]) == "process"
    assert command_name(["--log-level", "process", "stats"]) == "stats"  # the level's value is no command
    assert command_name(["--help"]) is None


def test_frozen_env_is_what_the_imports_read():
    env = {
        "PREFECT_API_URL": "u",
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "INFO",  # set by the CLI per command
        "PYTHONPATH": "p",
        "CREDITFLOW_CACHE": "c",
        "CREDITFLOW_DEBUG": "1",  # read per command
        "CREDITFLOW_GC_FREEZE": "0",  # read when the runner starts: its commands inherit its frozen heap
        "HOME": "h",
    }
    assert warm_wire.frozen_env(env) == {
        "PREFECT_API_URL": "u",
        "PYTHONPATH": "p",
        "CREDITFLOW_CACHE": "c",
        "CREDITFLOW_GC_FREEZE": "0",
    }


def test_mismatch_names_what_differs():
    req = {"root": str(warm_wire.ROOT), "executable": sys.executable, "env": {"PREFECT_X": "1", "HOME": "a"}}
    assert warm_runner._mismatch(req, {"PREFECT_X": "1"}) is None
    assert "PREFECT_X" in (warm_runner._mismatch(req, {"PREFECT_X": "2"}) or "")
    assert "PREFECT_Y" in (warm_runner._mismatch(req, {"PREFECT_X": "1", "PREFECT_Y": "0"}) or "")
    assert "checkout" in (warm_runner._mismatch({**req, "root": "/elsewhere"}, {"PREFECT_X": "1"}) or "")
    assert "interpreter" in (
        warm_runner._mismatch({**req, "executable": "/x/python"}, {"PREFECT_X": "1"}) or ""
    )


def test_off_switches_run_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("CREDITFLOW_CACHE", str(tmp_path))
    for key in ("CREDITFLOW_NO_SERVER", "CREDITFLOW_SHARED_API", "CREDITFLOW_WARM_RUNNER"):
        monkeypatch.setenv(key, "1" if key == "CREDITFLOW_NO_SERVER" else "0")
        assert warm.run_via_runner(["creditflow", "process", "--round", "0"]) is None
        monkeypatch.delenv(key)
    assert warm.run_via_runner(["creditflow", "process", "--round", "0"]) is None  # no socket
    assert warm_wire.WHY["why"] == "no runner"
    assert warm.run_via_runner(["creditflow", "stats", "--round", "0"]) is None  # not a flow command


@pytest.mark.slow
def test_a_user_error_via_the_runner_is_one_line_and_its_status(runner, lake, tmp_path):
    env, _proc, _server = runner
    done = run_cli(["process", "--lake", str(lake), "--round", "7", "--methods", "grpo"], env)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"round 7 has no trajectories in {lake} (rounds there: 0); "
        "`creditflow ingest` or `creditflow synth` writes one"
    ]
    # (a project file edited while the test runs makes the runner stale: its log says so)
    assert len(stats(tmp_path)) == 2, (tmp_path / "runner.log").read_text()
    started, finished = stats(tmp_path)
    assert finished["exit"] == 1 and finished["command_pid"] == started["started"] != done.args
    assert finished["command_cpu_s"] > 0
    # the same command in its own process says the same
    own = run_cli(
        ["process", "--lake", str(lake), "--round", "7", "--methods", "grpo"],
        {**env, "CREDITFLOW_WARM_RUNNER": "0"},
    )
    assert (own.returncode, own.stderr) == (done.returncode, done.stderr)
    assert len(stats(tmp_path)) == 2  # no warm run recorded for it
    bad = run_cli(["process", "--lake", str(lake), "--round", "0", "--methods", "nosuch"], env)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    assert bad.stderr.startswith("error: method 'nosuch': unknown estimator")
    assert stats(tmp_path)[-1]["exit"] == 1


def _held_round(lake: Path, tmp_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """A process holding round 0's lock of `lake` until killed (a `process --wait` then waits for it)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from warehouse.lake import Lake\n"
            "from warehouse.locks import round_lock\n"
            f"with round_lock(Lake({str(lake)!r}), 0):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(600)\n",
        ],
        cwd=ROOT,
        env={**env, "CREDITFLOW_NO_SERVER": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def _waiting_command(lake: Path, tmp_path: Path, env: dict[str, str], **kw) -> tuple[subprocess.Popen, int]:
    client = cli(["process", "--lake", str(lake), "--round", "0", "--methods", "grpo", "--wait"], env, **kw)
    wait_for(lambda: any("started" in s for s in stats(tmp_path)), 60, "the command's start")
    pid = next(s["started"] for s in stats(tmp_path) if "started" in s)
    assert alive(pid) and pid != client.pid
    assert os.getpgid(pid) == pid  # a process group of its own
    return client, pid


def test_kill_9_of_the_caller_kills_its_command(runner, lake, tmp_path):
    env, proc, _server = runner
    holder = _held_round(lake, tmp_path, env)
    try:
        client, pid = _waiting_command(lake, tmp_path, env)
        client.kill()  # SIGKILL: no chance to forward anything; the runner sees its socket close
        client.wait()
        wait_for(lambda: not alive(pid), 30, "the orphaned command to be killed")
        assert proc.poll() is None  # the runner serves on
        # the shared API the command launched (the recorded one does not answer) never got recorded: its
        # watchdog stops it once the command is gone (flows/api_idle.py)
        try:
            wait_for(lambda: servers_of(tmp_path / "cache") == [], 60, "the command's unrecorded API to stop")
        except AssertionError:
            raise AssertionError(report(tmp_path / "cache")) from None
    finally:
        holder.kill()
        holder.wait()


def test_sigterm_of_the_caller_reaches_its_command(runner, lake, tmp_path):
    env, _proc, _server = runner
    holder = _held_round(lake, tmp_path, env)
    try:
        client, pid = _waiting_command(lake, tmp_path, env)
        supervisor = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        client.send_signal(signal.SIGTERM)
        try:
            client.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            who = {"caller": client.pid, "command": pid, "supervisor": supervisor}
            raise AssertionError(_hang_report(who)) from None
        # forwarded: the command died of it, and so did its caller, as a command in its own process does
        assert client.returncode == -signal.SIGTERM
        assert stats(tmp_path)[-1]["exit"] == -signal.SIGTERM
        assert not alive(pid)
        try:
            wait_for(lambda: servers_of(tmp_path / "cache") == [], 60, "the command's unrecorded API to stop")
        except AssertionError:
            raise AssertionError(report(tmp_path / "cache")) from None
    finally:
        holder.kill()
        holder.wait()


# test_a_signal_before_the_forked_command_runs_is_not_lost: a fork child of a fork child of this interpreter
# (the runner's supervisor's command, not the supervisor: its caller waits 2 s for its answer) first sleeps
FORK_DELAY = """import os, time
TOP = os.getpid()
def _late():
    if os.getppid() != TOP:
        time.sleep(float(os.environ["CF_TEST_FORK_DELAY_S"]))
if os.environ.get("CF_TEST_FORK_DELAY_S"):
    os.register_at_fork(after_in_child=_late)
"""


def test_a_signal_before_the_forked_command_runs_is_not_lost(lake, tmp_path):
    """A caller's SIGTERM that reaches its command before the command has its own handlers (a child not yet
    scheduled on a busy machine; here the command first sleeps 3 s in an at-fork hook) still
    ends the command: the supervisor holds it blocked across the fork. Before, the child caught it with the
    runner's handler (or the interpreter cleared it after the fork), went on and waited for the round: the
    clean-clone CI of 58852e9 timed out in test_sigterm_of_the_caller_reaches_its_command."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FORK_DELAY)
    env = {**_env(tmp_path), "PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}", "CF_TEST_FORK_DELAY_S": "3"}
    with _runner(tmp_path, env):
        holder = _held_round(lake, tmp_path, env)
        try:
            client, pid = _waiting_command(lake, tmp_path, env)
            client.send_signal(signal.SIGTERM)  # the command is still in its at-fork sleep
            try:
                client.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError(_hang_report({"caller": client.pid, "command": pid})) from None
            assert client.returncode == -signal.SIGTERM
            assert stats(tmp_path)[-1]["exit"] == -signal.SIGTERM
            assert not alive(pid)
        finally:
            holder.kill()
            holder.wait()


@pytest.mark.slow
def test_other_settings_or_stale_sources_run_in_process_and_stale_ends_the_runner(runner, lake, tmp_path):
    env, proc, server = runner
    args = ["process", "--lake", str(lake), "--round", "7", "--methods", "grpo"]
    other = run_cli(
        args, {**env, "PREFECT_LOGGING_LEVEL": "DEBUG" if env.get("PREFECT_LOGGING_LEVEL") else "INFO"}
    )
    assert other.returncode == 1 and stats(tmp_path) == []  # ran in its own process
    source = ROOT / "flows" / "display.py"  # a module the runner loaded
    st = source.stat()
    try:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        stale = run_cli(args, env)
        assert stale.returncode == 1 and "round 7 has no trajectories" in stale.stderr
        assert stats(tmp_path) == []
        proc.wait(timeout=30)  # the stale runner exits
        assert "changed since the runner started" in (tmp_path / "runner.log").read_text()
        assert not (tmp_path / "cache" / "services" / "runner" / "runner.sock").exists()
    finally:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert server.poll() is None


def test_the_runner_ends_with_its_server(runner):
    _env_, proc, server = runner
    server.kill()
    server.wait()
    assert proc.wait(timeout=30) == 0


def _advantages(lake: Path) -> list[dict]:
    from warehouse.lake import Lake

    table = Lake(lake).read("advantages", 0)
    return sorted(table.to_pylist(), key=lambda r: (r["method"], r["traj_id"], r["step_idx"]))


@pytest.mark.slow
def test_a_round_via_the_runner_matches_one_in_process(tmp_path):
    """A real `creditflow server start` starts the runner; a new round processed through it writes the same
    advantages as the same round processed in the command's own process, prints the same summary and says in
    the flow run's log how it ran; `server stop` ends the runner."""
    env = {**_env(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_LOGGING_LEVEL": "INFO"}
    lakes = [tmp_path / "lake-own", tmp_path / "lake-warm"]
    for lake in lakes:
        made = run_cli(["synth", "--groups", "8", "--samples", "4", "--out", str(lake), "--seed", "3"], env)
        assert made.returncode == 0, made.stderr
    started = run_cli(["server", "start"], env)
    assert started.returncode == 0, started.stderr
    try:
        sock = tmp_path / "cache" / "services" / "runner" / "runner.sock"
        wait_for(sock.exists, 180, "the runner beside the server")
        args = ["--log-level", "info", "process", "--round", "0", "--methods", "grpo,gae", "--lake"]
        own = run_cli([*args, str(lakes[0])], {**env, "CREDITFLOW_WARM_RUNNER": "0"})
        assert own.returncode == 0, own.stderr[-3000:]
        assert stats(tmp_path) == []
        assert "fixed cost: the command runs in its own process" in own.stderr
        via = run_cli([*args, str(lakes[1])], env)
        assert via.returncode == 0, via.stderr[-3000:]
        assert [s.get("exit") for s in stats(tmp_path)] == [None, 0]  # started, then finished
        assert "fixed cost: the command runs via warm runner" in via.stderr
        assert "its caller took" in via.stderr
        rows = _advantages(lakes[1])
        assert rows and rows == _advantages(lakes[0])

        # the same tables printed (the seconds aside)
        def shown(out: str) -> list[str]:
            return [ln for ln in out.splitlines() if "trajectories" in ln or "grpo" in ln or "gae" in ln]

        assert shown(via.stdout) == shown(own.stdout) != []
    finally:
        stopped = run_cli(["server", "stop"], env)
    assert stopped.returncode == 0
    wait_for(lambda: not warm_runner_alive(tmp_path), 30, "the runner to end with the server")


def warm_runner_alive(tmp_path: Path) -> bool:
    from flows.api_idle import _unused

    lock = tmp_path / "cache" / "services" / "runner" / "runner.lock"
    return lock.exists() and not _unused(lock)


def test_a_runner_a_command_started_imports_after_that_command(tmp_path):
    """Started by a command (flows.server.start_runner from `process`), the runner waits for that command to
    exit before its imports: it does not compete with the command's own round for the CPU."""
    env = _env(tmp_path)
    services = tmp_path / "cache" / "services"
    services.mkdir(parents=True)
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)
    launcher = subprocess.Popen(["sleep", "600"])
    state = services / "prefect.json"
    state.write_text(
        json.dumps({"pid": server.pid, "url": "http://127.0.0.1:9/api", "log": "x", "started": 0})
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.warm_runner", str(server.pid), str(state), str(launcher.pid)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    sock = services / "runner" / "runner.sock"
    try:
        wait_for(lambda: warm_runner_alive(tmp_path), 60, "the runner's lock")
        time.sleep(2.0)
        assert not sock.exists()  # still waiting for its launcher
        launcher.kill()
        launcher.wait()
        wait_for(sock.exists, 120, "the runner's socket once its launcher is gone")
    finally:
        for p in (proc, server, launcher):
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_socket_path_longer_than_sun_path_still_binds_and_connects(tmp_path):
    """A deep CREDITFLOW_CACHE / HOME / TMPDIR puts the runner's socket past sun_path's 108 bytes (a clean-clone
    CI's pytest folders did): bind and connect go through the folder's O_PATH descriptor instead."""
    import socket

    from flows.warm_wire import SUN_PATH_MAX, unix_address

    folder = tmp_path / ("d" * 60) / ("e" * 60)
    folder.mkdir(parents=True)
    path = folder / "runner.sock"
    assert len(str(path)) > SUN_PATH_MAX
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as plain, pytest.raises(OSError):
        plain.bind(str(path))  # what the runner did before
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(path) as address:
        listener.bind(address)
    listener.listen(1)
    assert path.exists()  # the socket file is where the runner's callers look for it
    caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(path) as address:
        caller.connect(address)
    conn, _ = listener.accept()
    caller.sendall(b"hello")
    assert conn.recv(5) == b"hello"
    for s in (conn, caller, listener):
        s.close()
    with unix_address(Path("/run/cf/runner.sock")) as address:  # a path that fits is used as it is
        assert address == "/run/cf/runner.sock"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _hang_report(pids: dict[str, int]) -> str:
    """Each process's threads (state, wait channel), pending and blocked signals, and its Python stacks when
    py-spy is at hand: what a hung check shows instead of a bare timeout."""
    spy = Path(sys.executable).with_name("py-spy")
    out = []
    for name, pid in pids.items():
        out.append(f"{name} {pid}: {_state(pid)}; threads {_threads(pid) if alive(pid) else '-'}")
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            out.extend(
                "  " + line for line in status if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigCgt"))
            )
        if alive(pid) and spy.exists():
            dump = subprocess.run(
                [str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
            )
            out.append(dump.stdout[-4000:] + dump.stderr[-1000:])
    return "\n".join(out)


def _threads(pid: int) -> str:
    """Each thread's state and kernel wait channel (for a failing check)."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            out.append(f"{task.name}:{state}:{(task / 'wchan').read_text()}")
        except OSError:
            continue
    return " ".join(out)


def _cpu_ticks(pid: int) -> int:
    """utime + stime of the process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_ctrl_z_stops_the_command_and_fg_resumes_it(runner, lake, tmp_path):
    """SIGTSTP of the caller (Ctrl-Z) stops its command in the runner too, not the caller alone; SIGCONT of
    the caller (the shell's fg / bg) resumes both, and the command still runs to its end."""
    env, _proc, _server = runner
    holder = _held_round(lake, tmp_path, env)
    try:
        # the caller in a process group of its own under this test, in its session (a shell job's): the kernel
        # discards a stop by SIGTSTP in an orphaned group, which the test worker's may be (xdist in CI)
        client, pid = _waiting_command(lake, tmp_path, env, process_group=0)
        client.send_signal(signal.SIGTSTP)
        # the command's group is stopped: the command itself ('T'), or, when the stop found it starting a
        # child (vfork: its parent waits in 'D' until the child, stopped too, execs), blocked on that child
        wait_for(
            lambda: _state(client.pid) == "T" and _state(pid) in "TD",
            30,
            lambda: (
                f"caller and command stopped (caller {_state(client.pid)}, command {_state(pid)}: "
                f"{_threads(pid)}; {stats(tmp_path)})"
            ),
        )
        cpu = _cpu_ticks(pid)
        time.sleep(1.0)
        assert _state(pid) in "TD" and _cpu_ticks(pid) == cpu  # stays stopped while its caller is
        client.send_signal(signal.SIGCONT)
        wait_for(lambda: _state(client.pid) != "T" and _state(pid) != "T", 30, "both resumed")
        holder.kill()  # the round's lock is free: the waiting command goes on and ends
        holder.wait()
        out, err = client.communicate(timeout=240)
        assert client.returncode == 0, err[-2000:]
        assert stats(tmp_path)[-1]["exit"] == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_signal_before_the_runner_answers_is_held_then_sent():
    """A signal that arrives while the request is on its way is held (a handler writing into the socket then
    would corrupt the request) and sent once the runner has the command, in order."""
    import socket as socket_

    from flows.warm_wire import Lines

    ours, theirs = socket_.socketpair()
    relay = warm._Relay()
    try:
        relay._on(signal.SIGTERM)
        relay._on(signal.SIGINT)
        theirs.settimeout(0.2)
        with pytest.raises(TimeoutError):
            theirs.recv(1)  # nothing sent yet
        relay.attach(ours)
        relay._on(signal.SIGHUP)
        lines = Lines(theirs)
        assert [lines.next()["signal"] for _ in range(3)] == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    finally:
        relay.restore()
        ours.close()
        theirs.close()


def test_signals_held_when_the_runner_falls_back_are_this_process_s():
    """The runner refuses (fallback): the command runs in the caller, so a signal held meanwhile is delivered to
    the caller itself, to its own handler."""
    got: list[int] = []
    before = signal.signal(signal.SIGHUP, lambda signum, _frame: got.append(signum))
    try:
        relay = warm._Relay()
        relay._on(signal.SIGHUP)
        assert got == []
        relay.restore(redeliver=True)
        assert got == [signal.SIGHUP]
        assert signal.getsignal(signal.SIGTSTP) is not relay._on
    finally:
        signal.signal(signal.SIGHUP, before)
