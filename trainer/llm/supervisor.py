"""The self-healing of a managed vLLM server (trainer/llm/service.py starts and records it): `Supervisor` restarts a
dead or unhealthy server with the same arguments on the same port when the LLM client finds it failing
(bounded, each restart logged); `supervisor(url)` is the one supervisor of a recorded server in this process,
shared by every client of a run. It reaches the service's lifecycle through the module (`service.serve`,
`service.healthy`, ...), so a stand-in patched there is the one it calls."""

from __future__ import annotations

import contextlib
import fcntl
import sys
import threading
import time
from pathlib import Path

from trainer.llm import service
from trainer.llm.service import Log


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Supervisor:
    """Keeps one managed server alive: `heal(seen)` is called by the LLM client when a request to the server
    failed (connection refused, 5xx, timeout). A healthy server is left alone; a dead or unhealthy one is
    stopped (its whole process group) and started again with the same arguments on the same port, at most
    `max_restarts` times, each restart one line on `log` (stderr) and in the server's log file. Callers that
    fail together share one restart: `generation` counts restarts, and a caller that saw generation g before
    its failure finds g + 1 done and simply retries. `info` is updated in place (pid, started_at, restarts),
    and the state file too when the server was recorded."""

    def __init__(
        self,
        info: service.ServiceInfo,
        *,
        lake: str | Path | None = None,
        record: bool = False,
        max_restarts: int = 2,
        wait_s: float = 600.0,
        log: Log = _stderr,
        health_pause_s: float = 5.0,
    ) -> None:
        self.info, self.lake, self.record = info, lake, record
        self.health_pause_s = health_pause_s
        self.max_restarts, self.wait_s, self.log = max_restarts, wait_s, log
        self.generation = 0
        self.history: list[dict] = []  # one entry per restart: why, old/new pid, seconds
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.info.url

    def alive(self, tries: int = 3) -> bool:
        """The process lives and /health answers 200 (asked up to `tries` times, `health_pause_s` apart: a busy
        CPU server may answer late, and a live server must not be restarted for that)."""
        pause_s = self.health_pause_s
        for k in range(tries):
            if not service.pid_alive(self.info.pid):
                return False
            if service.healthy(self.info.url, timeout=10.0):
                return True
            if k + 1 < tries:
                time.sleep(pause_s)
        return False

    @contextlib.contextmanager
    def _across_processes(self):
        """A recorded server is shared by every process of the machine: one restart at a time (flock)."""
        if not self.record:
            yield
            return

        path = service.services_dir() / f"restart-{self.info.port}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def heal(self, seen: int | None = None) -> bool:
        """True when the caller should send its request again: the server was restarted (by this call or
        another since generation `seen`, in this process or another), or it is healthy. False: it is down and
        may not be restarted (bounded, or stopped on purpose: no longer recorded)."""
        with self._lock, self._across_processes():
            if seen is not None and seen < self.generation:
                return True
            if self.record:
                current = service.read_state(self.lake)
                if current is None or current.url != self.info.url:
                    self.log(
                        f"[llm] {self.info.url} is no longer recorded (`creditflow llm stop`): not restarted"
                    )
                    return False
                if current.pid != self.info.pid:  # another process restarted it: use that one
                    self.info.pid, self.info.started_at = current.pid, current.started_at
                    self.info.restarts = current.restarts
                    self.generation += 1
                    return True
            if self.alive():
                return True
            why = (
                "its process exited"
                if not service.pid_alive(self.info.pid)
                else "/health does not answer 200"
            )
            if len(self.history) >= self.max_restarts:
                self.log(
                    f"[llm] {self.info.url} is down ({why}); not restarted: {self.max_restarts} restart(s) "
                    "already (llm.max_restarts)"
                )
                return False
            old = self.info.pid
            t0 = time.time()
            service._kill_group(old, grace_s=5.0)
            try:
                new = service.serve(
                    self.info.model_dir,
                    port=self.info.port,
                    host=self.info.host,
                    venv=Path(self.info.venv),
                    served_name=self.info.model,
                    max_model_len=self.info.max_model_len,
                    extra_args=list(self.info.extra_args),
                    wait_s=self.wait_s,
                    log=lambda _line: None,
                    record=False,
                )
            except RuntimeError as exc:
                self.history.append(
                    {"why": why, "old_pid": old, "new_pid": None, "seconds": time.time() - t0}
                )
                self.log(f"[llm] {self.info.url} is down ({why}); restart failed: {str(exc).splitlines()[0]}")
                return False
            self.generation += 1
            entry = {"why": why, "old_pid": old, "new_pid": new.pid, "seconds": round(time.time() - t0, 1)}
            self.history.append(entry)
            self.info.pid, self.info.started_at, self.info.log = new.pid, new.started_at, new.log
            self.info.restarts += 1
            if self.record:
                service._write_state(self.info, self.lake)
            line = (
                f"[llm] {self.info.url} was down ({why}, pid {old}); restarted as pid {new.pid} in "
                f"{entry['seconds']:.0f}s (restart {len(self.history)} of at most {self.max_restarts})"
            )
            self.log(line)
            with contextlib.suppress(OSError), open(self.info.log, "a") as fh:
                fh.write(line + "\n")
            return True


_SUPERVISORS: dict[str, Supervisor] = {}
_SUPERVISORS_LOCK = threading.Lock()


def supervisor(url: str, max_restarts: int = 2, lake: str | Path | None = None) -> Supervisor | None:
    """The supervisor of the managed server recorded at `url` (`creditflow llm serve`), one per process so
    that every client of a run shares its restarts; None when no managed server is recorded there."""
    with _SUPERVISORS_LOCK:
        sup = _SUPERVISORS.get(url)
        if sup is not None:
            return sup
        info = None
        for lk in (lake, None) if lake else (None,):
            found = service.read_state(lk)
            if found is not None and found.url.rstrip("/") == url.rstrip("/"):
                info = found
                break
        if info is None:
            return None
        sup = _SUPERVISORS[url] = Supervisor(info, lake=lake, record=True, max_restarts=max_restarts)
        return sup


def register_supervisor(sup: Supervisor) -> None:
    """Make `sup` the supervisor of its URL in this process (a server started with `record=False`)."""
    with _SUPERVISORS_LOCK:
        _SUPERVISORS[sup.url] = sup
