"""Whole decode steps with the CPU attention kernel of a commit (its cpu_attention.cpp built under the op namespace
fastllama_old) and of the checkout, in turn many times in one process: two models from one GGUF file, one with a
bf16 cache and one with an int8 cache (random contents), each model and kernel with its own compiled step
(compiled_apart in scripts/benchmark.py; the records before 2026-11-29's last section had one for all); at each
depth, rounds of N steps of each model with each kernel; the median ms a step, and "KV GB/s": the cache bytes a step reads beyond the first depth's over the time it
takes beyond it.

    python benchmarks/results/cpu-avx512-longer-chunks-steps.py REV GGUF DEPTH [DEPTH ...]
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd  # noqa: E402
from benchmark import compiled_apart  # noqa: E402
from fastllama import cpu_decode, decode, generate as gen  # noqa: E402
from fastllama.model import Attention  # noqa: E402

torch.set_grad_enabled(False)
rev, gguf, depths, steps_a_round, rounds = sys.argv[1], sys.argv[2], [int(d) for d in sys.argv[3:]], 8, 9
src = subprocess.run(["git", "show", f"{rev}:fastllama/cpu_attention.cpp"], capture_output=True, text=True, check=True).stdout
old_source = Path(tempfile.mkdtemp()) / "old_attention.cpp"
old_source.write_text(src.replace("(fastllama,", "(fastllama_old,"))
cpp_extension.load("fastllama_old_attention", [str(old_source)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                   is_python_module=False)
torch.library.register_fake("fastllama_old::decode_attention")(
    lambda q, k, v, k_scales, v_scales, mask, scale: q.new_empty(q.shape, dtype=torch.float32))


def old_kernel(q, k, v, k_scales, v_scales, mask, scale):
    return torch.ops.fastllama_old.decode_attention(q, k, v, k_scales, v_scales, mask.to(torch.uint8), scale)


kernels = {rev: old_kernel, "checkout": cpu_decode.decode_attention}
args = bd.model_arguments("").parse_args(["--checkpoint_path", gguf])
steps = {}  # each model and kernel its own compiled step (compiled_apart)
models = {}
for kv in ("bf16", "int8"):
    torch.manual_seed(0)
    models[kv] = bd.load(args)
    models[kv].setup_caches(1, decode.padded_length(max(depths) + steps_a_round, models[kv].config.block_size),
                            kv_cache_dtype=gen.KV_CACHE_DTYPES[kv])
    bd.fill_at_random(models[kv])


def run(model, kernel, depth):
    for module in model.modules():
        if isinstance(module, Attention):
            module.decode_kernel = kernel
    token, length = torch.zeros((1, 1), dtype=torch.long), torch.tensor([[depth]])
    step = steps.setdefault((id(model), kernel), compiled_apart())
    for i in range(steps_a_round):
        step(model, token, length + i, decode.key_positions(model, depth + i + 1))


def position_bytes(model, kv):
    c = model.config
    per_head = c.head_dim * (2 if kv == "bf16" else 1) + (0 if kv == "bf16" else 2)  # int8 levels and a bf16 scale
    return c.n_layer * c.n_local_heads * 2 * per_head


print(f"{gguf}, {torch.get_num_threads()} threads, {rounds} rounds of {steps_a_round} steps of each cache and kernel in "
      f"turn, median ms a step")
ms = {}
for depth in depths:
    for kv, model in models.items():
        for kernel in kernels.values():
            run(model, kernel, depth)  # compiles, the first time
    times = {(kv, k): [] for kv in models for k in kernels}
    for _ in range(rounds):
        for kv, model in models.items():
            for name, kernel in kernels.items():
                t = time.perf_counter()
                run(model, kernel, depth)
                times[kv, name].append((time.perf_counter() - t) / steps_a_round * 1e3)
    for key, t in times.items():
        ms[key, depth] = statistics.median(t)
    print(f"depth {depth}: " + ", ".join(f"{kv} {name} {ms[(kv, name), depth]:.2f} ms" for kv, name in times), flush=True)
for kv, model in models.items():
    for name in kernels:
        gbs = [position_bytes(model, kv) * (d - depths[0]) / ((ms[(kv, name), d] - ms[(kv, name), depths[0]]) * 1e-3) / 1e9
               for d in depths[1:]]
        print(f"{kv} {name}: KV GB/s beyond depth {depths[0]}: " + ", ".join(f"{d} {g:.1f}" for d, g in zip(depths[1:], gbs)))
for kv in models:
    print(f"{kv} {rev} / checkout: " + ", ".join(f"{d} {ms[(kv, rev), d] / ms[(kv, 'checkout'), d]:.3f}x" for d in depths))
