"""Where a one-row step's int4 products spend their time: the kernel, or the calls. Every int4 linear of a checkpoint
(the bundled model's: 120), one row, in four forms, in turn (rounds; medians, and the median of the rounds' ratios of
each form to the one before):

- called from Python one at a time, as the wrapper of a compiled step calls them (torch.ops.fastllama.int4_rows);
- the same kernel called for all of them from one C++ loop (no Python between the products);
- a plain sum of the same bytes (levels and scales: two tensors a linear) from one C++ loop, each tensor split
  between the threads as the kernel splits a product;
- a plain sum of one buffer holding those bytes.

The kernel's loop is built here from the working tree's cpu_linear.cpp, with the loop added, under an op namespace
of its own (cpu-int4-integers-products.py's build); the plain sums are cpu-read-bandwidth.py's.

    python benchmarks/results/cpu-avx2-int4-calls.py CHECKPOINT [rounds]
"""
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root))  # the repo's modules, installed or not
from fastllama import generate  # noqa: E402

spec = importlib.util.spec_from_file_location("read_bandwidth", Path(__file__).with_name("cpu-read-bandwidth.py"))
read_bandwidth = importlib.util.module_from_spec(spec)
spec.loader.exec_module(read_bandwidth)
read_sum = read_bandwidth.build()

torch.set_grad_enabled(False)
checkpoint = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
model = generate.load_model(checkpoint, "cpu")  # builds the working tree's kernels (torch.ops.fastllama)
linears = [m for m in model.modules() if getattr(m, "kernel", None) == "cpu-tiles" and hasattr(m, "scales_and_zeros")]

spec = importlib.util.spec_from_file_location("products", Path(__file__).with_name("cpu-int4-integers-products.py"))
products = importlib.util.module_from_spec(spec)
spec.loader.exec_module(products)
int4_each = products.build("fastllama_calls_kernel", None, avx2=False)  # the working tree's, with the loop

ws, sms = [m.weight for m in linears], [m.scales_and_zeros for m in linears]
pieces = [t.contiguous().view(torch.uint8).reshape(-1) for m in linears for t in (m.weight, m.scales_and_zeros)]
one = torch.cat(pieces)
x = torch.randn(1, max(m.in_features for m in linears), dtype=torch.bfloat16)
xs = {m.in_features: x[:, :m.in_features].contiguous() for m in linears}
op = torch.ops.fastllama.int4_rows
assert torch.equal(int4_each(x, ws[-1:], sms[-1:]), op(xs[linears[-1].in_features], ws[-1], sms[-1]))
forms = {
    "int4 products, a call each from Python": lambda: [op(xs[m.in_features], m.weight, m.scales_and_zeros)
                                                       for m in linears],
    "int4 products, one C++ loop": lambda: int4_each(x, ws, sms),
    f"plain sum of the same {len(pieces)} tensors, one C++ loop": lambda: read_sum(pieces),
    "plain sum of one buffer of those bytes": lambda: read_sum([one]),
}


def ms(f, passes=5):
    f()
    start = time.perf_counter()
    for _ in range(passes):
        f()
    return (time.perf_counter() - start) / passes * 1e3


times = {name: [] for name in forms}
for _ in range(rounds):
    for name, f in forms.items():
        times[name].append(ms(f))
print(f"{len(linears)} int4 linears, {one.numel() / 1e6:.1f} MB of levels and scales; one row; "
      f"{torch.get_num_threads()} threads, {rounds} rounds")
names = list(times)
for i, name in enumerate(names):
    t = times[name]
    line = (f"{name}: {statistics.median(t):.2f} ms ({one.numel() / statistics.median(t) / 1e6:.1f} GB/s; "
            f"{min(t):.2f}-{max(t):.2f})")
    if i:  # the rounds' own ratios: the machine's spells fall on both forms of a round
        ratio = statistics.median(a / b for a, b in zip(times[names[i - 1]], t))
        line += f"; the form above takes {ratio:.2f}x its time"
    print(line)
