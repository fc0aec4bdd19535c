"""Whole decode steps of an int4 checkpoint with REV's int4 products against the checkout's, in turn many times in
one process: two copies of the model with the same random cache contents, one whose int4 linears call REV's
cpu_linear.cpp (built under the op namespace fastllama_old), each with its own compiled step (compiled_apart in
scripts/benchmark.py; the records before 2026-11-29's last section had one for both); rounds of 20
steps of each, the order alternating; the median ms a step and the quartiles of the rounds' ratios.

    python benchmarks/results/cpu-avx512-int4-fetch-ahead-steps.py REV CHECKPOINT DEPTH

It runs as of 0663d64, before the int4 kernel took the name cpu-tiles (850b2d0) and its layout changed (2026-12-01);
cpu-int4-integers-steps.py is the same comparison for the layout since.
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
from benchmark import compiled_apart  # noqa: E402
from benchmark_depths import fill_at_random  # noqa: E402
from fastllama import decode, quantize  # noqa: E402
from fastllama.generate import load_model  # noqa: E402

torch.set_grad_enabled(False)
rev, checkpoint, depth, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), 24
src = subprocess.run(["git", "show", f"{rev}:fastllama/cpu_linear.cpp"], capture_output=True, text=True, check=True).stdout
old_source = tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False)
old_source.write(src.replace("(fastllama,", "(fastllama_old,"))
old_source.close()
cpp_extension.load("fastllama_old_linear", [old_source.name], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                   is_python_module=False)
torch.library.register_fake("fastllama_old::int4_rows")(
    lambda x, w, sm: x.new_empty(x.shape[0], w.shape[0] * 16, dtype=torch.float32))

checkout_matmul = quantize.int4_matmul


def int4_matmul(kernel, x, weight, groupsize, scales_and_zeros):
    if kernel == "old":
        return torch.ops.fastllama_old.int4_rows(x.bfloat16(), weight, scales_and_zeros)
    return checkout_matmul(kernel, x, weight, groupsize, scales_and_zeros)


quantize.int4_matmul = int4_matmul


models = {}
for name in (rev, "checkout"):
    model = load_model(checkpoint, "cpu", "bf16")
    for module in model.modules():
        if name == rev and isinstance(module, quantize.Int4Linear):
            assert module.kernel == "cpu-avx512", module.kernel
            module.kernel = "old"
    model.setup_caches(1, decode.padded_length(depth + 64, model.config.block_size))
    torch.manual_seed(0)
    fill_at_random(model)
    models[name] = model
steps = {name: compiled_apart() for name in models}  # each its own graphs (compiled_apart)
token, length, keys = torch.tensor([[1]]), torch.tensor([[depth]]), decode.key_positions(models[rev], depth + 1)
outs = [steps[name](m, token, length, keys) for name, m in models.items()]
outs = [steps[name](m, token, length, keys) for name, m in models.items()]
print(f"{checkpoint}, depth {depth}, {torch.get_num_threads()} threads; the same outputs: "
      f"{all(torch.equal(a, b) for a, b in zip(*outs))}")
times = {name: [] for name in models}
for r in range(rounds):
    for name in (list(models) if r % 2 else list(models)[::-1]):
        t = time.perf_counter()
        for _ in range(20):
            steps[name](models[name], token, length, keys)
        times[name].append((time.perf_counter() - t) / 20 * 1e3)
ratios = sorted(a / b for a, b in zip(times[rev], times["checkout"]))
print(f"{rev} {statistics.median(times[rev]):.3f} ms, checkout {statistics.median(times['checkout']):.3f} ms a step; "
      f"{rev} / checkout by round, quartiles: {ratios[rounds // 4]:.3f} {ratios[rounds // 2]:.3f} {ratios[3 * rounds // 4]:.3f}")
