"""Worker processes behind the thread runner.

The batch stages spend most of their time holding the GIL (the rule detectors and the IAPO rules annotator
are Python; the credit and export stages convert between Arrow, NumPy and Python in many small steps), so
two threads on two cores reach only ~1.3-1.5x one. With `flow.processes` on, each thread-runner worker hands
its batch stage to a worker process and waits for the small summary it returns: Prefect still orchestrates
the task runs (states, caching, retries, progress) from its threads, while the work runs on every core. The
worker reads its inputs from the lake and writes its parts there itself, so nothing but paths, the config and
the summary crosses the process boundary.

Processes are forked from a forkserver that imports the pipeline once (workers start in milliseconds after the
first); each call carries the parent's environment, so settings changed after the server started still apply.
Stages that call an LLM stay in the flow's process: they wait on HTTP, not the GIL.

The thread runner gets two threads per worker (`dispatch_slots`): while one computes, the other does Prefect's
bookkeeping of the next task, and at most `max_workers` compute at once (the pool's size, or `run_here`'s
semaphore for work in the flow's process).

    flow.processes: auto   # on for the thread runner (default) in a round of 2+ batches, whatever max_workers
    flow.processes: true   # the same (Ray and Dask workers are processes already)
    flow.processes: false  # threads only: the stages run in the flow's process

With one worker too: a stage in the flow process's thread runs next to Prefect's threads (its event loops, the
events worker, the other dispatch thread) and in a thread's own malloc arena; measured on the 16M-token round
(bench/results/flows.md), the flow process then spent 16.6-19.1 s of CPU where the bare functions spent
15.0-18.4 s and one worker process 13.7-16.3 s (the ~1.7 s of orchestration in the flow process and ~1.2 s in
Prefect's API then run on the other core); overhead against the bare functions +10.7% in the thread, +2.1% so.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from flows.runtime import die_with_parent, tune_allocator
from pipeline.config import Config

# imported once by the forkserver, so a worker starts with them (and their registries) loaded
PRELOAD = [
    "flows.worker_init",  # first: the forkserver exits with its parent
    "flows.batch",
    "pipeline.stages",
    "pipeline.detect",
    "pipeline.detect.builtin",
    "pipeline.annotate",
    "pipeline.annotate.rules",
    "pipeline.credit",
    "pipeline.export",
    "warehouse.rounds",
]

_lock = threading.Lock()
_pools: dict[int, ProcessPoolExecutor] = {}


def use_processes(config: Config, batches: int | None = None) -> bool:
    """Whether batch stages run in worker processes under this config (for a round of `batches` batches: `auto`
    runs a round of one batch in the flow's process, where the worker's start and imports, ~1.5 s of CPU, would
    cost more than the GIL it frees)."""
    if config.flow.processes is False or config.task_runner != "threads":  # Ray / Dask: processes already
        return False
    return config.flow.processes is True or batches is None or batches > 1


def for_round(config: Config, batches: int) -> Config:
    """The config a round of `batches` batches runs with: `flow.processes` decided (`use_processes`)."""
    if config.flow.processes != "auto" or use_processes(config, batches):
        return config
    return config.model_copy(update={"flow": config.flow.model_copy(update={"processes": False})})


def dispatch_slots(config: Config) -> int:
    """Thread-runner threads (= tasks in flight): two per worker, so the next task's orchestration (task run,
    cache key, state changes) happens while the worker computes, not in between. At most `max_workers` of
    them compute at once: the process pool's size, or `run_here`'s semaphore."""
    return 2 * config.max_workers


_slots: dict[int, threading.BoundedSemaphore] = {}


def run_here(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in this process, at most `size` at a time (the thread runner's workers)."""
    with _lock:
        slots = _slots.setdefault(size, threading.BoundedSemaphore(size))
    with slots:
        return fn(*args, **kwargs)


def _pool(size: int) -> ProcessPoolExecutor:
    with _lock:
        pool = _pools.get(size)
        if pool is None:
            import multiprocessing as mp

            ctx = mp.get_context("forkserver")  # never fork a process that runs Prefect's threads
            ctx.set_forkserver_preload(PRELOAD)
            pool = _pools[size] = ProcessPoolExecutor(size, mp_context=ctx, initializer=die_with_parent)
        return pool


def warm(size: int) -> None:
    """Start the pool's processes now (the forkserver's imports take a second or two), without waiting. A pool
    already started keeps its processes: nothing to do (`creditflow process` and the flow both call this)."""
    with _lock:
        if size in _pools:
            return
    pool = _pool(size)
    for _ in range(size):
        pool.submit(int)


def warm_in_background(config: Config, batches: int | None = None) -> None:
    """When this config runs stages in worker processes, start them from a thread now: `creditflow process` calls
    it first, so the forkserver's imports (~0.5 s) overlap the start-up of Prefect's ephemeral API server instead
    of delaying the round's first task."""
    if not use_processes(config, batches):
        return

    def _warm() -> None:
        try:
            warm(config.max_workers)
        except RuntimeError:  # the flow ended (and shut the pool down) first: nothing to warm
            pass

    threading.Thread(target=_warm, name="creditflow-warm", daemon=True).start()


def shutdown() -> None:
    """Stop the worker processes (the forkserver stays for the next run; it exits with this process)."""
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)


def _call(env: dict[str, str], fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    # large freed blocks stay on the worker's heap for its next batch (once per process; CREDITFLOW_MALLOC_TUNE=0
    # turns it off): measured, the same 12 batches in two workers 9.05-9.43 s without, 8.10-8.70 s with (a third
    # of the page faults, half the system time)
    tune_allocator()
    return fn(*args, **kwargs)


def run(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a worker process of a pool of `size`; its result (or its exception) here.

    A pool whose worker died (killed, out of memory) is dropped, so the task's retry or the next run gets a
    fresh one; the error names what happened."""
    pool = _pool(size)
    try:
        return pool.submit(_call, dict(os.environ), fn, args, kwargs).result()
    except BrokenProcessPool as exc:
        with _lock:
            if _pools.get(size) is pool:
                del _pools[size]
        raise RuntimeError(
            f"a creditflow worker process died while running {getattr(fn, '__name__', fn)}"
            f"{args[2:4] if len(args) >= 4 else ''}: {str(exc).rstrip('.')}{_script_hint()}"
        ) from exc


def _script_hint() -> str:
    """When the flow was started from a script: its workers import that script (multiprocessing's rule for
    forkserver and spawn), so unguarded top-level code runs again in each worker, and usually kills it."""
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__spec__", None) is None and getattr(main, "__file__", None):
        return (
            f". The worker processes import the main script {main.__file__}: put its top-level code under "
            '`if __name__ == "__main__":` (multiprocessing\'s rule), or set flow.processes: false'
        )
    return ""
