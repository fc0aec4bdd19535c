"""Whole decode steps of a checkpoint loaded as generate.load_model loads it on CPU (the tensors packing keeps in
one allocation: checkpoint.read_safetensors' `together`) against the same checkpoint with each tensor in an
allocation of its own, as before. Tensors of 2 MB or more lie in huge pages either way (THP_MEM_ALLOC_ENABLE=1,
fastllama's default); the one allocation puts the small ones there too. Same cache contents, each model its own
compiled step (compiled_apart), rounds of 20 steps in turn; the median ms a step and the quartiles of the rounds'
ratios (benchmarks/RESULTS.md, "One allocation for the weights").

    python benchmarks/results/cpu-avx512-one-allocation-steps.py CHECKPOINT DEPTH
"""
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from benchmark import compiled_apart  # noqa: E402
from benchmark_depths import fill_at_random  # noqa: E402
from fastllama import checkpoint, decode, generate  # noqa: E402
torch.set_grad_enabled(False)
ck, depth, rounds = sys.argv[1], int(sys.argv[2]), 24


def each_its_own(*args, together=None, **kwargs):
    return checkpoint.read_safetensors(*args, **kwargs)


def storages(model):
    return len({t.untyped_storage().data_ptr() for t in model.state_dict().values()})


models = {}
for name in ("own", "one"):
    if name == "own":
        with mock.patch.object(generate, "read_safetensors", each_its_own):
            m = generate.load_model(ck, "cpu", "bf16")
    else:
        m = generate.load_model(ck, "cpu", "bf16")
    m.setup_caches(1, decode.padded_length(depth + 64, m.config.block_size))
    torch.manual_seed(0)
    fill_at_random(m)
    models[name] = m
    print(f"{name}: {len(m.state_dict())} tensors in {storages(m)} allocations")
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
print(f"own {statistics.median(times['own']):.3f} ms, one allocation {statistics.median(times['one']):.3f} ms; "
      f"own / one by round, quartiles: {ratios[rounds // 4]:.3f} {ratios[rounds // 2]:.3f} {ratios[3 * rounds // 4]:.3f}")
