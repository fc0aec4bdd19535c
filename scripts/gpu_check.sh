#!/usr/bin/env bash
# The checks for a GPU machine, each part sized for one call of a lent GPU (about 9 minutes):
#   bash scripts/gpu_check.sh tests    the CUDA test set (on an H200, 2026-11-26: the first 17 tests took 200 s;
#                                      a third argument picks tests as pytest's -k does: "speculative or ladder")
#   bash scripts/gpu_check.sh depths   Llama-3.1-8B shape (random weights), decode at depths 0, 8k and 32k
#                                      with each KV cache format of $KV (default: bf16; issue 14);
#                                      on an H200 compiling took 105 s for the step and 169 s for prefill,
#                                      and bf16's row over 330 s (prefill timing cut): one format a call (KV=int8)
# Each part stops at its time limit (seconds: the second argument) and keeps what it printed in $OUT
# (default: benchmarks/results/gpu-DATE/), the test names and results as they come.
set -uo pipefail
part=${1:-}
[[ $part == tests || $part == depths ]] || { echo "say which part: tests or depths"; exit 1; }
limit=${2:-540}
OUT=${OUT:-benchmarks/results/gpu-$(date +%Y-%m-%d)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

{ date -u; nvidia-smi; python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/environment.txt"

case $part in
  tests)
    per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 150")  # where the plugin is there
    timeout "$limit" python3 -m pytest -m cuda -v -rs --tb=short $per_test --durations 0 ${3:+-k "$3"} tests/test_cuda.py 2>&1 \
      | grep --line-buffered -v "^DEBUG" | tee "$OUT/cuda-tests.txt" ;;
  depths)
    timeout "$limit" python3 scripts/benchmark.py --model Llama-3.1-8B --random-weights --device cuda \
      --depths 0 8192 32768 --kv_cache_dtype ${KV:-bf16} --no-own-cache --max_new_tokens 64 --runs 3 \
      --json "$OUT/llama-3.1-8b-depths.json" 2>&1 | tee "$OUT/llama-3.1-8b-depths.txt" ;;
esac
date -u
