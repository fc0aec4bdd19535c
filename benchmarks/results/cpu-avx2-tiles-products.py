"""cpu_linear.cpp's int4 and int8 products against what a CPU without its kernels runs, over a SmolLM2-135M-shaped
model's 30 layers (120 linears, random levels: int4 in groups of 32), for M rows. Each linear is called once a pass,
so that the weights come from memory; the two kernels of a kind run in turn, median of 11 passes (3 past 100 rows).
int4: PyTorch's _weight_int4pack_mm_for_cpu ("cpu") against ours ("cpu-tiles"). int8: Int8Linear's forward packed
"cpu" (PyTorch's int8 kernel up to cpu_decode.INT8_KERNEL_ROWS rows, then a matmul of the weight converted a block at
a time, in fp32 where bf16 is slow) against "cpu-tiles".

    python benchmarks/results/cpu-avx2-tiles-products.py [rows ...]
"""
import sys
import time

import torch

from fastllama import cpu_decode
from fastllama import quantize as Q

assert cpu_decode.linear_kernels(), "needs cpu_linear.cpp built (AVX2 or AVX-512, a C++ compiler)"
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in): wqkv, wo, w13, w2


def build(cls, kernel: str) -> list:
    mods = []
    for n, k in shapes:
        m = cls(k, n, 32) if cls is Q.Int4Linear else cls(k, n)
        if cls is Q.Int4Linear:
            m.weight.random_(0, 256)
            m.scales.copy_(torch.rand(m.scales.shape) / 64)
            m.mins.copy_(-8 * m.scales)
        else:
            m.weight.random_(-127, 128)
            m.scales.copy_(torch.rand(n) / 64)
        m.pack(kernel)
        mods.append(m)
    return mods


def one_pass(mods, x) -> float:
    t = time.perf_counter()
    for m in mods:
        m(x[m.in_features])
    return time.perf_counter() - t


print(f"threads {torch.get_num_threads()}, CPU {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
for cls in (Q.Int4Linear, Q.Int8Linear):
    theirs, ours = build(cls, "cpu"), build(cls, "cpu-tiles")
    for M in [int(v) for v in sys.argv[1:]] or [1, 2, 4, 8, 16, 64, 256, 512]:
        x = {k: torch.randn(M, k, dtype=torch.bfloat16) for _, k in shapes[:4]}
        a, b = [], []
        with torch.no_grad():
            for _ in range(11 if M <= 100 else 3):
                a.append(one_pass(theirs, x))
                b.append(one_pass(ours, x))
        a, b = sorted(a)[len(a) // 2] * 1e3, sorted(b)[len(b) // 2] * 1e3
        print(f"{cls.__name__:10} rows {M:4}: without ours {a:8.2f} ms, ours {b:8.2f} ms, {a / b:.2f}x", flush=True)
