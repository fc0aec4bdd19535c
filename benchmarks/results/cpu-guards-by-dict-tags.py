"""Whole decode steps at depth 16, dynamo's guards checked as by default against by recursive dict tags
(torch._dynamo.config.use_recursive_dict_tags_for_guards, which generate.compiled_steps sets on Python 3.12+): one
model, two compiled steps (scripts/benchmark.py's compiled_apart, each compiled under its setting), ROUNDS rounds
of 20 steps each in turn. Prints each side's median ms a step and the median of the rounds' ratios with their
quartiles (benchmarks/RESULTS.md, "Dynamo's guards by dict tags on Python 3.12").

    python3.12 benchmarks/results/cpu-guards-by-dict-tags.py CHECKPOINT KV_DTYPE ROUNDS
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark import compiled_apart  # noqa: E402
from fastllama import decode, generate  # noqa: E402

torch.set_grad_enabled(False)
checkpoint, kv, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = generate.load_model(checkpoint, "cpu", "bf16")
model.setup_caches(1, 256, kv_cache_dtype=generate.KV_CACHE_DTYPES[kv])
token, length, keys = torch.tensor([[1]]), torch.tensor([[16]]), decode.key_positions(model, 17)
steps = {}
for tags in (False, True):
    steps[tags] = compiled_apart()
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=tags):
        for _ in range(3):
            steps[tags](model, token, length, keys)
times = {False: [], True: []}
for i in range(rounds):
    for tags in (False, True) if i % 2 == 0 else (True, False):
        start = time.perf_counter()
        for _ in range(20):
            steps[tags](model, token, length, keys)
        times[tags].append((time.perf_counter() - start) / 20 * 1e3)
ratios = sorted(a / b for a, b in zip(times[False], times[True]))
q = statistics.quantiles(ratios, n=4)
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, {kv} cache, depth 16, {rounds} rounds: "
      f"default {statistics.median(times[False]):.2f} ms a step, by dict tags {statistics.median(times[True]):.2f}; "
      f"default / by tags {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
