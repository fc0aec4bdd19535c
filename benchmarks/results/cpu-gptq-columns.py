"""quantize.gptq_int4 of an earlier revision against the working tree's, on the shapes of the bundled model's
four linears a layer (random weights, a Hessian of correlated random inputs, groups of 128 as the tests take
them), the two in turn (rounds; medians, and the median of the rounds' ratios), and how many levels, scales and
mins of the two differ.

    python benchmarks/results/cpu-gptq-columns.py [REV] [rounds]
"""
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root))  # the repo's modules, installed or not
from fastllama import quantize  # noqa: E402

rev, rounds = (sys.argv[1] if len(sys.argv) > 1 else "HEAD"), int(sys.argv[2]) if len(sys.argv) > 2 else 5
with tempfile.TemporaryDirectory() as tmp:  # the earlier quantize.py, its relative imports from this fastllama
    path = Path(tmp) / "quantize.py"
    path.write_text(subprocess.run(["git", "show", f"{rev}:fastllama/quantize.py"], cwd=root, check=True,
                                   capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location("fastllama.earlier_quantize", path)
    earlier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(earlier)
forms = {rev: earlier.gptq_int4, "working tree": quantize.gptq_int4}

torch.manual_seed(0)
shapes = {"wqkv": (960, 640), "wo": (576, 640), "w13": (3072, 640), "w2": (576, 1536)}  # 576 inputs padded to 640
cases = {}
for name, (n, k) in shapes.items():
    x = torch.randn(4096, k) @ torch.randn(k, k) / 16
    cases[name] = torch.randn(n, k), x.T @ x
print(f"{torch.get_num_threads()} threads, {rounds} rounds, groups of 128")
for name, (w, hessian) in cases.items():
    outs = [form(w, hessian, 128) for form in forms.values()]
    differ = sum(int((a != b).sum()) for a, b in zip(*outs))
    times = {label: [] for label in forms}
    for _ in range(rounds):
        for label, form in forms.items():
            start = time.perf_counter()
            form(w, hessian, 128)
            times[label].append(time.perf_counter() - start)
    ratio = statistics.median(a / b for a, b in zip(times[rev], times["working tree"]))
    print(f"{name} {tuple(w.shape)}: {rev} {statistics.median(times[rev]) * 1e3:.0f} ms, working tree "
          f"{statistics.median(times['working tree']) * 1e3:.0f} ms, {ratio:.2f}x; "
          f"{differ} of {sum(o.numel() for o in outs[1])} levels, scales and mins differ")
