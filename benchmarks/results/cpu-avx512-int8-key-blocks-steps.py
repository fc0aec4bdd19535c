"""Whole decode steps over an int8 cache whose keys lie in rows against one whose keys lie in blocks (KVCache's
key_blocks, which the CPU attention kernel reads without sums across lanes), in turn many times in one process:
one model from a GGUF file with two caches of random contents, swapped in turn, each with its own compiled step;
at each depth, rounds of 8 steps with each; the median ms a step, and "KV GB/s": the cache bytes a step reads beyond the first depth's over the time
it takes beyond it.

    python benchmarks/results/cpu-avx512-int8-key-blocks-steps.py GGUF DEPTH [DEPTH ...]

It runs at commit 78bd209, whose KVCache takes key_blocks; that layout was reverted after these runs, which found
no difference in whole steps (benchmarks/RESULTS.md, "An int8 cache's keys in blocks, tried").
"""
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd  # noqa: E402
from fastllama import decode, generate as gen  # noqa: E402
from fastllama.model import KVCache  # noqa: E402

torch.set_grad_enabled(False)
gguf, depths, steps_a_round, rounds = sys.argv[1], [int(d) for d in sys.argv[2:]], 8, 9
args = bd.model_arguments("").parse_args(["--checkpoint_path", gguf])


def own_step():
    """decode_one_token compiled as generate.py compiles it, under a code object of its own: dynamo keeps one code
    object's graphs together and tries them in turn, so that with one for both layouts, one would pay for the
    other's guards failing first."""
    f = decode.decode_one_token
    copy = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return gen.copied_out(torch.compile(copy, mode="reduce-overhead", fullgraph=True, dynamic=False))


steps = {"rows": own_step(), "blocks": own_step()}
torch.manual_seed(0)
model = bd.load(args)
model.setup_caches(1, decode.padded_length(max(depths) + steps_a_round, model.config.block_size),
                   kv_cache_dtype=torch.int8)
caches = {}
for layout in ("rows", "blocks"):
    caches[layout] = [KVCache(1, layer.attention.kv_cache.v_cache.shape[2], model.config.n_local_heads,
                              model.config.head_dim, layer.attention.kv_cache.dtype, store_dtype=torch.int8,
                              key_blocks=layout == "blocks") for layer in model.layers]
    for layer, cache in zip(model.layers, caches[layout]):
        layer.attention.kv_cache = cache
    bd.fill_at_random(model)


def run(layout, depth):
    for layer, cache in zip(model.layers, caches[layout]):
        layer.attention.kv_cache = cache
    token, length = torch.zeros((1, 1), dtype=torch.long), torch.tensor([[depth]])
    for i in range(steps_a_round):
        steps[layout](model, token, length + i, decode.key_positions(model, depth + i + 1))


c = model.config
position_bytes = c.n_layer * c.n_local_heads * 2 * (c.head_dim + 2)  # int8 levels and a bf16 scale, keys and values
print(f"{gguf}, {torch.get_num_threads()} threads, {rounds} rounds of {steps_a_round} steps of each layout in turn, "
      f"median ms a step")
ms = {}
for depth in depths:
    for layout in caches:
        run(layout, depth)  # compiles, the first time
    times = {layout: [] for layout in caches}
    for r in range(rounds):
        for layout in (caches if r % 2 == 0 else reversed(caches)):
            t = time.perf_counter()
            run(layout, depth)
            times[layout].append((time.perf_counter() - t) / steps_a_round * 1e3)
    for layout, t in times.items():
        ms[layout, depth] = statistics.median(t)
    print(f"depth {depth}: " + ", ".join(f"keys in {layout} {ms[layout, depth]:.2f} ms" for layout in caches), flush=True)
for layout in caches:
    gbs = [position_bytes * (d - depths[0]) / ((ms[layout, d] - ms[layout, depths[0]]) * 1e-3) / 1e9 for d in depths[1:]]
    print(f"keys in {layout}: KV GB/s beyond depth {depths[0]}: " + ", ".join(f"{d} {g:.1f}" for d, g in zip(depths[1:], gbs)))
print("rows / blocks: " + ", ".join(f"{d} {ms['rows', d] / ms['blocks', d]:.3f}x" for d in depths))
