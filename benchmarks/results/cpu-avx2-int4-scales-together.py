"""The packed int4 scales and mins (120 tensors of their own in the bundled model) in one buffer, in the order a step
reads them, against apart: one process, one compiled decode step at depth 16, the module attributes swapped between
the two each round (the same shapes, so the step does not recompile; the same logits checked first), rounds in
alternating order; a round's time the mean of 30 steps, and the medians of the rounds.

    python benchmarks/results/cpu-avx2-int4-scales-together.py CHECKPOINT [rounds]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo's modules, installed or not
from fastllama import decode, generate  # noqa: E402

torch.set_grad_enabled(False)
model = generate.load_model(sys.argv[1], "cpu")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
model.setup_caches(1, 64)
step = generate.compiled_steps().decode_one_token
tok, pos, keys = torch.zeros((1, 1), dtype=torch.long), torch.tensor([[16]]), decode.key_positions(model, 17)

mods = [m for m in model.modules() if hasattr(m, "scales_and_zeros")]
apart = [m.scales_and_zeros for m in mods]
buffer = torch.empty(sum(-(-t.numel() // 32) * 32 for t in apart), dtype=apart[0].dtype)  # each 64-byte aligned
together, start = [], 0
for t in apart:
    together.append(buffer[start:start + t.numel()].view(t.shape).copy_(t))
    start += -(-t.numel() // 32) * 32


def use(tensors):
    for m, t in zip(mods, tensors):
        m.scales_and_zeros = t


def ms(n=30):
    start = time.perf_counter()
    for _ in range(n):
        step(model, tok, pos, keys)
    return (time.perf_counter() - start) / n * 1e3


logits = step(model, tok, pos, keys)[0].clone()
use(together)
assert torch.equal(step(model, tok, pos, keys)[0], logits)
times = {"apart": [], "together": []}
for r in range(rounds):
    for name, tensors in sorted({"apart": apart, "together": together}.items(), reverse=r % 2 == 1):
        use(tensors)
        ms(5)
        times[name].append(ms())
a, b = statistics.median(times["apart"]), statistics.median(times["together"])
print(f"{len(mods)} scales tensors, {rounds} rounds, {torch.get_num_threads()} threads: apart {a:.2f} ms, together "
      f"{b:.2f} ms a step; the median of the rounds' ratios "
      f"{statistics.median(x / y for x, y in zip(times['apart'], times['together'])):.3f}")
