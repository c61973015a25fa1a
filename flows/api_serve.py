"""The shared Prefect API's server process (flows/api_launch.py `launch`): uvicorn serving Prefect's API app, as
`python -m uvicorn ARGS` does, with Python's cyclic garbage collector off while Prefect's server is imported.

Importing `prefect.server.api.server` is most of the server's start-up (2.4 s of its 3.4-4.5 s of CPU), and the
import builds hundreds of thousands of objects (pydantic models, SQLAlchemy tables, FastAPI routes) none of which
is garbage: with the collector on, it ran its passes over them hundreds of times. Off for the import only, the
import took 0.45 s less CPU (2.60-2.90 s -> 2.15-2.40 s, three runs each); the collector is back on before the
app is built and served, so nothing the server does later runs without it. What the import built is then frozen
(`gc.freeze`, as flows.runtime.freeze_heap does in the flow's processes; CREDITFLOW_GC_FREEZE=0 leaves it), so
the collector's full passes while the server serves go over the objects the requests make, not over it again.

Run as `python flows/api_serve.py UVICORN_ARGS...` (the arguments of `python -m uvicorn`, `--factory APP` and
`--app-dir DIR` included); the app's module is imported here first, the rest is uvicorn's own `main`."""

from __future__ import annotations

import gc
import importlib
import os
import sys


def _preimport(argv: list[str]) -> None:
    """Import the module of the `--factory` app (from `--app-dir`, as uvicorn would) with the collector off."""
    app = argv[argv.index("--factory") + 1] if "--factory" in argv[:-1] else None
    if app is None or ":" not in app:
        return
    if "--app-dir" in argv[:-1]:
        sys.path.insert(0, argv[argv.index("--app-dir") + 1])
    gc.disable()
    try:
        importlib.import_module(app.split(":", 1)[0])
    except Exception:  # noqa: BLE001 (uvicorn imports it again below and reports the error its own way)
        pass
    finally:
        if os.environ.get("CREDITFLOW_GC_FREEZE", "1") != "0":  # as flows.runtime.freeze_heap
            gc.freeze()  # what the import built, out of the collector's later passes (never garbage)
        gc.enable()


def main(argv: list[str]) -> None:
    _preimport(argv)
    from uvicorn.main import main as uvicorn_main

    uvicorn_main(args=argv, prog_name="uvicorn")


if __name__ == "__main__":
    main(sys.argv[1:])
