"""cpu_linear.cpp's int4 products of an earlier revision against the working tree's, at a few counts of rows: every
int4 linear of a checkpoint (the bundled model's: 120, 66 MB), each product once a pass (3 passes, 1 past 64 rows),
the passes of the two forms in turn (rounds; medians, and the median of the rounds' ratios). The earlier form is
built from `git show REV:fastllama/cpu_linear.cpp` under an op namespace of its own, and both must give the same
numbers first.

    python benchmarks/results/cpu-avx2-int4-rows.py CHECKPOINT [REV] [rounds]
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

root = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root))  # the repo's modules, installed or not
from fastllama import generate  # noqa: E402

torch.set_grad_enabled(False)
checkpoint, rev = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "HEAD"
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
model = generate.load_model(checkpoint, "cpu")  # builds the working tree's kernels (torch.ops.fastllama)
linears = [m for m in model.modules() if getattr(m, "kernel", None) == "cpu-tiles" and hasattr(m, "scales_and_zeros")]

with tempfile.TemporaryDirectory() as tmp:
    source = subprocess.run(["git", "show", f"{rev}:fastllama/cpu_linear.cpp"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    source = source.replace("(fastllama, m)", "(fastllama_earlier, m)").replace("(fastllama, CPU, m)",
                                                                              "(fastllama_earlier, CPU, m)")
    (Path(tmp) / "cpu_linear.cpp").write_text(source)
    (Path(tmp) / "cpu_vectors.h").write_text(subprocess.run(
        ["git", "show", f"{rev}:fastllama/cpu_vectors.h"], cwd=root, check=True, capture_output=True, text=True).stdout)
    cpp_extension.load("fastllama_cpu_linear_earlier", [str(Path(tmp) / "cpu_linear.cpp")],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], is_python_module=False, build_directory=tmp)
forms = {rev: torch.ops.fastllama_earlier.int4_rows, "working tree": torch.ops.fastllama.int4_rows}

counts = (1, 2, 4, 8, 64, 512)
for M in (*counts, 3, 5, 7):
    for m in linears:
        x = torch.randn(M, m.in_features, dtype=torch.bfloat16)
        a, b = (op(x, m.weight, m.scales_and_zeros) for op in forms.values())
        assert torch.equal(a, b), (M, m.in_features, m.out_features)
print(f"{len(linears)} int4 linears, {sum(m.weight.numel() + 2 * m.scales_and_zeros.numel() for m in linears) / 1e6:.0f} MB; "
      f"both forms give the same numbers at 1-8 rows; {torch.get_num_threads()} threads, {rounds} rounds")


def ms(op, M):
    passes = 3 if M <= 64 else 1
    xs = {m.in_features: torch.randn(M, m.in_features, dtype=torch.bfloat16) for m in linears}
    for m in linears:
        op(xs[m.in_features], m.weight, m.scales_and_zeros)
    start = time.perf_counter()
    for _ in range(passes):
        for m in linears:
            op(xs[m.in_features], m.weight, m.scales_and_zeros)
    return (time.perf_counter() - start) / passes * 1e3


times = {(name, M): [] for name in forms for M in counts}
for _ in range(rounds):
    for M in counts:
        for name, op in forms.items():
            times[name, M].append(ms(op, M))
for M in counts:
    before, after = times[rev, M], times["working tree", M]
    ratio = statistics.median(a / b for a, b in zip(before, after))
    print(f"{M} rows: {rev} {statistics.median(before):.2f} ms, working tree {statistics.median(after):.2f} ms a pass; "
          f"{ratio:.2f}x (faster in {sum(a > b for a, b in zip(before, after))} of {rounds} rounds)")
