"""Benchmark of the training loop: time per stage (collect, process, export, train) per round.

CPU (default): the tiny-model loop (`model: tiny`, local backend) for --rounds rounds.
GPU (when CUDA is present, or --gpu): additionally
- trainer throughput on a ~0.5B model (--model DIR, a HF checkpoint, e.g. Qwen2.5-0.5B-Instruct; without
  one a 0.5B-sized Llama is built from a config with random weights): tokens/s and MFU of `trainer.train`
  on a synthetic exported batch (MFU = 6 * params * tokens/s / peak bf16 FLOP/s, --peak-tflops, H100/H200 dense
  bf16 ~ 989);
- collect throughput with vLLM (--vllm: the managed server via trainer/llm/service.py on --model) in
  generated tokens/s.

    python bench/trainer.py --rounds 2                      # CPU figures
    python bench/trainer.py --gpu --model /models/qwen0.5b --vllm   # on a lent GPU

Writes bench/results/trainer.md (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_loop(rounds: int, prompts: int, samples: int, max_new: int, env: str, work: Path) -> list[dict]:
    import trainer.loop  # noqa: F401
    import trainer.train  # noqa: F401
    from flows.config import load_config
    from flows.round_loop import run_loop

    cfg = load_config(
        None,
        [
            f"lake={work / 'lake'}",
            "methods=[grpo]",
            "flow.progress=false",
            f"loop.rounds={rounds}",
            f"loop.env={env}",
            f"loop.prompts={prompts}",
            f"loop.samples={samples}",
            f"collect.max_new_tokens={max_new}",
            "train.lr=0.0001",
        ],
    )
    return run_loop(cfg, log=lambda m: print(m, flush=True))


def synthetic_batch(path: Path, n: int, length: int, vocab: int) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=(n, length)).astype(np.int32)
    mask = np.zeros((n, length), np.int8)
    mask[:, length // 4 :] = 1
    adv = rng.normal(size=(n, length)).astype(np.float32) * mask
    t = pa.table(
        {
            "round": pa.array([0] * n, pa.int32()),
            "method": ["grpo"] * n,
            "traj_id": [f"t{i}" for i in range(n)],
            "group_id": [f"g{i // 8}" for i in range(n)],
            "reward": [0.0] * n,
            "input_ids": list(ids),
            "loss_mask": list(mask),
            "old_logprobs": [np.zeros(length, np.float32)] * n,
            "advantages": list(adv),
        }
    )
    pq.write_table(t, path)
    return path


def gpu_trainer(model_dir: str | None, work: Path, peak_tflops: float, seqs: int, length: int) -> dict:
    import torch

    from trainer.train import TrainSettings, train

    if model_dir is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
        model_dir = str(work / "llama-0.5b")
        LlamaForCausalLM(cfg).save_pretrained(model_dir)
    from transformers import AutoConfig

    mc = AutoConfig.from_pretrained(model_dir)
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(mc).parameters())
    batch = synthetic_batch(work / "batch.parquet", seqs, length, mc.vocab_size)
    s = TrainSettings(
        lr=1e-6,
        mini_batch_seqs=16,
        token_budget=16 * length,
        max_seq_len=length,
        device="cuda",
        old_logprobs="batch",
    )
    train(batch, model_dir, work / "warm", s.model_copy(update={"epochs": 1}))  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m = train(batch, model_dir, work / "out", s)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    step_s = sum(m.column("seconds").to_pylist())
    tokens = seqs * length
    tps = tokens / step_s
    return {
        "model": model_dir,
        "params_M": round(n_params / 1e6, 1),
        "sequences": seqs,
        "seq_len": length,
        "train_wall_s": round(dt, 2),
        "optimizer_steps_s": round(step_s, 2),
        "tokens_per_s": round(tps),
        "mfu": round(6 * n_params * tps / (peak_tflops * 1e12), 4),
        "gpu": torch.cuda.get_device_name(0),
    }


def gpu_collect_vllm(model_dir: str, prompts: int, samples: int, max_new: int) -> dict:
    from pipeline.llm.types import LLMSettings
    from trainer.collect import CollectSettings, collect
    from trainer.llm import service

    info = service.serve(model_dir, served_name="policy", record=False, wait_s=900, log=print)
    try:
        ls = LLMSettings(endpoints=[info.url], concurrency=256, timeout_s=600)
        s = CollectSettings(env="search_qa", prompts=prompts, samples=samples, max_new_tokens=max_new)
        res = collect(model_dir, s, 0, backend="vllm", llm_settings=ls)
    finally:
        service.kill(info.pid)
    return {
        k: res.stats[k]
        for k in ("episodes", "turns", "generated_tokens", "generate_s", "gen_tokens_per_s", "seconds")
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--env", default="search_qa")
    ap.add_argument("--gpu", action="store_true", help="run the GPU parts (default: when CUDA is available)")
    ap.add_argument("--model", default=None, help="HF checkpoint (~0.5B) for the GPU trainer / vLLM collect")
    ap.add_argument("--vllm", action="store_true", help="GPU: also measure collect through a vLLM server")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of the GPU")
    ap.add_argument("--train-seqs", type=int, default=64)
    ap.add_argument("--train-len", type=int, default=1024)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "trainer.md"))
    a = ap.parse_args()
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    results: dict = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": __import__("os").cpu_count(),
        "cuda": cuda,
    }
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        work = Path(tmp)
        if not a.skip_cpu:
            t0 = time.perf_counter()
            results["cpu_loop"] = cpu_loop(a.rounds, a.prompts, a.samples, a.max_new, a.env, work / "cpu")
            results["cpu_loop_total_s"] = round(time.perf_counter() - t0, 1)
        if a.gpu or cuda:
            results["gpu_trainer"] = gpu_trainer(a.model, work, a.peak_tflops, a.train_seqs, a.train_len)
            if a.vllm and a.model:
                results["gpu_collect_vllm"] = gpu_collect_vllm(a.model, 64, 8, 256)
    print(json.dumps(results, indent=2))
    write_md(results, Path(a.out), a)


def write_md(res: dict, out: Path, a) -> None:
    lines = [
        "# Trainer loop benchmark",
        "",
        f"`python bench/trainer.py --rounds {a.rounds} --prompts {a.prompts} "
        f"--samples {a.samples} --max-new {a.max_new} --env {a.env}`",
        "",
        f"Machine: {res['machine']}, {res['cpus']} CPUs, CUDA: {res['cuda']}.",
        "",
    ]
    if "cpu_loop" in res:
        lines += [
            "## CPU: tiny-model loop (local backend), seconds per stage",
            "",
            "| round | policy | episodes | gen tokens | gen tok/s | collect | process | export | train | total |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["cpu_loop"]:
            lines.append(
                f"| {r['round']} | {r['policy']} | {r.get('episodes')} | {r.get('generated_tokens')} | "
                f"{r.get('gen_tokens_per_s')} | {r.get('collect_s')} | {r.get('process_s')} | "
                f"{r.get('export_s')} | {r.get('train_s')} | {r.get('total_s')} |"
            )
        lines += [
            "",
            f"Whole run (incl. imports, tiny model build, Prefect start-up): {res['cpu_loop_total_s']} s.",
            "",
        ]
    if "gpu_trainer" in res:
        g = res["gpu_trainer"]
        lines += [
            "## GPU: trainer throughput",
            "",
            "| " + " | ".join(g) + " |",
            "|" + "---|" * len(g),
            "| " + " | ".join(str(v) for v in g.values()) + " |",
            "",
        ]
    if "gpu_collect_vllm" in res:
        g = res["gpu_collect_vllm"]
        lines += [
            "## GPU: collect through vLLM",
            "",
            "| " + " | ".join(g) + " |",
            "|" + "---|" * len(g),
            "| " + " | ".join(str(v) for v in g.values()) + " |",
            "",
        ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
