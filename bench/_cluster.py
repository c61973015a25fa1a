"""Real clusters on one machine, for tests/test_flows_cluster.py and bench/scale.py (issue 25.5).

`ray_cluster(nodes)`: a Ray head (`ray start --head`) and nodes - 1 more node processes (`ray start --address`),
each its own raylet with its own CPUs and object store, token authentication with a private token (never
~/.ray's), a private --temp-dir, and free ports (never `ray stop`, which stops every Ray on the machine).
`dask_cluster(workers)`: `dask scheduler` and one `dask worker` process per worker. Both yield the address a
`task_runner_address` takes, start the processes with the environment given (a lake's S3 endpoint and
credentials reach the workers that way) and always stop them (SIGTERM to each process group, SIGKILL after a
timeout). `DriverTraffic` counts what crosses the driver: the pickled task and arguments of every task it
submits and the pickled final state (with the result) that comes back."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
START_TIMEOUT_S = float(os.environ.get("CREDITFLOW_CLUSTER_START_TIMEOUT", "240"))


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class Cluster:
    address: str  # what `task_runner_address` takes
    logs: Path  # the folder of its processes' logs (and Ray's session folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextmanager
def _process(args: list[str], log: Path, env: dict[str, str], stop_timeout: float = 60) -> Iterator:
    """A cluster process in its own session (so its children are stopped with it); stopped on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, stop_timeout), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue


