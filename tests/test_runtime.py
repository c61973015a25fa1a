"""flows/runtime.py: the allocator tuning is applied once per process, and can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CODE = "from flows.runtime import tune_allocator; print(tune_allocator(), tune_allocator())"


def _run(**env: str) -> str:
    base = {
        k: v for k, v in os.environ.items() if k not in ("CREDITFLOW_MALLOC_TUNE", "MALLOC_MMAP_THRESHOLD_")
    }
    out = subprocess.run(
        [sys.executable, "-c", CODE], env={**base, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tune_allocator_once_and_opt_out():
    assert _run() == "True False"  # applied, then a no-op
    assert _run(CREDITFLOW_MALLOC_TUNE="0") == "False False"
    assert _run(MALLOC_MMAP_THRESHOLD_="65536") == "False False"  # the user's own glibc setting wins


# NumPy's transparent-huge-page advice (flows/runtime.py: numpy_hugepages_off), in a fresh interpreter each: the
# switch is per process
HUGEPAGES = """
import os
{before}
from flows.runtime import numpy_hugepages_off
applied = numpy_hugepages_off()
import numpy
from numpy._core.multiarray import _set_madvise_hugepage
print(applied, _set_madvise_hugepage(False), os.environ.get("NUMPY_MADVISE_HUGEPAGE"))
"""


def _hugepages(numpy_first: bool, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    code = HUGEPAGES.format(before="import numpy" if numpy_first else "")
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize("numpy_first", [True, False], ids=["numpy-imported-before", "numpy-imported-after"])
def test_numpy_hugepages_off_unless_the_user_said_otherwise(numpy_first):
    # "applied, NumPy's advice before the print's own switch, the environment a child inherits"
    assert _hugepages(numpy_first) == "True False 0"
    # the user's NUMPY_MADVISE_HUGEPAGE wins; =0 inherited from a parent also reaches a NumPy imported before
    assert _hugepages(numpy_first, NUMPY_MADVISE_HUGEPAGE="1") == "False True 1"
    assert _hugepages(numpy_first, NUMPY_MADVISE_HUGEPAGE="0") == "True False 0"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tune_allocator_turns_numpy_hugepages_off_unless_opted_out():
    code = "import os; from flows.runtime import tune_allocator; tune_allocator(); "
    code += "print(os.environ.get('NUMPY_MADVISE_HUGEPAGE'))"
    base = {
        k: v for k, v in os.environ.items() if k not in ("CREDITFLOW_MALLOC_TUNE", "NUMPY_MADVISE_HUGEPAGE")
    }

    def env_after(**env: str) -> str:
        run = subprocess.run(
            [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
        )
        return run.stdout.strip()

    assert env_after() == "0"
    assert env_after(CREDITFLOW_MALLOC_TUNE="0") == "None"
    assert env_after(MALLOC_MMAP_THRESHOLD_="65536") == "0"  # glibc's setting is the user's; NumPy's is not


# gc.freeze once per process (flows/runtime.py: freeze_heap), in a fresh interpreter each
FREEZE = """
import gc, os, sys
from flows.runtime import freeze_heap
first, again = freeze_heap(), freeze_heap()
frozen = gc.get_freeze_count()
pid = os.fork()
if pid == 0:  # a forked child (the warm runner's command) freezes its own heap again
    os._exit(0 if freeze_heap() and not freeze_heap() else 1)
_, status = os.waitpid(pid, 0)
print(first, again, frozen > 10000, os.waitstatus_to_exitcode(status))
"""


def test_freeze_heap_once_per_process_and_opt_out():
    def run(**env: str) -> str:
        base = {k: v for k, v in os.environ.items() if k != "CREDITFLOW_GC_FREEZE"}
        code = "import prefect, polars, pyarrow\n" + FREEZE  # a heap like a round's process
        out = subprocess.run(
            [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run() == "True False True 0"
    assert run(CREDITFLOW_GC_FREEZE="0") == "False False False 1"


def test_a_batch_stage_freezes_its_process_heap(tmp_path):
    """A fresh process's first batch stage (flows.batch.run_stage) freezes what its imports built: its
    collector's full passes no longer go over them (gc.get_freeze_count), and the stage's result is the same."""
    code = f"""
import gc, sys
sys.path.insert(0, {str(tmp_path)!r})
sys.path.insert(0, "tests")
from test_flows_process import make_round
from flows.batch import round_batches, run_stage
from pipeline.config import Config
from pipeline.stages import get_stage
from warehouse.lake import Lake
lake = Lake({str(tmp_path / "lake")!r})
make_round(lake, round_=0, groups=2, batch_groups=2)
before = gc.get_freeze_count()
cfg = Config(lake=str(lake.root), methods=["grpo"])
summary = run_stage(lake, 0, round_batches(lake, 0)[0], get_stage("credit"), cfg)
print(before, gc.get_freeze_count() > 10000, summary["rows_out"]["advantages"] > 0)
"""
    env = {k: v for k, v in os.environ.items() if k != "CREDITFLOW_GC_FREEZE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "True", "True"]
