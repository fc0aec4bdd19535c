#!/usr/bin/env bash
# The checks for a GPU machine, in one go (a lent GPU has minutes): the CUDA test set, then decoding the
# Llama-3.1-8B shape (random weights) at depths 0, 8k and 32k with each KV cache format (issue 14).
# Each part has its own time limit, and what it printed is kept in $OUT (default: a dated folder under
# benchmarks/results/) even when a limit cuts it short. Usage: bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu-$(date +%Y-%m-%d)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }

stamp environment
{ nvidia-smi; python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  git log -1 --format='commit %H %s' 2>/dev/null; } 2>&1 | tee "$OUT/environment.txt"

stamp CUDA test set
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 100")  # where the plugin is there
timeout "${TESTS_S:-200}" python3 -m pytest -m cuda -q -rs $per_test --durations 0 tests/test_cuda.py 2>&1 \
  | tee "$OUT/cuda-tests.txt"

stamp long context
timeout "${DEPTHS_S:-330}" python3 scripts/benchmark.py --model Llama-3.1-8B --random-weights --device cuda \
  --depths 0 8192 32768 --kv_cache_dtype bf16 int8 fp8 --no-own-cache --max_new_tokens 64 --runs 3 \
  --json "$OUT/llama-3.1-8b-depths.json" 2>&1 | tee "$OUT/llama-3.1-8b-depths.txt"
stamp done
