"""The execution context: everything a round runs on besides its stages, entered in two places.

- `command_api(cfg)`: what a command that runs flows enters once (`creditflow process`, the loop): its Prefect
  API (flows/server.py: the recorded server, else the machine's shared one, started now; else Prefect's
  ephemeral API of this process) and the settings its runs and their workers share (flows/runners.py).
- `round_execution(config, lake, batches)`: what `process_round_flow` enters for its stages: the allocator
  tuned (flows/runtime.py), the worker processes for a round of two batches or more (flows/workers.py: started
  now, stopped at the end), the task results kept in the lake, and this process's own API server at idle
  priority while the stage workers fill the cores (flows/api_priority.py).

The round's lock is the flow's own (process_round_flow): one run per (lake, round) whoever starts it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from flows import workers
from flows.api_priority import api_waits_for_idle_cpu, stages_fill_cpus
from flows.caching import result_dir
from flows.runners import settings_scope, worker_api
from flows.runtime import freeze_heap, tune_allocator
from pipeline.config import Config
from warehouse.lake import Lake


@contextmanager
def command_api(
    cfg: Config, say: Callable[[str], None] | None = None, while_starting: Callable[[], object] | None = None
) -> Iterator[str | None]:
    """The API this command's flow runs report to, for the block; yields its URL (None: Prefect's ephemeral
    API, started by the first client). `while_starting` runs while a shared API comes up (the round's
    preparation); `say` gets the one line telling that one was started."""
    from prefect.settings import PREFECT_API_URL

    from flows.server import api_url

    url = api_url(say, while_starting)
    with settings_scope({PREFECT_API_URL: url} if url else {}), worker_api(cfg) as url_:
        yield url_ or url


def _log_how_run() -> None:
    """The flow run's log says where its command ran (flows/warm.py): via the warm runner, with the seconds its
    caller took to hand it over (part of the round's fixed cost the flow's own clock does not see), or in its
    own process and why."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    from flows.warm import describe

    try:
        get_run_logger().info("fixed cost: the command runs %s", describe())
    except MissingContextError:  # called outside a flow run (a test of the context alone)
        pass


@contextmanager
def round_execution(config: Config, lake: Lake, batches: list[str]) -> Iterator[tuple[Config, bool]]:
    """The stage phase of a round (module docstring); yields the config the round runs with (flow.processes
    decided for its size) and whether the API waits for idle CPU meanwhile."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    tune_allocator()  # per-batch arrays stay on the heap
    freeze_heap()  # what the imports and the API client built, out of the collector's passes
    _log_how_run()
    config = workers.for_round(config, len(batches))
    if workers.use_processes(config):
        workers.warm(config.max_workers)
    idle = config.flow.api_idle and config.task_runner in ("threads", "processes")
    # cache records and the small JSON summaries they point to both live in the lake
    with settings_scope({PREFECT_LOCAL_STORAGE_PATH: result_dir(lake)}):
        try:
            with api_waits_for_idle_cpu(idle and stages_fill_cpus(config.max_workers)) as idle_api:
                yield config, idle_api is not None
        finally:
            workers.shutdown()  # worker processes hold a batch's memory; free it
