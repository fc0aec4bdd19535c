"""Inductor's size asserts (`size_asserts`: a check of each custom op's output shape and strides against its fake's,
in the Python wrapper) on and off for the compiled decode step on a CPU: the step of an int4 checkpoint at depth 16,
both forms compiled in one process and timed in turn (rounds of 30 steps, medians, and the rounds' own ratios).

    python benchmarks/results/cpu-avx2-size-asserts.py CHECKPOINT [rounds]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo's modules, installed or not
from fastllama import decode, generate  # noqa: E402

torch.set_grad_enabled(False)
FORMS = {"asserts": {}, "no asserts": {"size_asserts": False}}


def compiled(form):
    def step(model, token, pos, keys):  # a function of its own a form: dynamo keeps compiled code per function
        return decode.decode_one_token(model, token, pos, keys)
    return torch.compile(step, fullgraph=True, dynamic=False, options={"triton.cudagraphs": True, **FORMS[form]})


model = generate.load_model(sys.argv[1], "cpu")
model.setup_caches(1, 64)
args = torch.zeros((1, 1), dtype=torch.long), torch.tensor([[16]]), decode.key_positions(model, 17)
steps = {form: compiled(form) for form in FORMS}
outs = [step(model, *args) for step in steps.values()]
assert torch.equal(*outs)


def ms(step, n=30):
    start = time.perf_counter()
    for _ in range(n):
        step(model, *args)
    return (time.perf_counter() - start) / n * 1e3


times = {form: [] for form in FORMS}
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 15):
    for form, step in steps.items():
        times[form].append(ms(step))
for form, t in times.items():
    print(f"{form}: median {statistics.median(t):.3f} ms a step; rounds {[round(x, 2) for x in t]}")
ratios = [a / b for a, b in zip(times["asserts"], times["no asserts"])]
print(f"asserts / no asserts: median of the rounds' ratios {statistics.median(ratios):.3f}x, "
      f"without faster in {sum(r > 1 for r in ratios)} of {len(ratios)}")
