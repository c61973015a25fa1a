"""Temporary names and their leftovers: every temporary file or folder a lake writer makes carries its
writer's process id and machine (`temp_token`: `.tmp-<pid>@<host>@<hex>-...`), so a run's cleanup removes only
the leftovers of writers that are gone (`stale_temp`), never the files another live run is writing, on this
machine or (a lake on a shared filesystem) on another; `fsync_dir` makes a rename in a folder durable."""

from __future__ import annotations

import functools
import os
import re
import socket
import time
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def host_name() -> str:
    """This machine's name as it goes into temporary names (a safe alphabet, no '@')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"


def temp_token() -> str:
    """The middle of a temporary name: this process's id, this machine's name and a random part
    (`.tmp-<pid>@<host>@<hex>-...`), so that `Lake.cleanup` of one run never removes the files another live
    run is writing, on this machine or (a lake on a shared filesystem) on another."""
    return f"{os.getpid()}@{host_name()}@{uuid.uuid4().hex}"


def _writer_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


STALE_UNOWNED_S = 3600.0
STALE_OTHER_HOST_S = 24 * 3600.0  # a process id of another machine cannot be asked: only age tells
_OWNED = re.compile(r"(\d{1,7})@([A-Za-z0-9._-]{1,64})@")


def stale_temp(path: Path, prefix: str) -> bool:
    """A leftover: its writer's process on this machine is gone; a file of another machine's writer (a shared
    filesystem) only when over a day old; a name without a process id when over an hour old. (A name of the
    older form `<pid>-<hex>` names no machine: its process id is taken as this machine's.)"""
    rest = path.name[len(prefix) :]
    owned = _OWNED.match(rest)
    if owned:
        if owned.group(2) == host_name():
            return not _writer_alive(int(owned.group(1)))
        return _older_than(path, STALE_OTHER_HOST_S)
    pid, sep, _ = rest.partition("-")
    if sep and pid.isdigit() and len(pid) <= 7:
        return not _writer_alive(int(pid))
    return _older_than(path, STALE_UNOWNED_S)


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except FileNotFoundError:
        return False
