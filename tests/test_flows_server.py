"""`creditflow server start|stop|status`: a Prefect server kept in the background and used by `process`
automatically (flows/server.py). Runs the real CLI in subprocesses against a real `prefect server start`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from api_processes import servers_of

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _cli(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from flows.cli import app; app()", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_process_uses_the_managed_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "CREDITFLOW_NO_SERVER")}
    env.update(CREDITFLOW_CACHE=str(tmp_path / "cache"), PREFECT_HOME=str(tmp_path / "prefect-home"))
    lake = tmp_path / "lake"
    synth = _cli(
        ["synth", "--groups", "4", "--samples", "2", "--turns", "2", "--tokens", "40", "--out", str(lake)],
        env,
    )
    assert synth.returncode == 0, synth.stderr
    assert _cli(["server", "status"], env).returncode == 1  # none yet
    started = _cli(["server", "start"], env)
    try:
        assert started.returncode == 0, started.stderr
        state = json.loads((tmp_path / "cache" / "services" / "prefect.json").read_text())
        assert state["url"].startswith("http://127.0.0.1:") and state["url"].endswith("/api")
        again = _cli(["server", "start"], env)  # idempotent: the same server
        assert again.returncode == 0 and "running" in again.stdout
        assert (
            json.loads((tmp_path / "cache" / "services" / "prefect.json").read_text())["pid"] == state["pid"]
        )
        # the first run computes, the second is a cached re-run (--force: a flow run even though the round is
        # up to date), the third finds the round up to date and starts no flow run
        for extra in ([], ["--force"], []):
            run = _cli(["process", "--lake", str(lake), "--round", "0", "--methods", "grpo", *extra], env)
            assert run.returncode == 0, run.stderr[-2000:]
        assert "round 0 is up to date" in run.stdout
        # the runs are recorded by the managed server (not an ephemeral API that died with the command)
        probe = (
            "import asyncio\n"
            "from prefect.client.orchestration import get_client\n"
            "async def main():\n"
            "    async with get_client() as c:\n"
            "        runs = await c.read_flow_runs()\n"
            "        print(len([r for r in runs if r.state and r.state.is_completed()]))\n"
            "asyncio.run(main())\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env={**env, "PREFECT_API_URL": state["url"]},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert int(out.stdout.strip().splitlines()[-1]) >= 2
        assert _cli(["server", "status"], env).returncode == 0
    finally:
        stopped = _cli(["server", "stop"], env)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not (tmp_path / "cache" / "services" / "prefect.json").exists()
    assert _cli(["server", "status"], env).returncode == 1


def test_stop_leaves_a_process_that_reused_a_stale_pid(tmp_path, monkeypatch):
    """A state file left by a server that died (reboot, kill -9) names a pid another process may now hold:
    `server stop` removes the record but signals only a Prefect server."""
    from flows import server

    monkeypatch.setenv("CREDITFLOW_CACHE", str(tmp_path / "cache"))
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a group leader, like the server was
    try:
        server.state_path().parent.mkdir(parents=True)
        server.state_path().write_text(
            json.dumps({"pid": other.pid, "url": "http://127.0.0.1:9/api", "log": "x", "started": 0.0})
        )
        assert server.stop() is not None
        assert other.poll() is None  # still running
        assert not server.state_path().exists()
    finally:
        other.kill()
        other.wait()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_process_starts_a_shared_api_for_the_next_command(tmp_path):
    """No server up: the first `process` starts Prefect's API without the UI in the background, says so in one
    line and leaves it recorded for the next command, which starts none; `server stop` ends it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "CREDITFLOW_NO_SERVER")}
    env.update(CREDITFLOW_CACHE=str(tmp_path / "cache"), PREFECT_HOME=str(tmp_path / "prefect-home"))
    state_file = tmp_path / "cache" / "services" / "prefect.json"
    lakes = [tmp_path / "lake-a", tmp_path / "lake-b"]
    for lake in lakes:
        synth = _cli(
            [
                "synth",
                "--groups",
                "4",
                "--samples",
                "2",
                "--turns",
                "2",
                "--tokens",
                "40",
                "--out",
                str(lake),
            ],
            env,
        )
        assert synth.returncode == 0, synth.stderr
    try:
        first = _cli(["process", "--lake", str(lakes[0]), "--round", "0", "--methods", "grpo"], env)
        assert first.returncode == 0, first.stderr[-2000:]
        state = json.loads(state_file.read_text())
        assert "started a Prefect API at " + state["url"] in " ".join(first.stdout.split())
        assert state["ui"] is False
        assert servers_of(tmp_path / "cache") == [state["pid"]]
        # its idle watchdog watches it (tests/test_flows_api_idle.py: what the watchdog does)
        watchdogs = [
            p
            for p in Path("/proc").iterdir()
            if p.name.isdigit()
            and _read(p / "cmdline").split(b"\0")[-3:-1]
            == [str(state["pid"]).encode(), str(state_file).encode()]
        ]
        assert len(watchdogs) == 1
        second = _cli(["process", "--lake", str(lakes[1]), "--round", "0", "--methods", "grpo"], env)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "started a Prefect API" not in second.stdout
        assert json.loads(state_file.read_text())["pid"] == state["pid"]  # the same server, still up
        assert _cli(["server", "status"], env).returncode == 0
    finally:
        stopped = _cli(["server", "stop"], env)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not state_file.exists()
    from trainer.llm.service import pid_alive

    assert not pid_alive(state["pid"])
    # no API up and the round up to date: the API the CLI launched first thing (flows/api_launch.py) is stopped
    # at exit, not left running unrecorded
    again = _cli(["process", "--lake", str(lakes[0]), "--round", "0", "--methods", "grpo"], env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "up to date" in again.stdout and "started a Prefect API" not in again.stdout
    assert not state_file.exists()
    assert servers_of(tmp_path / "cache") == []


def test_no_server_keeps_an_api_per_command(monkeypatch):
    """CREDITFLOW_NO_SERVER=1 (the test suite) or CREDITFLOW_SHARED_API=0: no shared API is started."""
    from flows import server

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("CREDITFLOW_NO_SERVER", "1")
    assert server.shared_api() is None
    monkeypatch.delenv("CREDITFLOW_NO_SERVER")
    monkeypatch.setenv("CREDITFLOW_SHARED_API", "0")
    assert server.shared_api() is None
    monkeypatch.delenv("CREDITFLOW_SHARED_API")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # nothing names an API: not the environment, nor a settings context an earlier test of this worker left
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert server.shares_api()
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert not server.shares_api()
