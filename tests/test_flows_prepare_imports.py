"""`creditflow process` imports Prefect whole, in its own thread, before `flows.run.prepare` starts the threads
that overlap the API's start-up (issue 33 item 11: "1 run in 6 prints a Prefect plugin import race").

Prefect's first import runs its plugin set-up (`prefect._initialize_plugins`: `from prefect.settings import
get_current_settings`, then `prefect.context`). When the round's import thread (`from prefect import flow`) and
the command's thread (`from prefect.settings import ...`) both import Prefect for the first time, Python's
import locks hand one of them a partially initialised `prefect.settings` and Prefect prints "Failed to
initialize plugins: cannot import name 'get_current_settings' from partially initialized module
'prefect.settings'" on stderr. Each check runs in a fresh interpreter, where Prefect is not imported yet."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# every thread start in the process records whether Prefect was fully imported at that moment
DRIVER = """
import sys, threading

started = []
real_start = threading.Thread.start

def start(self):
    mod = sys.modules.get("prefect")
    whole = mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", True)
    started.append((self.name, whole))
    real_start(self)

threading.Thread.start = start
from flows.run import prepare
from pipeline.config import Config

assert "prefect" not in sys.modules, "importing flows.run imported Prefect: the check below proves nothing"
cfg = Config(lake=sys.argv[1])
cfg = cfg.model_copy(update={"flow": cfg.flow.model_copy(update={"processes": sys.argv[2] == "1"})})
prepare(cfg).join(120)
from flows import workers
workers.shutdown()
print(repr(started))
"""


def _thread_starts(tmp_path: Path, processes: bool) -> list[tuple[str, bool]]:
    res = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "lake"), "1" if processes else "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "Failed to initialize plugins" not in res.stderr
    return ast.literal_eval(res.stdout.strip().splitlines()[-1])


def test_prefect_is_imported_whole_before_the_import_thread_starts(tmp_path):
    starts = _thread_starts(tmp_path, processes=False)
    assert [name for name, _ in starts] == ["creditflow-imports"]
    assert all(whole for _, whole in starts), starts


@pytest.mark.slow  # the worker processes' forkserver starts too
def test_and_before_the_worker_warm_up_thread_starts(tmp_path):
    starts = _thread_starts(tmp_path, processes=True)
    names = [name for name, _ in starts]
    assert names[:2] == ["creditflow-warm", "creditflow-imports"], names
    assert all(whole for name, whole in starts if name.startswith("creditflow-")), starts
