"""flows/runtime.py: the allocator tuning is applied once per process, and can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
