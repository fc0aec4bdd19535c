"""Whole decode steps over an int8 cache whose keys lie in rows against one whose keys lie in blocks (KVCache's
key_blocks, which the CPU attention kernel reads without sums across lanes), in turn many times in one process:
two models from one GGUF file, random cache contents; at each depth, rounds of 8 steps of each; the median ms a
step, and "KV GB/s": the cache bytes a step reads beyond the first depth's over the time it takes beyond it.

    python benchmarks/results/cpu-avx512-int8-key-blocks-steps.py GGUF DEPTH [DEPTH ...]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd  # noqa: E402
from fastllama import decode, generate as gen  # noqa: E402
from fastllama.model import Attention  # noqa: E402

torch.set_grad_enabled(False)
gguf, depths, steps_a_round, rounds = sys.argv[1], [int(d) for d in sys.argv[2:]], 8, 9
args = bd.model_arguments("").parse_args(["--checkpoint_path", gguf])
steps = gen.compiled_steps(dynamic_prefill=True)
models = {}
for layout in ("rows", "blocks"):
    torch.manual_seed(0)
    models[layout] = bd.load(args)
    for module in models[layout].modules():
        if isinstance(module, Attention):
            module.key_blocks = layout == "blocks"
    models[layout].setup_caches(1, decode.padded_length(max(depths) + steps_a_round, models[layout].config.block_size),
                                kv_cache_dtype=torch.int8)
    assert models[layout].layers[0].attention.kv_cache.k_cache.dim() == (6 if layout == "blocks" else 4)
    bd.fill_at_random(models[layout])


def run(model, depth):
    token, length = torch.zeros((1, 1), dtype=torch.long), torch.tensor([[depth]])
    for i in range(steps_a_round):
        steps.decode_one_token(model, token, length + i, decode.key_positions(model, depth + i + 1))


c = models["rows"].config
position_bytes = c.n_layer * c.n_local_heads * 2 * (c.head_dim + 2)  # int8 levels and a bf16 scale, keys and values
print(f"{gguf}, {torch.get_num_threads()} threads, {rounds} rounds of {steps_a_round} steps of each layout in turn, "
      f"median ms a step")
ms = {}
for depth in depths:
    for model in models.values():
        run(model, depth)  # compiles, the first time
    times = {layout: [] for layout in models}
    for r in range(rounds):
        for layout, model in (models.items() if r % 2 == 0 else reversed(models.items())):
            t = time.perf_counter()
            run(model, depth)
            times[layout].append((time.perf_counter() - t) / steps_a_round * 1e3)
    for layout, t in times.items():
        ms[layout, depth] = statistics.median(t)
    print(f"depth {depth}: " + ", ".join(f"keys in {layout} {ms[layout, depth]:.2f} ms" for layout in models), flush=True)
for layout in models:
    gbs = [position_bytes * (d - depths[0]) / ((ms[layout, d] - ms[layout, depths[0]]) * 1e-3) / 1e9 for d in depths[1:]]
    print(f"keys in {layout}: KV GB/s beyond depth {depths[0]}: " + ", ".join(f"{d} {g:.1f}" for d, g in zip(depths[1:], gbs)))
print("rows / blocks: " + ", ".join(f"{d} {ms['rows', d] / ms['blocks', d]:.3f}x" for d in depths))
