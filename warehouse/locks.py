"""One writer per (lake, round): an advisory lock file `LAKE/_flow/locks/round=<n>.lock`.

`process` holds it for the whole round, so a second `process` of the same round on the same lake stops at once
with one line naming the run that holds it, or waits for it (`wait_s`, `creditflow process --wait`): the
waiting run then finds the holder's work done and cached. The kernel drops the lock when its
holder dies (flock), so a killed run never leaves the round locked. Rounds are independent: two runs on two
rounds of one lake proceed side by side (their temporary files carry their process id, see
`Lake.cleanup`). Re-entrant within a process: the flow takes the lock the CLI already holds."""

from __future__ import annotations

import datetime as dt
import fcntl
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from warehouse.lake import Lake

LOCK_DIR = "_flow/locks"
SETTLE_S = 2.0  # how long a contender waits for a holder's line (written just after its flock, cleared before release)


class RoundBusy(RuntimeError):
    """Another run holds the round's lock; the message is one line naming it."""


_held: dict[str, list] = {}  # lock path -> [file, depth] held by this process
_guard = threading.Lock()


def lock_path(lake: Lake, round_: int) -> Path:
    return lake.root / LOCK_DIR / f"round={int(round_)}.lock"


HOLDER_CHARS = 200  # the most of a lock file's line an error repeats (the lake's files are not trusted)


def _holder(path: Path) -> str:
    """The holder's line ("pid N since ..."), or "" while it has none (just after its flock, or releasing):
    the file's first line, at most HOLDER_CHARS of it, its unprintable characters as '?' (whatever wrote the
    file, the error that repeats it stays one line)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(HOLDER_CHARS * 4).decode("utf-8", errors="replace")
    except OSError:
        return ""
    line = head.strip().split("\n", 1)[0][:HOLDER_CHARS]
    return "".join(c if c.isprintable() else "?" for c in line).strip()


@contextmanager
def round_lock(
    lake: Lake,
    round_: int,
    wait_s: float = 0.0,
    poll_s: float = 0.2,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[Path]:
    """Hold the (lake, round) lock for the block; RoundBusy if another process holds it after `wait_s`
    (`math.inf`: as long as the holder runs). `on_wait` gets one line naming the holder when this call has to
    wait (once, before the first wait)."""
    path = lock_path(lake, round_)
    key = str(path)
    with _guard:
        mine = _held.get(key)
        if mine is not None:
            mine[1] += 1
    if mine is not None:
        try:
            yield path
        finally:
            with _guard:
                mine[1] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held past this block, closed below
    start = time.monotonic()
    waited = False
    while True:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _holder(path)
            if not holder and time.monotonic() - start < SETTLE_S:
                # the holder took the lock and has not written its line yet, or is releasing it: look again
                time.sleep(0.01)
                continue
            holder = holder or "another run"
            if time.monotonic() - start >= wait_s:
                fh.close()
                after = f" (waited {time.monotonic() - start:.0f} s)" if waited else ""
                raise RoundBusy(
                    f"round {int(round_)} of {lake.root} is being processed by {holder}{after}; "
                    "wait for that run to finish (or stop it) and run again, or run with --wait"
                ) from None
            if not waited and on_wait is not None:
                limit = "" if math.isinf(wait_s) else f" (up to {wait_s:g} s)"
                on_wait(
                    f"round {int(round_)} of {lake.root} is being processed by {holder}; "
                    f"waiting for it to finish{limit}"
                )
            waited = True
            time.sleep(poll_s)
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} since {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M:%S} UTC\n")
    fh.flush()
    with _guard:
        _held[key] = [fh, 1]
    try:
        yield path
    finally:
        with _guard:
            _held.pop(key, None)
        try:
            fh.seek(0)
            fh.truncate()
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            fh.close()
