"""Whole steps of an int4 checkpoint with REV's int4 products (its cpu_linear.cpp, under the op namespace
fastllama_old, over its layout of the levels) against the checkout's, in turn in one process: two copies of the
model with the same random cache contents, each with its own compiled decode step (compiled_apart); rounds of 20
decode steps at DEPTH, then of one eager prefill of PROMPT tokens, the order alternating. Prints how far the two
sides' logits part in a prefill, the median ms a step and a prefill of each side and the quartiles of the rounds' ratios.
Written for 2026-12-01's change of the int4 products to integers, whose layout differs from REV's: REV's layout is
made from the checkout's (cpu-int4-integers-products.py's old_layout, whose build this script uses too).

    python benchmarks/results/cpu-int4-integers-steps.py REV CHECKPOINT DEPTH PROMPT [ROUNDS]
"""
import importlib.util
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

spec = importlib.util.spec_from_file_location("products", Path(__file__).with_name("cpu-int4-integers-products.py"))
products = importlib.util.module_from_spec(spec)
spec.loader.exec_module(products)

torch.set_grad_enabled(False)
rev, checkpoint, depth, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 16
products.build("fastllama_old", rev, avx2=False)  # REV's int4_rows as torch.ops.fastllama_old.int4_rows
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
            assert module.kernel == "cpu-tiles", module.kernel
            module.weight.copy_(products.old_layout(module.weight))
            module.kernel = "old"
    model.setup_caches(1, decode.padded_length(max(depth, prompt) + 64, model.config.block_size))
    torch.manual_seed(0)
    fill_at_random(model)
    models[name] = model
steps = {name: compiled_apart() for name in models}
token, length, keys = torch.tensor([[1]]), torch.tensor([[depth]]), decode.key_positions(models[rev], depth + 1)
for name, m in models.items():  # compiled, then warm
    steps[name](m, token, length, keys), steps[name](m, token, length, keys)
text = torch.randint(0, models[rev].config.vocab_size, (1, prompt))
logits = [m(text, torch.arange(prompt)).float() for m in models.values()]  # a prefill's, over the prompt alone
print(f"{checkpoint}, depth {depth}, prompt {prompt}, {torch.get_num_threads()} threads, {rounds} rounds; a prefill's "
      f"logits part by {((logits[0] - logits[1]).abs().max() / logits[0].abs().max()).item():.2e} of the largest; "
      f"the same argmax at {(logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item():.1%} of positions")


def prefill(model):  # eager, as generate.py's prefill without --compile (the cache's contents are random either way)
    model(text, torch.arange(prompt))


times = {(kind, name): [] for kind in ("step", "prefill") for name in models}
for r in range(rounds):
    for name in (list(models) if r % 2 else list(models)[::-1]):
        t = time.perf_counter()
        for _ in range(20):
            steps[name](models[name], token, length, keys)
        times["step", name].append((time.perf_counter() - t) / 20 * 1e3)
        t = time.perf_counter()
        prefill(models[name])
        times["prefill", name].append((time.perf_counter() - t) * 1e3)
for kind in ("step", "prefill"):
    old, new = times[kind, rev], times[kind, "checkout"]
    ratios = sorted(a / b for a, b in zip(old, new))
    print(f"{kind}: {rev} {statistics.median(old):.3f} ms, checkout {statistics.median(new):.3f} ms; {rev} / checkout "
          f"by round, quartiles: {ratios[rounds // 4]:.3f} {ratios[rounds // 2]:.3f} {ratios[3 * rounds // 4]:.3f}")
