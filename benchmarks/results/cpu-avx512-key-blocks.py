"""A server's compiled steps with the cache's keys read in blocks of 32 and of 256 positions, interleaved in
one process (decode.CPU_KV_BLOCK set before each step; the length is symbolic, so both run one graph):
8 decode rows at positions 60 and 100, the same carrying a joining prompt's first and last chunk of 8
positions (a prompt of 36), and one row. Median ms of `runs` steps each (argument, default 20).

    python benchmarks/results/cpu-avx512-key-blocks.py [runs]
"""
import statistics
import sys
import time

import torch

from fastllama import decode, serve
from fastllama.generate import busy_cores, compiled_steps, cpu_clock, find_checkpoint, fit_threads, load_model

runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
checkpoint = find_checkpoint(None)
model = load_model(checkpoint, "cpu", "bf16", 0, 1)
fit_threads(busy_cores(cpu_clock()))
engine = serve.Engine(model, 8, 8192, compiled_steps(dynamic_prefill=True), kv_cache_dtype=torch.bfloat16)
chunks = serve.join_chunks(list(range(1, 37)), 8)
cases = [("plain", 8, 60, None), ("plain", 8, 100, None), ("joined, first chunk", 8, 60, chunks[0]),
         ("joined, last chunk", 8, 60, chunks[-1]), ("plain", 1, 60, None)]
blocks = (32, 256)
times = {}
with torch.no_grad():
    for rep in range(runs + 1):  # the first round compiles, untimed
        for case in cases:
            name, rows, position, chunk = case
            for block in blocks:
                decode.CPU_KV_BLOCK = block
                start = time.perf_counter()
                engine.step([1] * rows, [position] * rows, chunk)
                if rep:
                    times.setdefault(case[:3], {}).setdefault(block, []).append(time.perf_counter() - start)
print(f"{'step':<22} {'rows':>4} {'position':>8} " + " ".join(f"{f'block {b} ms':>13}" for b in blocks) + "  ratio")
for (name, rows, position), by_block in times.items():
    ms = [1e3 * statistics.median(by_block[b]) for b in blocks]
    print(f"{name:<22} {rows:>4} {position:>8} " + " ".join(f"{m:>13.2f}" for m in ms) + f"  {ms[1] / ms[0]:.2f}x")
