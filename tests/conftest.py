"""Test setup. Prefect's home (its cache records) goes to a temp dir before prefect is imported, and one
session-scoped Prefect test harness serves every flow test."""

import atexit
import os
import shutil
import tempfile

_PREFECT_HOME = tempfile.mkdtemp(prefix="creditflow-prefect-")
atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("CREDITFLOW_CACHE", os.path.expanduser("~/.cache/creditflow"))
# a developer's `creditflow server start` is not used by the tests (tests/test_flows_server.py starts its own)
os.environ["CREDITFLOW_NO_SERVER"] = "1"
# nor a recorded vLLM service: the services a test records (and the client finds, and heals) are this
# session's and this worker's alone (a demo test once found another worker's killed server and restarted it)
_SERVICES = tempfile.mkdtemp(prefix="creditflow-services-")
atexit.register(shutil.rmtree, _SERVICES, ignore_errors=True)
os.environ["CREDITFLOW_SERVICES_DIR"] = _SERVICES
# the vllm tests run two CPU servers at once (the session's and the loop's policy server): 2 GiB of KV cache
# each, not the service's 4 GiB default, on a 2-core 24 GiB machine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# real third-party trajectories, shipped with the project (copies of ../shared/data/real, licenses included)
REAL_DATA = Path(__file__).resolve().parents[1] / "data" / "real"


@pytest.fixture(scope="session")
def real_data() -> Path:
    return REAL_DATA


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture
def lake(tmp_path):
    from warehouse.lake import Lake

    return Lake(tmp_path / "lake")


@pytest.fixture(scope="session")
def _llm_standin_server():
    from llm_standin import StandIn

    with StandIn() as server:
        yield server


@pytest.fixture
def llm_standin(_llm_standin_server):
    """A running stand-in for an OpenAI-compatible server (tests/llm_standin.py), reset for each test:
    `.url` is its base URL, `.behaviour`, `.fail_next`, `.latency_s`, `.calls`, `.max_inflight`, ..."""
    _llm_standin_server.reset()
    yield _llm_standin_server
    _llm_standin_server.reset()


@pytest.fixture(scope="session")
def vllm_server():
    """A REAL vllm-cpu server with SmolLM2-135M-Instruct (the service venv of `creditflow llm setup`), shared by
    every `vllm` test of the session; skipped with the reason when the venv or checkpoint is absent."""
    from trainer.llm import service

    if service.service_ready() is None:
        pytest.skip(f"vLLM service venv absent ({service.default_venv()}): run `creditflow llm setup`")
    if not service.model_ready():
        pytest.skip(f"SmolLM2 checkpoint absent ({service.default_model_dir()}): run `creditflow llm setup`")
    try:
        info = service.serve("default", wait_s=600, record=False, log=lambda s: None)
    except RuntimeError as exc:
        pytest.skip(f"vllm-cpu did not start: {str(exc).splitlines()[0]}")
    yield info
    service.kill(info.pid)


# ---- what this machine lacks: one reason per kind, one block at the end of the run ----------------------


def pytest_collection_modifyitems(config, items):
    """Tests marked `sandbox` run candidate code in bubblewrap: where it cannot run here they skip, naming why
    (`./dev test` installs Debian's bubblewrap when it runs as root)."""
    marked = [item for item in items if item.get_closest_marker("sandbox")]
    if not marked:
        return
    from trainer.sandbox import sandbox_problem

    problem = sandbox_problem()
    if problem is None:
        return
    why = (problem.strip().splitlines() or ["it exits with an error"])[0][:120]
    skip = pytest.mark.skip(reason=f"bubblewrap cannot run here ({why}): apt-get install bubblewrap")
    for item in marked:
        item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One block: how many tests skipped, grouped by reason (the reasons name what to install)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    by_reason: dict[str, int] = {}
    for rep in skipped:
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        by_reason[reason] = by_reason.get(reason, 0) + 1
    terminalreporter.section(f"{len(skipped)} skipped, by reason", sep="-")
    for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{n:4d}  {reason}")