def _wait_for(check, what: str, logs: list[Path], procs: list, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        for proc, log in zip(procs, logs, strict=False):
            if proc.poll() is not None:
                raise ClusterError(f"{what}: {proc.args[:3]} exited {proc.returncode}:\n{_tail(log)}")
        time.sleep(0.5)
    raise ClusterError(f"{what}: not ready after {timeout:.0f} s:\n" + "\n".join(_tail(p) for p in logs))


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextmanager
def _driver_env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def ray_cluster(
    nodes: int = 2,
    cpus_per_node: int = 1,
    object_store_mb: int = 80,
    env: dict[str, str] | None = None,
    token: Path | None = None,
) -> Iterator[Cluster]:
    """A Ray cluster of a head and `nodes - 1` node processes; yields its GCS address (`host:port`). The driver
    (this process) gets the cluster's token through RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH while inside; clusters
    that one driver uses in turn share a `token` file."""
    with ExitStack() as stack:
        # Ray may write its token to ~/.ray/auth_token; one left behind turns token authentication on for every
        # later local Ray of this user (a plain `ray.init()` then fails): remove it if this cluster made it
        home_token = Path.home() / ".ray" / "auth_token"
        if not home_token.exists():
            stack.callback(lambda: home_token.unlink(missing_ok=True))
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cfray-", dir="/tmp")))
        if token is None:
            token = work / "token"
            token.write_text(secrets.token_hex(32))
            token.chmod(0o600)
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        penv = _env({**(env or {}), **auth, "RAY_USAGE_STATS_ENABLED": "0"})
        gcs = free_port()
        common = [
            f"--num-cpus={cpus_per_node}",
            f"--object-store-memory={object_store_mb * 2**20}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
            "--block",
        ]
        procs, logs = [], []
        head_log = work / "head.log"
        head = stack.enter_context(
            _process(
                [
                    str(BIN / "ray"),
                    "start",
                    "--head",
                    f"--port={gcs}",
                    f"--temp-dir={work / 'r'}",
                    "--include-dashboard=false",
                    f"--ray-client-server-port={free_port()}",
                    *common,
                ],
                head_log,
                penv,
            )
        )
        procs.append(head)
        logs.append(head_log)
        ready = "will now block forever"
        _wait_for(lambda: ready in head_log.read_text(errors="replace"), "ray head", logs, procs)
        address = f"127.0.0.1:{gcs}"
        for i in range(1, nodes):
            log = work / f"node{i}.log"
            # the nodes are stopped before the head (ExitStack: last in, first out): a node draining on
            # SIGTERM asks the head's GCS, which must still be there
            node = stack.enter_context(
                _process(
                    [str(BIN / "ray"), "start", f"--address={address}", *common[:-1], "--block"],
                    log,
                    penv,
                )
            )
            procs.append(node)
            logs.append(log)
        for log in logs[1:]:
            _wait_for(lambda log=log: ready in log.read_text(errors="replace"), "ray node", logs, procs)
        stack.enter_context(_driver_env(auth))
        yield Cluster(address, work)


@contextmanager
def dask_cluster(
    workers: int = 2, env: dict[str, str] | None = None, memory_limit: str = "1.5GB"
) -> Iterator[Cluster]:
    """`dask scheduler` and `workers` separate `dask worker` processes (one thread each); yields the
    scheduler's address (`tcp://host:port`)."""
    from distributed import Client

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cfdask-", dir="/tmp")))
        penv = _env(env)
        port = free_port()
        address = f"tcp://127.0.0.1:{port}"
        procs, logs = [], []
        log = work / "scheduler.log"
        procs.append(
            stack.enter_context(
                _process(
                    [
                        str(BIN / "dask"),
                        "scheduler",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--no-dashboard",
                    ],
                    log,
                    penv,
                )
            )
        )
        logs.append(log)
        for i in range(workers):
            log = work / f"worker{i}.log"
            procs.append(
                stack.enter_context(
                    _process(
                        [
                            str(BIN / "dask"),
                            "worker",
                            address,
                            "--nthreads=1",
                            "--nworkers=1",
                            f"--name=w{i}",
                            f"--memory-limit={memory_limit}",
                            "--no-dashboard",
                            f"--local-directory={work / f'w{i}'}",
                        ],
                        log,
                        penv,
                    )
                )
            )
            logs.append(log)

        def connected() -> bool:
            try:
                with Client(address, timeout=10) as client:
                    return len(client.scheduler_info(n_workers=-1)["workers"]) >= workers
            except OSError:
                return False

        _wait_for(connected, "dask cluster", logs, procs)
        yield Cluster(address, work)


class DriverTraffic:
    """Bytes that cross the driver per task: the pickled task and arguments it submits (futures of upstream
    tasks count as their id: the runner hands them over inside the cluster) plus the context Prefect sends
    with each, and the pickled final state (the task's result in it) that comes back when the flow reads it.
    Patches the task runner classes' `submit` while inside `with traffic:`."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}  # task run id -> bytes out
        self.received: dict[str, int] = {}  # task run id -> bytes back
        self.context_bytes = 0
        self._undo: list = []

    def __enter__(self) -> DriverTraffic:
        from prefect.task_runners import ThreadPoolTaskRunner

        classes = [ThreadPoolTaskRunner]
        for module, name in (("prefect_ray", "RayTaskRunner"), ("prefect_dask", "DaskTaskRunner")):
            try:
                classes.append(getattr(__import__(module), name))
            except ImportError:
                pass
        for cls in classes:
            original = cls.submit
            self._undo.append((cls, original))
            cls.submit = self._wrap(original)
        return self

    def __exit__(self, *exc) -> None:
        for cls, original in self._undo:
            cls.submit = original
        self._undo.clear()

    def _wrap(self, original):
        traffic = self

        def submit(runner, task, parameters, wait_for=None, dependencies=None):
            sent = traffic.size((task, _without_futures(parameters)))
            if not traffic.context_bytes:
                from prefect.context import serialize_context

                traffic.context_bytes = traffic.size(serialize_context())
            future = original(runner, task, parameters, wait_for, dependencies)
            key = str(future.task_run_id)
            traffic.sent[key] = sent
            read = future.result

            def result(*args, **kwargs):  # the flow reads each result once, inside the run
                try:
                    return read(*args, **kwargs)
                finally:
                    state = getattr(future, "_final_state", None) or future.state
                    traffic.received.setdefault(key, traffic.size(state))

            future.result = result
            return future

        return submit

    @staticmethod
    def size(obj) -> int:
        import cloudpickle

        return len(cloudpickle.dumps(obj))

    def totals(self) -> dict[str, int]:
        per_task = [s + self.context_bytes + self.received.get(k, 0) for k, s in self.sent.items()]
        return {
            "tasks": len(self.sent),
            "results_read": len(self.received),
            "sent_bytes": sum(self.sent.values()) + self.context_bytes * len(self.sent),
            "received_bytes": sum(self.received.values()),
            "max_task_bytes": max(per_task, default=0),
        }

    def overlapping_runs(self) -> int:
        """How many pairs of this run's task runs overlapped in time (from the Prefect API's records): with
        one CPU per node (Ray) or one thread per worker (Dask), two at once ran on two nodes. The API records task
        runs from their events in batches (flushed every second): waits up to 30 s for every run's end."""
        import time

        from prefect import get_client

        deadline = time.monotonic() + 30
        with get_client(sync_client=True) as client:
            while True:
                runs = [client.read_task_run(key) for key in self.sent]
                if all(r.start_time and r.end_time for r in runs) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        spans = sorted((r.start_time, r.end_time) for r in runs if r.start_time and r.end_time)
        return sum(1 for i, a in enumerate(spans) for b in spans[i + 1 :] if b[0] < a[1])


def _without_futures(value):
    from prefect.futures import PrefectFuture

    if isinstance(value, PrefectFuture):
        return str(value.task_run_id)
    if isinstance(value, dict):
        return {k: _without_futures(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_without_futures(v) for v in value)
    return value


@contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """moto's S3 server in its own process (`python -m moto.server`: in a thread of the driver it would wait
    for the GIL the driver's delta-rs calls hold); yields the environment that points a lake at it."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="cfs3-") as work:
        log = Path(work) / "moto.log"
        with _process(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], log, _env({}), 10
        ) as proc:

            def up() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.5).close()
                    return True
                except OSError:
                    return False

            _wait_for(up, "moto S3 server", [log], [proc], timeout=120)
            yield {
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            }


def make_bucket(env: dict[str, str], name: str) -> None:
    import boto3

    boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    ).create_bucket(Bucket=name)
