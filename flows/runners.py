"""The task runner a flow maps batches over: threads (default), a Ray cluster (prefect-ray) or a Dask
cluster (prefect-dask), local unless `task_runner_address` names one.

Process-based workers report task runs to the Prefect API themselves. Without a server, each would start its
own ephemeral API (and leave it running), so `worker_api` gives every worker one URL: the configured server
(PREFECT_API_URL) or one local API server started for the run and stopped after it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.config import Config, ConfigError

RUNNERS = ("threads", "ray", "dask")


def _worker_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    env = {"PREFECT_HOME": str(PREFECT_HOME.value())}
    if PREFECT_API_URL.value():
        env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    for key in ("PREFECT_LOGGING_LEVEL", "PREFECT_SERVER_ANALYTICS_ENABLED", "CREDITFLOW_CACHE"):
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
    if kind == "ray":
        from prefect_ray import RayTaskRunner

        init = {"runtime_env": {"env_vars": _worker_env()}, "include_dashboard": False}
        if not config.task_runner_address:
            init.update(num_cpus=config.max_workers, object_store_memory=256 * 2**20)
        return RayTaskRunner(address=config.task_runner_address, init_kwargs=init)
    if kind == "dask":
        from prefect_dask import DaskTaskRunner

        if config.task_runner_address:
            return DaskTaskRunner(address=config.task_runner_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": config.max_workers, "threads_per_worker": 1,
                                              "processes": True, "dashboard_address": None})
    raise ConfigError(f"task_runner {kind!r}: choose one of {RUNNERS}")


@contextmanager
def worker_api(config: Config) -> Iterator[str | None]:
    """Make sure process-based workers share one Prefect API; yields its URL (None for threads without one)."""
    from prefect.settings import (
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    # a loaded 2-core machine needs more than the default 20 s to start the ephemeral API
    timeout = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
    if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" not in os.environ:
        with temporary_settings(updates={timeout: max(timeout.value(), 120)}):
            with _worker_api(config) as url:
                yield url
    else:
        with _worker_api(config) as url:
            yield url


@contextmanager
def _worker_api(config: Config) -> Iterator[str | None]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = PREFECT_API_URL.value()
    if config.task_runner == "threads" or url:
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
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            yield server.api_url
    finally:
        _restore("PREFECT_API_URL", saved)
        server.stop()


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
