"""The task runner a flow maps batches over: threads (default), a Ray cluster (prefect-ray) or a Dask
cluster (prefect-dask), local unless `task_runner_address` names one.

Process-based workers report task runs to the Prefect API themselves. Without a server, each would start its
own ephemeral API (and leave it running), so `worker_api` gives every worker one URL: the configured server
(PREFECT_API_URL) or Prefect's ephemeral API server, started once per process (its URL given to the workers)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from flows.runtime import reap_with_parent
from pipeline.config import Config, ConfigError

RUNNERS = ("threads", "processes", "ray", "dask")
OWN_API_RECORDER_BATCH = 100

SETTINGS_SCOPES_KEPT = 16
_scopes: dict[tuple, tuple] = {}
_scopes_lock = threading.Lock()


@contextmanager
def settings_scope(updates: dict) -> Iterator[object]:
    """`prefect.settings.temporary_settings(updates=...)`, with the derived settings built once per process.

    Prefect builds a whole new `Settings` for every `temporary_settings` (~100 nested pydantic-settings models
    that each read the environment again: 0.1-0.15 s of CPU on this machine, paid by every round a flow or the
    CLI runs in the same process). Settings are immutable, so the derived object is kept and reused when the
    same updates are applied to the same settings; the environment is read when the base settings were built,
    as with `temporary_settings`. Updates that are already in effect enter no new scope at all."""
    import prefect.context

    context = prefect.context.get_settings_context()
    base = context.settings
    current = {setting: setting.value_from(base) for setting in updates}
    if all(current[s] == v or (v is not None and str(current[s]) == str(v)) for s, v in updates.items()):
        yield base
        return
    key = (id(base), tuple(sorted((s.name, repr(v)) for s, v in updates.items())))
    with _scopes_lock:
        hit = _scopes.get(key)
        if hit is None or hit[0] is not base:  # the entry keeps `base` alive, so its id is not reused
            while len(_scopes) >= SETTINGS_SCOPES_KEPT:  # a server that sees many lakes: keep the newest
                del _scopes[next(iter(_scopes))]
            hit = _scopes[key] = (base, base.copy_with_update(updates=updates))
    with prefect.context.SettingsContext(profile=context.profile, settings=hit[1]):
        yield hit[1]


# where the lake is and how to reach it: a Ray job's workers get these from the driver (runtime_env), so one
# lake URI names the same storage everywhere. Credentials are not sent (Ray keeps runtime_env in its GCS and
# dashboard): the nodes take them from their own environment, profile or instance role, as Dask workers take all
# of these from the environment their `dask worker` was started with.
LAKE_ENV = (
    "CREDITFLOW_LAKE_FORMAT",
    "CREDITFLOW_STATE_DIR",
    "CREDITFLOW_S3_ENDPOINT",
    "AWS_ENDPOINT_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ALLOW_HTTP",
    "AWS_PROFILE",
)


def _worker_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    env = {"PREFECT_HOME": str(PREFECT_HOME.value())}
    if PREFECT_API_URL.value():
        env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    for key in ("PREFECT_LOGGING_LEVEL", "PREFECT_SERVER_ANALYTICS_ENABLED", "CREDITFLOW_CACHE", *LAKE_ENV):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def make_task_runner(config: Config):
    """The configured Prefect task runner (call inside `worker_api`)."""
    kind = config.task_runner
    if kind == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        from flows.workers import dispatch_slots

        return ThreadPoolTaskRunner(max_workers=dispatch_slots(config))
    if kind == "processes":
        from prefect.task_runners import ProcessPoolTaskRunner

        from flows.runtime import start_worker

        return ProcessPoolTaskRunner(
            max_workers=config.max_workers, initializer=start_worker, initargs=(os.getpid(),)
        )
    if kind == "ray":
        from prefect_ray import RayTaskRunner

        init = {"runtime_env": {"env_vars": _worker_env()}, "include_dashboard": False}
        if not config.task_runner_address:
            init.update(num_cpus=config.max_workers, object_store_memory=256 * 2**20)
            # a throwaway local Ray on 127.0.0.1: Ray >= 2.5x turns token auth on for a new local cluster and
            # writes ~/.ray/auth_token, which then clashes with a token this process already loaded (another
            # cluster's); the user's own RAY_AUTH_MODE wins
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        return RayTaskRunner(address=config.task_runner_address, init_kwargs=init)
    if kind == "dask":
        from prefect_dask import DaskTaskRunner

        if config.task_runner_address:
            return DaskTaskRunner(address=config.task_runner_address)
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": config.max_workers,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
            }
        )
    raise ConfigError(f"task_runner {kind!r}: choose one of {RUNNERS}")


@contextmanager
def worker_api(config: Config) -> Iterator[str | None]:
    """Make sure process-based workers share one Prefect API; yields its URL (None for threads without one)."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    from flows.caching import result_dir
    from warehouse.lake import Lake

    # where process_round_flow keeps its task results (it sets this itself when called some other way)
    updates: dict = {PREFECT_LOCAL_STORAGE_PATH: result_dir(Lake(config.lake))}
    # a loaded 2-core machine needs more than the default 20 s to start the ephemeral API
    timeout = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
    if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" not in os.environ:
        updates[timeout] = max(timeout.value(), 120)
    updates.update(_own_api_settings())
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():  # Prefect's ephemeral API will start (the patch imports its server: 3 s)
        reap_api_server_with_us()
    with settings_scope(updates):
        with _worker_api(config) as url:
            yield url


