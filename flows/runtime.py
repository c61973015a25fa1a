"""Process-level tuning for batch work.

`tune_allocator()`: the credit engine and the stages allocate and free arrays of 10-30 MB per batch (a float64
value per token of a 3M-token batch). glibc serves blocks that large with mmap and unmaps them on free, so every
batch pays a page fault per 4 KiB on first touch again: measured on the gae path, 0.38 s per batch before and
0.25 s after keeping them on the heap. This raises glibc's mmap threshold to its maximum (32 MiB on 64-bit) and
stops it trimming the heap, so freed blocks are reused by the next batch. Peak memory is unchanged (the same
arrays are alive at the peak); the process keeps its peak heap until it exits.

Called by the CLI, the process_round flow and flows/workers.py's worker processes (two workers on two cores,
the same 12 batches: 9.05-9.43 s without, 8.10-8.70 s with, system time halved); a no-op off glibc, when
called twice, or with CREDITFLOW_MALLOC_TUNE=0 (or the MALLOC_MMAP_THRESHOLD_ environment variable of glibc
set by the user).

It also stops NumPy asking for transparent huge pages (`numpy_hugepages_off`). NumPy marks every array of 4 MiB
or more MADV_HUGEPAGE, so the kernel backs it with 2 MiB pages where it can. A fresh process (every `creditflow
process` worker) takes its first batch's arrays from memory the kernel hands out anew, and on this project's
machines (virtual machines whose free memory goes back to the host: virtio-balloon free page reporting, here
in 8 MiB blocks) a 2 MiB page is mostly such memory, which the host must back again on the first touch. gae's
first 512-group round in a fresh worker after the machine sat idle for 6 s: 1.19-1.31 s with the advice, 0.95-1.17
s without; no compaction stalls were counted (/proc/vmstat), and a process past its first round took the same
time either way (bench/results/credit.md, ninth session). NumPy's own switch, the NUMPY_MADVISE_HUGEPAGE
environment variable, wins where the user set it (=1 keeps NumPy's advice)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's upper limit (32 MiB on 64-bit)

_done = False


def tune_allocator() -> bool:
    """Keep large freed blocks on the heap for reuse (glibc only); True when the setting was applied."""
    global _done
    if _done:
        return False
    _done = True
    if not sys.platform.startswith("linux") or os.environ.get("CREDITFLOW_MALLOC_TUNE", "1") == "0":
        return False
    numpy_hugepages_off()
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(M_TRIM_THRESHOLD, 2**30) == 1 and ok
    return ok


def numpy_hugepages_off() -> bool:
    """Stop NumPy marking its large arrays MADV_HUGEPAGE: NUMPY_MADVISE_HUGEPAGE=0 for a NumPy imported later
    (here or in a child process: the workers), and NumPy's own switch where it is imported already (also where
    NUMPY_MADVISE_HUGEPAGE=0 came from the parent: a process that imported NumPy before its environment said so).
    A no-op where NUMPY_MADVISE_HUGEPAGE says otherwise (the user's choice). True when applied."""
    value = os.environ.get("NUMPY_MADVISE_HUGEPAGE")
    if value is None:
        os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"
    elif value.strip() != "0":
        return False
    np = sys.modules.get("numpy")
    if np is not None:  # NumPy 2 keeps the switch in numpy._core, NumPy 1 in numpy.core
        core = getattr(np, "_core", None) or getattr(np, "core", None)
        switch = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
        if switch is None:
            return False
        switch(False)
    return True


# the process (pid) that froze its heap: a forked child (the warm runner's commands) freezes its own
_frozen_in = 0


def freeze_heap() -> bool:
    """Move every object alive now out of the cyclic garbage collector's passes (`gc.freeze`), once per process;
    True when applied. Called when a process starts a round's stages (flows.execution.round_execution: the
    flow's process) or its batch work (flows.batch.run_stage, the statistics pass: a worker process), and by the
    warm runner before it forks commands (as Python's documentation of `gc.freeze` advises for a process that
    forks). By then the process holds what its imports and Prefect's client built (250,000-400,000 objects
    with Prefect, pydantic, polars and pyarrow loaded), none of it garbage, and every full collection went over
    all of it again: 100-270 ms a pass in a flow's process, where the round ran one or two, and in a command
    forked by the runner each pass wrote to the page of every object it inherited. Frozen objects are still
    freed by reference counting when their last reference goes; only a reference cycle among objects alive at
    the call is never collected (a few hundred objects, once per process). CREDITFLOW_GC_FREEZE=0 leaves the
    collector as Python sets it."""
    global _frozen_in
    if _frozen_in == os.getpid() or os.environ.get("CREDITFLOW_GC_FREEZE", "1") == "0":
        return False
    _frozen_in = os.getpid()
    import gc

    gc.freeze()
    return True


PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`), so a
    `creditflow process` killed with -9 leaves no worker processes behind holding a batch's memory. Called by each
    worker (whose parent, the forkserver, is single-threaded: the signal follows the parent *thread*, so it is not
    for a process started from a short-lived thread); the forkserver itself exits when its parent's pipe closes.
    True when applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        applied = libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if applied and parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the request took effect
    return applied


def exit_with_parent(poll_s: float = 0.5) -> None:
    """Exit this process once its parent process has died (a daemon thread polls the parent pid). For the worker
    processes' forkserver, which may be started from a short-lived thread of the parent, where the kernel's
    parent-death signal (tied to that thread) would fire too early; its workers then follow through
    `die_with_parent`."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="creditflow-exit-with-parent", daemon=True).start()


def start_worker(parent_pid: int) -> None:
    """The initializer of the `processes` task runner's worker processes (Prefect's ProcessPoolTaskRunner): exit
    with the flow's process (a `creditflow process` killed with -9 leaves no worker holding a batch's memory; a
    poll, since the pool may start its workers from any of the parent's threads) and keep large freed blocks on
    the heap for the next batch."""
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before this worker started
    exit_with_parent()
    tune_allocator()


# the reaper: a small process (no imports beyond the standard library's os/sys/time/signal) that waits for the
# process that started it to die and then stops the child it names, unless that child has gone or was replaced
# (its start time in /proc/<pid>/stat no longer the one recorded)
_REAPER = """
import os, signal, sys, time
parent, child = int(sys.argv[1]), int(sys.argv[2])
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the parent handles it
def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else fields[19]
born = stat(child)
while born is not None and stat(child) == born:
    if os.getppid() != parent:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
            if stat(child) != born:
                break
            os.kill(child, sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and stat(child) == born:
                time.sleep(0.1)
        break
    time.sleep(0.5)
"""


def reap_with_parent(child_pid: int) -> bool:
    """Stop `child_pid` (SIGTERM, SIGKILL after 5 s) once this process has died, however it died: for a child
    started by code this project does not own (Prefect's ephemeral API server, a uvicorn subprocess), where no
    `die_with_parent` can run in the child, and which may be started from any thread (the kernel's parent-death
    signal follows the thread). A `creditflow process` killed with -9 then leaves no API server behind (issue 33).
    True when the reaper started (Linux only: it reads /proc)."""
    import subprocess

    if not sys.platform.startswith("linux"):
        return False
    try:
        reaper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, str(os.getpid()), str(child_pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return False
    _reapers.append(reaper)  # held: a Popen object collected while its process runs warns
    return True


_reapers: list = []
