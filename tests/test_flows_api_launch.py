"""flows/api_launch.py: a command that will run a flow launches the machine's API from the CLI's first lines
(`prelaunch`), the flow's SharedAPI adopts it, and a command that never needed it stops it at exit. The launch
itself is replaced by a stand-in process in a session of its own (`sleep`, started as `launch` starts the
server): what is tested here is who launches, adopts, stops and holds the start lock; tests/test_flows_server.py
runs the real server end to end."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flows import api_launch, server


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """No API recorded, the environment sharing one, `launch` starting a sleeping stand-in; yields the list of
    stand-ins launched (all stopped at the end)."""
    monkeypatch.setenv("CREDITFLOW_CACHE", str(tmp_path / "cache"))
    for name in ("PREFECT_API_URL", "CREDITFLOW_NO_SERVER", "CREDITFLOW_SHARED_API"):
        monkeypatch.delenv(name, raising=False)
    launched: list[subprocess.Popen] = []

    def fake_launch(port=None, ui=True):
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        launched.append(proc)
        return proc, "http://127.0.0.1:9/api", tmp_path / "server.log"

    monkeypatch.setattr(api_launch, "launch", fake_launch)
    monkeypatch.setattr(server, "launch", fake_launch)
    yield launched
    api_launch.drop_prelaunched()
    for proc in launched:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _lock_is_free() -> bool:
    lock = api_launch.StartLock()
    free = lock.acquire(wait=False)
    lock.release()
    return free


@pytest.mark.parametrize(
    "argv",
    [
        ["creditflow", "synth", "--out", "x"],
        ["creditflow", "process", "--help"],
        ["creditflow", "--log-level", "process", "query", "select 1"],
        ["creditflow"],
    ],
)
def test_only_a_command_that_runs_a_flow_launches(stand_in, argv):
    assert not api_launch.prelaunch(argv)
    assert stand_in == []


@pytest.mark.parametrize(
    "env",
    [{"CREDITFLOW_NO_SERVER": "1"}, {"CREDITFLOW_SHARED_API": "0"}, {"PREFECT_API_URL": "http://x/api"}],
)
def test_an_environment_that_keeps_its_own_api_launches_none(stand_in, monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not api_launch.prelaunch(["creditflow", "process", "--round", "0"])
    assert stand_in == []


def test_the_flow_adopts_the_launched_api(stand_in, monkeypatch):
    """process launches once; the flow's SharedAPI takes that process (no second launch) with its lock, which
    stays held until the API answers; nothing is left for the exit handler to stop."""
    assert api_launch.prelaunch(["creditflow", "--log-level", "INFO", "process", "--round", "0"])
    assert len(stand_in) == 1 and not _lock_is_free()
    assert not api_launch.prelaunch(["creditflow", "process", "--round", "0"])  # once per process
    monkeypatch.setattr(server, "shares_api", lambda: True)
    api = server.shared_api()
    assert api is not None and api.started_here
    assert api._proc is stand_in[0] and len(stand_in) == 1
    assert api_launch.take_prelaunched() is None
    api_launch.drop_prelaunched()  # the exit handler: a no-op now
    assert stand_in[0].poll() is None and not _lock_is_free()
    api._lock.release()


def test_a_launch_no_command_needed_is_stopped_and_its_lock_freed(stand_in):
    """An up-to-date round, a usage error: the command exits without a flow run; the exit handler stops the
    launched server's process group and frees the start lock for the next command."""
    assert api_launch.prelaunch(["creditflow", "process", "--round", "0"])
    proc = stand_in[0]
    api_launch.drop_prelaunched()
    assert proc.poll() is not None
    assert _lock_is_free()


def test_a_profile_naming_an_api_stops_the_launch(stand_in, monkeypatch):
    """Only Prefect's settings read the profile's PREFECT_API_URL: when it names an API, the one launched first
    thing is stopped at once and the flow reports to the profile's."""
    assert api_launch.prelaunch(["creditflow", "process", "--round", "0"])
    monkeypatch.setattr(server, "shares_api", lambda: False)
    assert server.shared_api() is None
    assert stand_in[0].poll() is not None and _lock_is_free()


def test_a_command_already_starting_one_is_left_to_it(stand_in):
    """Another command holds the start lock (its server is coming up): this one launches none and later waits
    for that one (SharedAPI takes the lock and finds it recorded)."""
    other = api_launch.StartLock()
    assert other.acquire(wait=False)
    try:
        assert not api_launch.prelaunch(["creditflow", "process", "--round", "0"])
        assert stand_in == []
    finally:
        other.release()


def test_a_recorded_api_that_answers_is_used_not_relaunched(stand_in, monkeypatch):
    state = api_launch.state_path()
    state.parent.mkdir(parents=True)
    state.write_text('{"pid": 1, "url": "http://127.0.0.1:9/api", "log": "x", "started": 0}')
    monkeypatch.setattr(api_launch, "healthy", lambda url, timeout=1.0: url == "http://127.0.0.1:9/api")
    assert not api_launch.prelaunch(["creditflow", "process", "--round", "0"])
    assert stand_in == [] and _lock_is_free()


def test_the_cli_launches_before_it_imports_prefect():
    """The launch is in the CLI's first lines: flows.cli and flows.api_launch import neither Prefect nor the
    server module's dependencies (httpx, pydantic)."""
    import sys

    code = (
        "import sys, flows.cli, flows.api_launch; "
        "print(sorted(m for m in ('prefect', 'httpx', 'pydantic', 'pyarrow') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"
