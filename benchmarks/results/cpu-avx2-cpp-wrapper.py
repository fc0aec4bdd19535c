"""Inductor's C++ wrapper (cpp_wrapper) against its Python one for the compiled decode step on a CPU: the step
of an int4 checkpoint at depth 16, both forms compiled in one process and timed in turn (rounds of 30 steps,
medians), then each form's first call with an empty inductor cache, in a process of its own. With a third argument
size-asserts-off, the Python wrapper without inductor's size asserts (each custom op's output checked against its
fake) in place of the C++ one, and no first calls.

    python benchmarks/results/cpu-avx2-cpp-wrapper.py CHECKPOINT [rounds] [size-asserts-off]
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo's modules, installed or not
from fastllama import decode, generate  # noqa: E402

torch.set_grad_enabled(False)
FORMS = {"python": {"triton.cudagraphs": True}, "cpp": {"triton.cudagraphs": True, "cpp_wrapper": True},
         "size-asserts-off": {"triton.cudagraphs": True, "size_asserts": False}}


def compiled(form):
    def step(model, token, pos, keys):  # a function of its own a form: dynamo keeps compiled code per function
        return decode.decode_one_token(model, token, pos, keys)
    return torch.compile(step, fullgraph=True, dynamic=False, options=FORMS[form])


def inputs(model):
    model.setup_caches(1, 64)
    return torch.zeros((1, 1), dtype=torch.long), torch.tensor([[16]]), decode.key_positions(model, 17)


if len(sys.argv) > 2 and sys.argv[2] == "--cold":  # a child: one form's first call, its cache empty
    model = generate.load_model(sys.argv[1], "cpu")
    args = inputs(model)
    start = time.perf_counter()
    compiled(sys.argv[3])(model, *args)
    print(f"{sys.argv[3]} wrapper, first call with an empty cache: {time.perf_counter() - start:.1f} s", flush=True)
    sys.exit()

other = sys.argv[3] if len(sys.argv) > 3 else "cpp"
model = generate.load_model(sys.argv[1], "cpu")
args = inputs(model)
steps = {form: compiled(form) for form in ("python", other)}
outs = {form: step(model, *args) for form, step in steps.items()}
assert torch.equal(outs["python"], outs[other])


def ms(step, n=30):
    start = time.perf_counter()
    for _ in range(n):
        step(model, *args)
    return (time.perf_counter() - start) / n * 1e3


times = {form: [] for form in steps}
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 15):
    for form, step in steps.items():
        times[form].append(ms(step))
for form, t in times.items():
    print(f"{form} wrapper: median {statistics.median(t):.3f} ms a step; rounds {[round(x, 2) for x in t]}")
print(f"python / {other}: {statistics.median(times['python']) / statistics.median(times[other]):.3f}x")
ratios = [a / b for a, b in zip(times["python"], times[other])]
print(f"the rounds' own ratios: median {statistics.median(ratios):.3f}x, {other} faster in "
      f"{sum(r > 1 for r in ratios)} of {len(ratios)}")
for form in steps if other == "cpp" else ():
    with tempfile.TemporaryDirectory() as cache:
        subprocess.run([sys.executable, __file__, sys.argv[1], "--cold", form], check=True, stderr=subprocess.DEVNULL,
                       env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
