"""flows/api_serve.py: the shared API's server process imports its app's module with the cyclic garbage
collector off, freezes what the import built, then turns the collector back on and hands the arguments to uvicorn
unchanged."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows import api_serve

APP = """
import gc
GC_AT_IMPORT = gc.isenabled()
def create_app():
    raise AssertionError("built by uvicorn, not by the pre-import")
"""


@pytest.fixture
def app_dir(tmp_path, monkeypatch):
    (tmp_path / "cf_fake_api_app.py").write_text(APP)
    monkeypatch.setattr(sys, "path", list(sys.path))  # _preimport inserts --app-dir as uvicorn does
    yield tmp_path
    sys.modules.pop("cf_fake_api_app", None)
    gc.unfreeze()  # (the pre-import freezes what it built: back into this test process's collections)


def test_the_factorys_module_is_imported_with_the_collector_off_and_it_is_back_on_after(app_dir):
    assert gc.isenabled()
    api_serve._preimport(
        ["--app-dir", str(app_dir), "--factory", "cf_fake_api_app:create_app", "--port", "1"]
    )
    assert sys.modules["cf_fake_api_app"].GC_AT_IMPORT is False
    assert gc.isenabled()


def test_an_app_that_fails_to_import_is_left_to_uvicorn_and_the_collector_is_back_on(app_dir):
    (app_dir / "cf_fake_api_app.py").write_text("raise ImportError('broken app')\n")
    api_serve._preimport(["--app-dir", str(app_dir), "--factory", "cf_fake_api_app:create_app"])
    assert gc.isenabled() and "cf_fake_api_app" not in sys.modules


def test_without_a_factory_nothing_is_imported(app_dir):
    api_serve._preimport(["--app-dir", str(app_dir), "cf_fake_api_app:create_app"])
    assert "cf_fake_api_app" not in sys.modules and gc.isenabled()


@pytest.mark.parametrize("freeze", ["1", "0"])
def test_what_the_import_built_is_frozen_unless_turned_off(app_dir, freeze):
    """In a process of its own (as the server's): the app module's objects leave the collector's passes
    (gc.freeze), none with CREDITFLOW_GC_FREEZE=0."""
    code = (
        "import gc, sys; from flows import api_serve; before = gc.get_freeze_count(); "
        f"api_serve._preimport(['--app-dir', {str(app_dir)!r}, '--factory', 'cf_fake_api_app:create_app']); "
        "print(before, gc.get_freeze_count(), gc.isenabled())"
    )
    env = {**os.environ, "CREDITFLOW_GC_FREEZE": freeze}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    before, after, enabled = out.stdout.split()
    assert int(before) == 0 and enabled == "True"
    assert (int(after) > 1000) if freeze == "1" else (int(after) == 0), out.stdout
