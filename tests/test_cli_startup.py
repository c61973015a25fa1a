"""The CLI starts fast (#21.5): `import flows.cli` builds the Typer app without the heavy libraries; each
command imports what it needs when it runs. Structural checks (which modules load), not timings."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# libraries no command needs to be listed or parsed (each one tenths of a second or more to import)
HEAVY = ("torch", "ray", "dask", "prefect", "polars", "duckdb", "deltalake", "numpy", "pyarrow")


def _imported(code: str) -> set[str]:
    """The modules a fresh interpreter imports running `code` (python -X importtime)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return {
        line.rsplit("|", 1)[1].strip()
        for line in out.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def test_importtime_parser_sees_heavy_imports():
    # the check below can fail: the same parse sees a heavy import when there is one
    assert "numpy" in _imported("import numpy")


def test_cli_import_loads_no_heavy_library():
    modules = _imported("import flows.cli")
    assert "flows.cli" in modules and "typer" in modules
    loaded = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not loaded, f"import flows.cli loads {loaded}"


def test_help_loads_no_heavy_library():
    modules = _imported(
        "import sys\nfrom flows.cli import app\nsys.argv = ['creditflow', 'process', '--help']\n"
        "try:\n    app()\nexcept SystemExit:\n    pass"
    )
    loaded = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not loaded, f"creditflow process --help loads {loaded}"


def test_config_with_trainer_settings_still_loads():
    """The trainer's settings (stages.loop / collect / train) register when a command builds its config, so a
    config holding them is valid for every command (they no longer register at CLI import)."""
    code = (
        "from flows.config import load_config\n"
        "cfg = load_config(sets=['loop.rounds=2', 'train.lr=0.5', 'collect.temperature=0.3'])\n"
        "print(cfg.settings_named('loop').rounds, cfg.settings_named('train').lr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "0.5"]
