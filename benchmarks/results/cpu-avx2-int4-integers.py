"""cpu_linear.cpp's int4 products of a commit (built under the op namespace fastllama_old) against the checkout's,
over a SmolLM2-135M-shaped model's 30 layers (120 linears, random levels in groups of 32), for M rows, and each
against the product of the dequantized weight with x (in fp32, and with x rounded as the checkout's AVX2 form
rounds it). Each linear is called once a pass, so that the weights come from memory; the two kernels in turn,
median of 11 passes (3 past 100 rows).

    python benchmarks/results/cpu-avx2-int4-integers.py REV [rows ...]
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo's modules, installed or not
from fastllama import cpu_decode, quantize as Q  # noqa: E402

rev = sys.argv[1]
root = Path(__file__).resolve().parents[2] / "fastllama"
old = Path(tempfile.mkdtemp())
src = subprocess.run(["git", "show", f"{rev}:fastllama/cpu_linear.cpp"], capture_output=True, text=True, check=True).stdout
(old / "cpu_linear.cpp").write_text(src.replace("(fastllama,", "(fastllama_old,"))
(old / "cpu_vectors.h").write_text(subprocess.run(["git", "show", f"{rev}:fastllama/cpu_vectors.h"], capture_output=True,
                                                  text=True, check=True).stdout)
cpp_extension.load("fastllama_old_linear", [str(old / "cpu_linear.cpp")], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                   is_python_module=False)
assert cpu_decode.int4_kernel() is not None, "needs cpu_linear.cpp built (AVX2 or AVX-512 BF16, a C++ compiler)"
kernels = {rev: torch.ops.fastllama_old.int4_rows, "checkout": torch.ops.fastllama.int4_rows}

torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in): wqkv, wo, w13, w2
mods = []
for n, k in shapes:
    m = Q.Int4Linear(k, n, 32)
    m.weight.random_(0, 256)
    m.scales.copy_(torch.rand(m.scales.shape) / 64)
    m.mins.copy_(-8 * m.scales)
    if len(mods) < 4:
        m.reference = Q.dequantize_int4(m.weight, m.scales, m.mins)
    m.pack("cpu-tiles")
    mods.append(m)


def rounded(x):  # x rounded to int8 a block of 32 at a time, as the AVX2 form rounds it
    blocks = x.float().view(x.shape[0], -1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    return (torch.round(blocks * torch.where(largest > 0, torch.tensor(127.0) / largest, 0)) * (largest / 127)).view(x.shape)


def one_pass(op, x) -> float:
    t = time.perf_counter()
    for m in mods:
        op(x[m.in_features], m.weight, m.scales_and_zeros)
    return time.perf_counter() - t


print(f"threads {torch.get_num_threads()}, CPU {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
with torch.no_grad():
    x = torch.randn(8, 576, dtype=torch.bfloat16)
    for m in mods[:4]:
        xm = torch.randn(8, m.in_features, dtype=torch.bfloat16)
        exact, of_rounded = F.linear(xm.float(), m.reference), F.linear(rounded(xm), m.reference)
        for name, op in kernels.items():
            y = op(xm, m.weight, m.scales_and_zeros)
            print(f"{m.out_features}x{m.in_features} {name}: max|y - exact| / max|exact| "
                  f"{((y - exact).abs().max() / exact.abs().max()).item():.1e}, against x rounded "
                  f"{((y - of_rounded).abs().max() / of_rounded.abs().max()).item():.1e}")
    for M in [int(v) for v in sys.argv[2:]] or [1, 2, 4, 8, 16, 64, 256, 512]:
        x = {k: torch.randn(M, k, dtype=torch.bfloat16) for _, k in shapes[:4]}
        ms = {name: [] for name in kernels}
        for _ in range(11 if M <= 100 else 3):
            for name, op in kernels.items():
                ms[name].append(one_pass(op, x) * 1e3)
        a, b = (statistics.median(ms[name]) for name in kernels)
        print(f"rows {M:4}: {rev} {a:8.2f} ms, checkout {b:8.2f} ms, {a / b:.2f}x", flush=True)
