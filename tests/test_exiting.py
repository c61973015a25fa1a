"""flows/exiting.py: a command ends as the interpreter ends it (threads' exit hooks, non-daemon threads,
atexit handlers, flushed streams, the exit status), less the teardown of its modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import atexit, sys, threading, time
from flows.exiting import exit_now

log = open(sys.argv[1], "a", buffering=1)

class Torn:
    def __del__(self):
        log.write("teardown\\n")

KEEP = Torn()  # a module global: only the interpreter's teardown deletes it
threading._register_atexit(lambda: log.write("thread hook\\n"))
atexit.register(lambda: log.write("atexit\\n"))

def late():
    time.sleep(0.3)
    log.write("thread done\\n")

threading.Thread(target=late).start()  # non-daemon: waited for
sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
exit_now(eval(sys.argv[2]))
"""


def _run(tmp_path: Path, code: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = tmp_path / "log.txt"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log), code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    return done, log.read_text().splitlines()


def test_exit_now_runs_the_exit_hooks_in_the_interpreters_order_and_skips_the_teardown(tmp_path):
    done, lines = _run(tmp_path, "3")
    assert done.returncode == 3
    assert done.stdout == "buffered, no newline"
    # threading's exit hooks, then the join of non-daemon threads, then atexit; no teardown (no __del__ of KEEP)
    assert lines == ["thread hook", "thread done", "atexit"]


def test_exit_now_statuses_are_the_interpreters(tmp_path):
    assert _run(tmp_path, "None")[0].returncode == 0
    message = _run(tmp_path, "'error: bad input'")[0]
    assert message.returncode == 1 and message.stderr.strip() == "error: bad input"


def test_the_command_line_ends_without_the_teardown(tmp_path):
    """The CLI's own exit (a real command, its status and output) goes through exit_now: an object that only
    the interpreter's teardown would delete is never deleted."""
    log = tmp_path / "log.txt"
    code = (
        "import os, sys\n"
        f"FD = os.open({str(log)!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)\n"
        "class Torn:\n"
        "    def __del__(self, _write=os.write, _fd=FD): _write(_fd, b'teardown')\n"
        "KEEP = Torn()\n"
        "from flows.cli import app\n"
        "sys.argv[0] = 'creditflow'\n"
        "app()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "--version"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("creditflow ")
    assert log.read_text() == ""
    bad = subprocess.run(
        [sys.executable, "-c", code, "no-such-command"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "no-such-command" in bad.stderr  # click's usage error, its status
    assert log.read_text() == ""


DRAIN = """
import logging, sys, threading
from flows.exiting import exit_now

logging.basicConfig(stream=sys.stderr, format="%(name)s - %(message)s")
if sys.argv[1] == "debug":
    logging.getLogger("EventsWorker").setLevel(logging.DEBUG)
# what Prefect's queue service logs from its exit hook when items are still queued
threading._register_atexit(lambda: logging.getLogger("EventsWorker").warning("Still processing items: 5 items"))
threading._register_atexit(lambda: logging.getLogger("EventsWorker").error("failed to send 5 events"))
print("error: the command's one line", file=sys.stderr)
exit_now(1)
"""


def test_prefects_drain_progress_at_exit_is_not_shown_unless_debugging():
    """Under load, Prefect's event worker warned "Still processing items" while draining at exit, and a failing
    command's one-line error became two lines (the clean-clone CI of a585535); its errors still show."""
    run = [sys.executable, "-c", DRAIN]
    quiet = subprocess.run([*run, "info"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 1
    assert quiet.stderr.splitlines() == [
        "error: the command's one line",
        "EventsWorker - failed to send 5 events",
    ]
    debug = subprocess.run([*run, "debug"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "EventsWorker - Still processing items: 5 items" in debug.stderr.splitlines()
