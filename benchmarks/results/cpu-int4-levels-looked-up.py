"""The price of looking int4's 4 bits up in a table of 16 levels (cpu_linear.cpp's int4_rows with `levels`: a GGUF
file's IQ4 weights, copied), at a few counts of rows: every IQ4 linear of a checkpoint, each product once a pass
(3 passes), with the levels and without them (the same bytes read, plain int4's sums), in turn (rounds; medians,
and the median of the rounds' ratios). The same for the AVX2 form, built apart under an op namespace of its own
(x86-64-v3), where this CPU has AVX-512: it runs its vector operations, not an AVX2 machine's memory and caches.

    python benchmarks/results/cpu-int4-levels-looked-up.py CHECKPOINT [rounds]
"""
import statistics
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
checkpoint, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 7
model = generate.load_model(checkpoint, "cpu")  # builds this CPU's form (torch.ops.fastllama)
linears = [m for m in model.modules() if getattr(m, "levels", None) is not None]
assert linears, f"{checkpoint} has no IQ4 linears packed for cpu_linear.cpp"
forms = {"native": torch.ops.fastllama.int4_rows}
if torch.backends.cpu.get_cpu_capability() != "AVX2":
    with tempfile.TemporaryDirectory() as tmp:
        source = (root / "fastllama" / "cpu_linear.cpp").read_text()
        source = source.replace("(fastllama, m)", "(fastllama_avx2, m)").replace("(fastllama, CPU, m)",
                                                                                "(fastllama_avx2, CPU, m)")
        (Path(tmp) / "cpu_linear.cpp").write_text(source)
        (Path(tmp) / "cpu_vectors.h").write_text((root / "fastllama" / "cpu_vectors.h").read_text())
        cpp_extension.load("fastllama_cpu_linear_avx2_bench", [str(Path(tmp) / "cpu_linear.cpp")],
                           extra_cflags=["-O3", "-march=x86-64-v3", "-fopenmp"], is_python_module=False,
                           build_directory=tmp)
    forms["AVX2 form"] = torch.ops.fastllama_avx2.int4_rows
print(f"{len(linears)} IQ4 linears, {sum(m.weight.numel() + 2 * m.scales_and_zeros.numel() for m in linears) / 1e6:.0f} "
      f"MB; {torch.get_num_threads()} threads, {rounds} rounds; forms: {', '.join(forms)} "
      f"(this CPU: {torch.backends.cpu.get_cpu_capability()})")


def ms(op, M, looked_up):
    xs = {m.in_features: torch.randn(M, m.in_features, dtype=torch.bfloat16) for m in linears}
    for m in linears:
        op(xs[m.in_features], m.weight, m.scales_and_zeros, m.levels if looked_up else None)
    start = time.perf_counter()
    for _ in range(3):
        for m in linears:
            op(xs[m.in_features], m.weight, m.scales_and_zeros, m.levels if looked_up else None)
    return (time.perf_counter() - start) / 3 * 1e3


counts = (1, 4, 8, 64)
times = {(form, M, looked_up): [] for form in forms for M in counts for looked_up in (False, True)}
for _ in range(rounds):
    for M in counts:
        for form, op in forms.items():
            for looked_up in (False, True):
                times[form, M, looked_up].append(ms(op, M, looked_up))
for form in forms:
    for M in counts:
        plain, looked = times[form, M, False], times[form, M, True]
        ratio = statistics.median(b / a for a, b in zip(plain, looked))
        print(f"{form}, {M} rows: plain {statistics.median(plain):.2f} ms, looked up {statistics.median(looked):.2f} ms "
              f"a pass; looked up / plain {ratio:.3f}")
