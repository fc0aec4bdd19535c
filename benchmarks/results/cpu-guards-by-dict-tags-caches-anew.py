"""Decode steps at depth 16 through generate.compiled_steps() (dict tags on Python 3.12+), the caches made anew
in turn in bf16 and int8 on one model: each format's step, 15 x 20 steps, median ms. Once the caches' modules are
replaced, the graphs compiled before them check their guards in full from then on (benchmarks/RESULTS.md,
"Dynamo's guards by dict tags on Python 3.12").

    python3.12 benchmarks/results/cpu-guards-by-dict-tags-caches-anew.py CHECKPOINT
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fastllama import decode, generate  # noqa: E402

torch.set_grad_enabled(False)
model = generate.load_model(sys.argv[1], "cpu", "bf16")
steps = generate.compiled_steps()
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, dict tags "
      f"{torch._dynamo.config.use_recursive_dict_tags_for_guards}")


def step_ms(kv):
    model.setup_caches(1, 256, kv_cache_dtype=generate.KV_CACHE_DTYPES[kv])
    token, length, keys = torch.tensor([[1]]), torch.tensor([[16]]), decode.key_positions(model, 17)
    for _ in range(3):
        steps.decode_one_token(model, token, length, keys)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(20):
            steps.decode_one_token(model, token, length, keys)
        times.append((time.perf_counter() - start) / 20 * 1e3)
    return statistics.median(times)


for i, kv in enumerate(["bf16", "bf16", "int8", "bf16", "int8", "bf16"]):
    print(f"{i + 1}. {kv} cache{' (made anew)' if i in (2, 3, 4, 5) else ''}: {step_ms(kv):.2f} ms a step", flush=True)
