"""Whole decode steps and prefill with Int8Linear's products in cpu_linear.cpp's int8_rows and in the loop compiled code
makes ("cpu-fused", as before), in turn many times in one process: a checkpoint loaded twice, once each way (a bf16
cache, random contents); at each depth, rounds of 8 steps of each, 9 rounds, the median ms a step; then prefill of
random prompts of 35 and 512 positions, 5 rounds, the median ms.

    python benchmarks/results/cpu-avx512-int8-kernel-steps.py CHECKPOINT DEPTH [DEPTH ...]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd  # noqa: E402
from fastllama import cpu_decode, decode, generate as gen  # noqa: E402

torch.set_grad_enabled(False)
checkpoint, depths, steps_a_round, rounds = sys.argv[1], [int(d) for d in sys.argv[2:]], 8, 9
args = bd.model_arguments("").parse_args(["--checkpoint_path", checkpoint])
steps = gen.compiled_steps(dynamic_prefill=True)
models = {}
for name, own in (("compiled loop", False), ("int8_rows", True)):
    cpu_decode.USE_INT8_KERNEL = own  # read when the modules are packed, at load
    torch.manual_seed(0)
    models[name] = bd.load(args)
    kernels = {m.kernel for m in models[name].modules() if type(m).__name__ == "Int8Linear"}
    print(f"{name}: Int8Linear kernels {sorted(kernels)}")
    models[name].setup_caches(1, decode.padded_length(max(depths) + steps_a_round, models[name].config.block_size),
                              kv_cache_dtype=torch.bfloat16)
    bd.fill_at_random(models[name])


def run(model, depth):
    token, length = torch.zeros((1, 1), dtype=torch.long), torch.tensor([[depth]])
    for i in range(steps_a_round):
        steps.decode_one_token(model, token, length + i, decode.key_positions(model, depth + i + 1))


print(f"{checkpoint}, {torch.get_num_threads()} threads, {rounds} rounds of {steps_a_round} steps of each in turn, "
      f"median ms a step")
for depth in depths:
    for model in models.values():
        run(model, depth)  # compiles, the first time
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            t = time.perf_counter()
            run(model, depth)
            times[name].append((time.perf_counter() - t) / steps_a_round * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(f"depth {depth}: " + ", ".join(f"{name} {v:.2f}" for name, v in ms.items())
          + f"; compiled loop / int8_rows {ms['compiled loop'] / ms['int8_rows']:.3f}x", flush=True)
for n in (35, 512):
    prompt = torch.randint(0, 1000, (1, n))
    length = torch.tensor([n])
    for model in models.values():
        decode.prefill(model, prompt, length, steps)  # compiles, the first time
    times = {name: [] for name in models}
    for _ in range(5):
        for name, model in models.items():
            t = time.perf_counter()
            decode.prefill(model, prompt, length, steps)
            times[name].append((time.perf_counter() - t) * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(f"prefill of {n}: " + ", ".join(f"{name} {v:.1f} ms" for name, v in ms.items())
          + f"; compiled loop / int8_rows {ms['compiled loop'] / ms['int8_rows']:.3f}x", flush=True)
