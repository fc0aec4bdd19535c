"""An int8 cache against a bf16 one in whole decode steps, the two measured in turn many times in one process
(benchmark_depths.py measures one format's depths, then the other's, minutes apart, on a VM whose speed drifts
by more than the difference): two models from one GGUF file, one with each cache, random cache contents;
at each depth, rounds of N steps of each model in turn; the median ms a step of each, and their ratio.

    python benchmarks/results/cpu-avx512-int8-against-bf16-cache.py GGUF DEPTH [DEPTH ...]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd  # noqa: E402
from fastllama import decode, generate as gen  # noqa: E402

torch.set_grad_enabled(False)
gguf, depths, steps_a_round, rounds = sys.argv[1], [int(d) for d in sys.argv[2:]], 8, 9
args = bd.model_arguments("").parse_args(["--checkpoint_path", gguf])
steps = gen.compiled_steps(dynamic_prefill=True)
models = {}
for kv in ("bf16", "int8"):
    torch.manual_seed(0)
    models[kv] = bd.load(args)
    models[kv].setup_caches(1, decode.padded_length(max(depths) + steps_a_round, models[kv].config.block_size),
                            kv_cache_dtype=gen.KV_CACHE_DTYPES[kv])
    bd.fill_at_random(models[kv])


def run(model, depth):
    token, length = torch.zeros((1, 1), dtype=torch.long), torch.tensor([[depth]])
    for i in range(steps_a_round):
        steps.decode_one_token(model, token, length + i, decode.key_positions(model, depth + i + 1))


print(f"{gguf}, 2 threads, {rounds} rounds of {steps_a_round} steps of each cache in turn, median ms a step")
for depth in depths:
    for model in models.values():
        run(model, depth)  # compiles, the first time
    ms = {kv: [] for kv in models}
    for _ in range(rounds):
        for kv, model in models.items():
            t = time.perf_counter()
            run(model, depth)
            ms[kv].append((time.perf_counter() - t) / steps_a_round * 1e3)
    bf16, int8 = (statistics.median(ms[kv]) for kv in ("bf16", "int8"))
    print(f"depth {depth}: bf16 {bf16:.2f} ms, int8 {int8:.2f} ms, bf16 / int8 {bf16 / int8:.3f}x "
          f"(rounds: bf16 {' '.join(f'{x:.1f}' for x in ms['bf16'])}; int8 {' '.join(f'{x:.1f}' for x in ms['int8'])})",
          flush=True)
