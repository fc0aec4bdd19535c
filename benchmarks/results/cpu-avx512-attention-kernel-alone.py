"""The CPU attention kernel of a commit (its cpu_attention.cpp built under the op namespace fastllama_old) against
the checkout's, alone: a layer's call over a cache of 7,168 slots of which the first S are read, for each cache
format; the two in turn, 7 rounds of 300 calls, the median us a call and the cache bytes read a second. With
LAYERS, the calls go over that many caches in turn, as a step's layers do, so that each comes from memory once
they outgrow the CPU's caches; without, one cache, hot after the first calls.

    python benchmarks/results/cpu-avx512-attention-kernel-alone.py REV S KV_HEADS,ROWS,HEAD_DIM [bf16,int8] [LAYERS]
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo's modules, installed or not
from fastllama import cpu_decode  # noqa: E402

rev, S, (H, R, hd) = sys.argv[1], int(sys.argv[2]), map(int, sys.argv[3].split(","))
formats = sys.argv[4].split(",") if len(sys.argv) > 4 else ["bf16", "int8"]
layers = int(sys.argv[5]) if len(sys.argv) > 5 else 1
src = subprocess.run(["git", "show", f"{rev}:fastllama/cpu_attention.cpp"], capture_output=True, text=True, check=True).stdout
old_source = Path(tempfile.mkdtemp()) / "old_attention.cpp"
old_source.write_text(src.replace("(fastllama,", "(fastllama_old,"))
header = subprocess.run(["git", "show", f"{rev}:fastllama/cpu_vectors.h"], capture_output=True, text=True)
if header.returncode == 0:  # the vector operations the kernel includes, from the same commit
    old_source.with_name("cpu_vectors.h").write_text(header.stdout)
cpp_extension.load("fastllama_old_attention", [str(old_source)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                   is_python_module=False)
kernels = {rev: torch.ops.fastllama_old.decode_attention, "checkout": cpu_decode.attention_kernel()}

torch.manual_seed(0)
slots = 7168
q = torch.randn(1, H, R, hd).bfloat16()  # a bf16 model's q
mask = torch.ones(1, 1, 1, S, dtype=torch.uint8)
print(f"{torch.get_num_threads()} threads, {H} key/value heads of {R} rows, head_dim {hd}, {S} positions read, "
      f"{layers} cache{'s in turn' if layers > 1 else ''}")
for name in formats:
    caches = []
    for _ in range(layers):
        if name == "bf16":
            caches.append([*(torch.randn(1, H, slots, hd).bfloat16() for _ in "kv"), None, None])
        else:
            caches.append([*(torch.randint(-127, 128, (1, H, slots, hd), dtype=torch.int8) for _ in "kv"),
                           *(torch.rand(1, H, slots, 1).bfloat16() * 0.01 for _ in "kv")])
    us = {n: [] for n in kernels}
    for _ in range(7):
        for n, op in kernels.items():
            for i in range(50):
                op(q, *caches[i % layers], mask, 0.125)
            start = time.perf_counter()
            for i in range(300):
                op(q, *caches[i % layers], mask, 0.125)
            us[n].append((time.perf_counter() - start) / 300 * 1e6)
    a, b = (kernels[n](q, *caches[0], mask, 0.125) for n in kernels)
    med = {n: statistics.median(x) for n, x in us.items()}
    read = sum(x[:, :, :S].nbytes for x in caches[0] if x is not None)
    print(f"{name} cache: {rev} {med[rev]:.1f} us, checkout {med['checkout']:.1f} us, {med[rev] / med['checkout']:.3f}x "
          f"({read / med['checkout'] / 1e3:.1f} GB/s); largest difference in the outputs {(a - b).abs().max().item():.1e}")
