"""The int4 products of a SmolLM2-135M-shaped model's 30 layers (120 linears, random Q4 levels, groups of 32,
bf16 scales) for M rows: PyTorch's CPU kernel (quantize kernel "cpu") against cpu_int4.cpp's ("cpu-avx512"),
each linear called once a pass, so that the weights come from memory (about 69 MB; a pass over 4 linears
repeated would time the L3 cache). Interleaved, median of 21 passes each.

    python benchmarks/results/cpu-avx512-int4-products.py [rows ...]
"""
import sys
import time

import torch

from fastllama import cpu_decode
from fastllama import quantize as Q

assert cpu_decode.int4_kernel() is not None, "needs AVX-512 BF16 and a C++ compiler"
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in): wqkv, wo, w13, w2


def build(kernel: str) -> list[Q.Int4Linear]:
    mods = []
    for n, k in shapes:
        m = Q.Int4Linear(k, n, 32)
        m.weight.random_(0, 256)
        m.scales.copy_(torch.rand(m.scales.shape) / 64)
        m.mins.copy_(-8 * m.scales)
        m.pack(kernel)
        mods.append(m)
    return mods


def one_pass(mods, x, kernel: str) -> float:
    t = time.perf_counter()
    for m in mods:
        Q.int4_matmul(kernel, x[m.in_features], m.weight, 32, m.scales_and_zeros)
    return time.perf_counter() - t


theirs, ours = build("cpu"), build("cpu-avx512")
ours_bytes = sum(m.weight.nbytes + m.scales_and_zeros.nbytes for m in ours)
print(f"threads {torch.get_num_threads()}, ours reads {ours_bytes / 1e6:.1f} MB a pass")
for M in [int(v) for v in sys.argv[1:]] or [1, 2, 4, 6, 64, 512]:
    x = {k: torch.randn(M, k, dtype=torch.bfloat16) for _, k in shapes[:4]}
    a, b = [], []
    for _ in range(21):
        a.append(one_pass(theirs, x, "cpu"))
        b.append(one_pass(ours, x, "cpu-avx512"))
    a, b = sorted(a)[10] * 1e3, sorted(b)[10] * 1e3
    print(f"rows {M:4}: PyTorch's {a:8.2f} ms, ours {b:8.2f} ms, {a / b:.2f}x; ours {ours_bytes / b / 1e6:5.1f} GB/s")
