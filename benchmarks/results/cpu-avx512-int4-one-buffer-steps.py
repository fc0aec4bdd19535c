"""Whole decode steps of an int4 checkpoint whose int4 linears keep their weights and scales in tensors of their own
(as loaded), against a copy whose int4 tensors all lie in one buffer, in the order the step reads them (views into
it): one allocation of tens of MB, in huge pages where THP_MEM_ALLOC_ENABLE=1 (fastllama's default), and one stream.
Same cache contents, each model its own compiled step (compiled_apart), rounds of 20 steps in turn; the median ms
a step and the quartiles of the rounds' ratios. An experiment, not the library's code (benchmarks/RESULTS.md,
"Huge pages for the weights").

    python benchmarks/results/cpu-avx512-int4-one-buffer-steps.py CHECKPOINT DEPTH
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from benchmark import compiled_apart  # noqa: E402
from benchmark_depths import fill_at_random  # noqa: E402
from fastllama import decode, quantize  # noqa: E402
from fastllama.generate import load_model  # noqa: E402
torch.set_grad_enabled(False)
ck, depth, rounds = sys.argv[1], int(sys.argv[2]), 24

def one_buffer(model):
    tensors = [(m, name) for m in model.modules() if isinstance(m, quantize.Int4Linear)
               for name in ("weight", "scales_and_zeros")]
    sizes = [(getattr(m, n).nbytes + 63) // 64 * 64 for m, n in tensors]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    off = 0
    for (m, n), size in zip(tensors, sizes):
        t = getattr(m, n)
        view = buf[off:off + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        setattr(m, n, view)
        off += size
    return buf

models = {}
for name in ("own", "one"):
    m = load_model(ck, "cpu", "bf16")
    if name == "one":
        m._buf = one_buffer(m)
    m.setup_caches(1, decode.padded_length(depth + 64, m.config.block_size))
    torch.manual_seed(0)
    fill_at_random(m)
    models[name] = m
print(next(line.strip() for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")))
steps = {n: compiled_apart() for n in models}
token, length, keys = torch.tensor([[1]]), torch.tensor([[depth]]), decode.key_positions(models["own"], depth + 1)
outs = [[steps[n](m, token, length, keys) for n, m in models.items()] for _ in range(2)][-1]
print("same outputs:", torch.equal(*outs))
times = {n: [] for n in models}
for r in range(rounds):
    for n in (list(models) if r % 2 else list(models)[::-1]):
        t = time.perf_counter()
        for _ in range(20):
            steps[n](models[n], token, length, keys)
        times[n].append((time.perf_counter() - t) / 20 * 1e3)
ratios = sorted(a / b for a, b in zip(times["own"], times["one"]))
print(f"own {statistics.median(times['own']):.3f} ms, one buffer {statistics.median(times['one']):.3f} ms; "
      f"own / one by round, quartiles: {ratios[rounds // 4]:.3f} {ratios[rounds // 2]:.3f} {ratios[3 * rounds // 4]:.3f}")