def reap_api_server_with_us() -> None:
    """Every Prefect API server this process starts (Prefect's ephemeral one: a uvicorn subprocess, started by
    whichever thread first needs a client) is stopped when this process dies, a kill -9 included
    (`flows.runtime.reap_with_parent`), and logs to the terminal only what is critical unless --debug. Wraps
    the one method that starts it; once per process."""
    from prefect.server.api.server import SubprocessASGIServer

    start = SubprocessASGIServer._run_uvicorn_command
    if getattr(start, "creditflow_reaped", False):
        return

    def run_uvicorn_command(self):
        # a command's terminal shows the server's own errors (e.g. events it could not flush while a failed run
        # stops it: a traceback) only with --debug; the server inherits the environment when it starts
        cli = sys.modules.get("flows.cli")
        quiet = cli is not None and not cli.debugging() and "PREFECT_SERVER_LOGGING_LEVEL" not in os.environ
        # the root logger too: SQLAlchemy's pool logs a cancelled connection reset (a 20-line traceback) there
        # when a failed run stops the server
        levels = ("PREFECT_SERVER_LOGGING_LEVEL", "PREFECT_LOGGING_ROOT_LEVEL")
        set_here = [k for k in levels if k not in os.environ] if quiet else []
        for k in set_here:
            os.environ[k] = "CRITICAL"
        try:
            proc = start(self)
        finally:
            for k in set_here:
                os.environ.pop(k, None)
        reap_with_parent(proc.pid)
        return proc

    run_uvicorn_command.creditflow_reaped = True  # type: ignore[attr-defined]
    SubprocessASGIServer._run_uvicorn_command = run_uvicorn_command  # type: ignore[method-assign]


def _own_api_settings() -> dict:
    """Settings for a Prefect API that lives and dies with this process (the ephemeral one, or the one started
    here for Ray / Dask workers); none when PREFECT_API_URL names a server, and none the user set themselves.

    - No flow-run heartbeats: they let a server mark a flow run whose process died as crashed, and an API that
      dies with the process has nobody to tell; Prefect joins the heartbeat thread at the end of every flow
      run after it sleeps in 1 s steps (0.5-1 s of a round's wall time).
    - The API's task-run recorder writes task runs in batches (up to 100 events, flushed every second and when
      the server stops) instead of one database transaction per state event: a round's 49 task runs send
      147 events, and that halved the API server's CPU (which shares the cores with the stages)."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE,
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL,
    )

    if PREFECT_API_URL.value():
        return {}
    wanted = {
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE: OWN_API_RECORDER_BATCH,
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL: 1,
    }
    user = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": ("PREFECT_RUNNER_HEARTBEAT_FREQUENCY",)}
    return {
        setting: value
        for setting, value in wanted.items()
        if not any(k in os.environ for k in (setting.name, *user.get(setting.name, ())))
    }


@contextmanager
def _worker_api(config: Config) -> Iterator[str | None]:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if config.task_runner == "threads" or url:  # processes, ray, dask: their workers report to one API
        saved = os.environ.get("PREFECT_API_URL")
        if url:
            os.environ["PREFECT_API_URL"] = str(url)  # workers started from here inherit it
        try:
            yield url
        finally:
            if url:
                _restore("PREFECT_API_URL", saved)
        return
    from prefect.server.api.server import SubprocessASGIServer

    # Prefect's own ephemeral server (the one instance a flow's client starts without PREFECT_API_URL): started
    # once per process and stopped when it exits (Prefect registers that), so rounds run one after another in a
    # process share it, and the flow's events and logs go to a server that is still there
    server = SubprocessASGIServer()
    quiet = os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED")
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"  # the child server only: no telemetry calls
    try:
        server.start()
    finally:
        _restore("PREFECT_SERVER_ANALYTICS_ENABLED", quiet)
    saved = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        with settings_scope({PREFECT_API_URL: server.api_url}):
            yield server.api_url
    finally:
        _restore("PREFECT_API_URL", saved)


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
