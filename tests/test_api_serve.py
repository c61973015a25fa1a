"""flows/api_serve.py: the shared API's server process imports its app's module with the cyclic garbage
collector off, then turns it back on and hands the arguments to uvicorn unchanged."""

from __future__ import annotations

import gc
import sys

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
