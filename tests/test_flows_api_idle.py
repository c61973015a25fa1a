"""The shared Prefect API's idle watchdog (flows/api_idle.py): it stops the server's process group once no
command has held the in-use lock for the idle limit, never while one holds it, and forgets the record."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows import api_idle

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, flock")

WATCHDOG = Path(api_idle.__file__)
HOLDER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import api_idle
api_idle.hold_in_use(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by this test) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def _server_and_watchdog(
    tmp_path: Path, idle_s: str, recorded: bool = True
) -> Iterator[tuple[subprocess.Popen, subprocess.Popen, Path]]:
    """A stand-in server (a sleeping process in a session of its own, recorded as the flows.server record is,
    unless not `recorded`) and the watchdog in a session of its own as flows.server starts it, polling every
    0.1 s."""
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    state = tmp_path / "services" / "prefect.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    if recorded:
        state.write_text(json.dumps({"pid": server.pid, "url": "http://127.0.0.1:1/api"}))
    env = os.environ | {api_idle.IDLE_ENV: idle_s, api_idle.POLL_ENV: "0.1"}
    dog = subprocess.Popen(
        [sys.executable, str(WATCHDOG), str(server.pid), str(state)], env=env, start_new_session=True
    )
    try:
        yield server, dog, state
    finally:
        for p in (server, dog):
            p.kill()
            p.wait()


def _holder(state: Path) -> subprocess.Popen:
    """A command holding the API's in-use lock (until killed)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(state), str(WATCHDOG.parent)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_an_unused_server_is_stopped_and_forgotten(tmp_path):
    with _server_and_watchdog(tmp_path, "1") as (server, dog, state):
        assert _wait_gone(server.pid, 30), "the idle server still runs"
        assert dog.wait(timeout=30) is not None
        assert not state.exists()


def test_a_command_holding_the_api_keeps_it_and_its_exit_frees_it(tmp_path):
    with _server_and_watchdog(tmp_path, "1") as (server, _dog, state):
        holder = _holder(state)
        try:
            time.sleep(3)  # three idle limits with the lock held: the server stays
            assert _alive(server.pid) and state.exists()
        finally:
            holder.kill()  # kill -9 releases the lock too
            holder.wait()
        assert _wait_gone(server.pid, 30)
        assert not state.exists()


def test_a_newer_record_is_kept(tmp_path):
    """The record names another server by the time this one goes idle: the watchdog leaves it."""
    with _server_and_watchdog(tmp_path, "1") as (server, _dog, state):
        state.write_text(json.dumps({"pid": 999999999, "url": "http://127.0.0.1:2/api"}))
        assert _wait_gone(server.pid, 30)
        assert json.loads(state.read_text())["pid"] == 999999999


def test_idle_limit_zero_keeps_the_server(tmp_path):
    with _server_and_watchdog(tmp_path, "0") as (server, dog, state):
        assert dog.wait(timeout=30) == 0
        time.sleep(0.5)
        assert _alive(server.pid) and state.exists()


def test_a_bad_limit_is_the_default(monkeypatch):
    monkeypatch.setenv(api_idle.IDLE_ENV, "ten")
    assert api_idle.idle_limit() == api_idle.DEFAULT_IDLE_S
    monkeypatch.setenv(api_idle.IDLE_ENV, "-5")
    assert api_idle.idle_limit() == 0.0


@pytest.mark.parametrize("idle_s", ["1800", "0"])
def test_a_server_its_launcher_never_recorded_stops_once_unused(tmp_path, idle_s):
    """The command that launched the shared API died (Ctrl-C, kill -9) before the API answered and was recorded:
    no later command can find that server, so it stops as soon as no command holds the in-use lock, whatever
    the idle limit (0 included); while its launcher holds the lock, it runs on."""
    # the launcher holds the in-use lock before the server and its watchdog start, as flows.api_launch.launch
    # does (taken after, a watchdog polling first found it unused and stopped the server: 1 run under load 6)
    state = tmp_path / "services" / "prefect.json"
    state.parent.mkdir(parents=True)
    launcher = _holder(state)
    with _server_and_watchdog(tmp_path, idle_s, recorded=False) as (server, _dog, _state):
        try:
            time.sleep(1.5)  # starting: unrecorded, but its launcher lives
            assert _alive(server.pid)
        finally:
            launcher.kill()
            launcher.wait()
        assert _wait_gone(server.pid, 10), "an abandoned server still runs"


def test_a_recorded_server_is_left_to_the_idle_limit(tmp_path):
    """Recorded by its launcher, the server outlives that command: the idle limit, not the launcher, ends it."""
    with _server_and_watchdog(tmp_path, "1800") as (server, dog, state):
        time.sleep(1.5)
        assert _alive(server.pid) and dog.poll() is None and state.exists()


def test_the_server_starts_its_own_watchdog_before_it_becomes_the_server(tmp_path):
    """`api_idle.py --exec STATE COMMAND...` (how flows/api_launch.py starts the shared API) forks the
    watchdog, then execs the server under the same pid: no server runs without its watchdog, however its
    launcher dies; with no record and no command holding the in-use lock, the watchdog stops it."""
    state = tmp_path / "services" / "prefect.json"
    state.parent.mkdir(parents=True)
    env = os.environ | {api_idle.IDLE_ENV: "1800", api_idle.POLL_ENV: "0.1"}
    server = subprocess.Popen(
        [sys.executable, str(WATCHDOG), "--exec", str(state), "/bin/sleep", "300"],
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while b"sleep" not in Path(f"/proc/{server.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the server never became the command"
            time.sleep(0.05)

        def watchdogs() -> list[Path]:
            return [
                p
                for p in Path("/proc").iterdir()
                if p.name.isdigit() and _cmdline(p)[-2:] == [str(server.pid).encode(), str(state).encode()]
            ]

        # its watchdog: a grandchild forked before the exec, under its own command line once it has exec'd too
        while len(watchdogs()) != 1:
            assert time.monotonic() < deadline, "the server runs without its watchdog"
            time.sleep(0.05)
        assert server.wait(timeout=20) is not None  # unrecorded, unused: stopped
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


def _cmdline(proc: Path) -> list[bytes]:
    try:
        return (proc / "cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return []
