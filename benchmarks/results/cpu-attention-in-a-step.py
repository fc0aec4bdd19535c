"""The CPU attention kernel as a decode step meets it, against two bounds: LAYERS caches called in turn, each call
after a read of WEIGHT_MB of other memory (a layer's weights passing through the CPU's caches), timing only the
calls. Beside the checkout's kernel, in turn, ROUNDS times:
- "pure read": the same kernel with each task's scores, softmax and weighing replaced by a plain vector read of
  its positions' keys and values (the same tasks, threads and order): what memory gives this access pattern;
- "hot": the checkout's kernel on one cache, with no read between calls: its arithmetic, the cache in L2 or L3;
- each VARIANT.cpp given (a cpu_attention.cpp to try), built under an op namespace of its own.
Prints the median us a call, the cache bytes over it, and the quartiles of each side's ratio to the checkout's within
a round (this VM's memory bandwidth moves by up to 2x within seconds: only ratios taken close together hold).

    python benchmarks/results/cpu-attention-in-a-step.py S KV_HEADS,ROWS,HEAD_DIM bf16|int8 ROUNDS [VARIANT.cpp ...]
    python benchmarks/results/cpu-attention-in-a-step.py 2048 3,3,64 int8 100   # the bundled model's shape
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

root = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root))
from fastllama import cpu_decode  # noqa: E402

S, (H, R, hd), fmt, rounds = int(sys.argv[1]), map(int, sys.argv[2].split(",")), sys.argv[3], int(sys.argv[4])
layers, weight_mb = int(os.environ.get("LAYERS", 30)), float(os.environ.get("WEIGHT_MB", 2.5))
source = (root / "fastllama" / "cpu_attention.cpp").read_text()
# each task's work after its mask bits (scores, softmax, weighing) replaced by a read of its keys' and values' rows
start = source.index("      for (int64_t r0 = 0; r0 < R; r0 += ROWS) {\n#define SCORE")
end = source.index("    }\n  });\n\n  // each row's chunks merged")
pure_read = source[:start] + """      __m512i x = _mm512_setzero_si512();
      const char* kk = reinterpret_cast<const char*>(keys);
      const char* vv = reinterpret_cast<const char*>(values);
      const int64_t row = k.stride(2) * int64_t(sizeof(Element)), bytes = hd * int64_t(sizeof(Element));
      for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < bytes; b += 64)
          x = _mm512_xor_si512(x, _mm512_xor_si512(_mm512_loadu_si512(kk + i * row + b), _mm512_loadu_si512(vv + i * row + b)));
      maxes[task * R] = float(_mm_cvtsi128_si32(_mm512_castsi512_si128(x)) & 1) - INF;
""" + source[end:]
sources = {"pure read": pure_read, **{Path(p).stem: Path(p).read_text() for p in sys.argv[5:]}}
ops = {"checkout": cpu_decode.attention_kernel()}
for i, (name, text) in enumerate(sources.items()):
    build = Path(tempfile.mkdtemp())
    (build / "attention.cpp").write_text(text.replace("(fastllama,", f"(fastllama_try{i},"))
    shutil.copy(root / "fastllama" / "cpu_vectors.h", build / "cpu_vectors.h")
    cpp_extension.load(f"fastllama_try{i}", [str(build / "attention.cpp")], is_python_module=False,
                       extra_cflags=["-O3", "-march=native", "-fopenmp"])
    ops[name] = getattr(torch.ops, f"fastllama_try{i}").decode_attention
checkout = ops["checkout"]
ops["hot"] = lambda *a: checkout(*a)  # a callable of its own: called on one cache, nothing read between

torch.manual_seed(0)
slots = 7168
q = torch.randn(1, H, R, hd).bfloat16()
mask = torch.ones(1, 1, 1, S, dtype=torch.uint8)
caches = []
for _ in range(layers):
    if fmt == "bf16":
        caches.append([*(torch.randn(1, H, slots, hd).bfloat16() for _ in "kv"), None, None])
    else:
        caches.append([*(torch.randint(-127, 128, (1, H, slots, hd), dtype=torch.int8) for _ in "kv"),
                       *(torch.rand(1, H, slots, 1).bfloat16() * 0.01 for _ in "kv")])
weights = torch.randn(layers, int(weight_mb * 2**20 / 4))
reference = checkout(q, *caches[0], mask, 0.125)
for name, op in ops.items():  # an ablation (a part of the work left out) is timed too, and named here
    if name != "pure read" and not torch.allclose(op(q, *caches[0], mask, 0.125), reference, atol=1e-3):
        print(f"{name}: not the checkout's outputs")


def a_call(op):  # us, the median of 5 passes over the layers
    hot, passes = op is ops["hot"], []
    for _ in range(5):
        total = 0.0
        for layer in range(layers):
            if not hot:
                weights[layer].max()
            start = time.perf_counter()
            op(q, *caches[0 if hot else layer], mask, 0.125)
            total += time.perf_counter() - start
        passes.append(total / layers * 1e6)
    return statistics.median(passes)


us = {name: [] for name in ops}
for op in ops.values():
    a_call(op)
for i in range(rounds):  # in turn, every other round backwards
    for name, op in (list(ops.items()) if i % 2 == 0 else list(ops.items())[::-1]):
        us[name].append(a_call(op))
read = sum(x[:, :, :S].nbytes for x in caches[0] if x is not None)
print(f"{torch.get_num_threads()} threads, {H} key/value heads of {R} rows, head_dim {hd}, {fmt} cache, {S} positions "
      f"read, {layers} caches, {weight_mb} MB read before each call; {rounds} rounds")
for name, x in us.items():
    ratios = sorted(a / b for a, b in zip(us["checkout"], x))
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    print(f"{name:12} {statistics.median(x):7.1f} us a call  {read / statistics.median(x) / 1e3:5.1f} GB/s  checkout's "
          f"time over this one, quartiles of the rounds: {q1:.3f} {q2:.3f} {q3:.3f}")
