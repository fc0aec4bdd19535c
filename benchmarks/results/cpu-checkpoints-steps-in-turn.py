"""Two or more checkpoints' compiled decode steps (batch 1, bf16 cache, one depth) taken in turn, ROUNDS times, so
that this VM's swings fall on each alike: each checkpoint's median ms a step, and its ratio to the first's (the median
of the rounds' ratios, with their quartiles), beside the weight bytes a step reads (benchmark_depths.py's count).

    python benchmarks/results/cpu-checkpoints-steps-in-turn.py CHECKPOINT CHECKPOINT [...] [--depth 16] [--rounds 200]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd  # noqa: E402
from benchmark import compiled_apart  # noqa: E402
from fastllama import decode  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("checkpoints", nargs="+")
parser.add_argument("--depth", type=int, default=16)
parser.add_argument("--rounds", type=int, default=200)
cli = parser.parse_args()
torch.set_grad_enabled(False)
models, steps = [], []
for path in cli.checkpoints:
    torch.manual_seed(0)
    model = bd.load(bd.model_arguments("").parse_args(["--checkpoint_path", path]))
    model.setup_caches(1, decode.padded_length(cli.depth + 1, model.config.block_size), kv_cache_dtype=torch.bfloat16)
    bd.fill_at_random(model)
    models.append(model)
    steps.append(compiled_apart())
token = torch.zeros((1, 1), dtype=torch.long)


def timed(i):
    start = time.perf_counter()
    steps[i](models[i], token, torch.tensor([[cli.depth]]), decode.key_positions(models[i], cli.depth + 1))
    return (time.perf_counter() - start) * 1e3


for i in range(len(models)):
    for _ in range(8):  # compiles the first time; then warm
        timed(i)
times = [[] for _ in models]
for r in range(cli.rounds):
    for i in (range(len(models)) if r % 2 == 0 else reversed(range(len(models)))):
        times[i].append(timed(i))
print(f"{torch.get_num_threads()} threads, depth {cli.depth}, {cli.rounds} rounds of a step each in turn", flush=True)
for path, model, t in zip(cli.checkpoints, models, times):
    ratios = statistics.quantiles([a / b for a, b in zip(t, times[0])], n=4)
    print(f"{path}: {statistics.median(t):.2f} ms a step, {bd.bytes_read_per_step(model, cli.depth, 1) / 1e6:.0f} MB "
          f"read; over the first's {statistics.median(a / b for a, b in zip(t, times[0])):.3f} (quartiles "
          f"{ratios[0]:.3f}-{ratios[2]:.3f})", flush=True)
