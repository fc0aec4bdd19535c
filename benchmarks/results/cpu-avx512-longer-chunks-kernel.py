"""The CPU attention kernel of a commit (its cpu_attention.cpp built under the op namespace fastllama_old) and of
the checkout, called in turn in one process over a model's layers of caches (bf16 model; a bf16 or an int8 cache
with bf16 scales), one row at each depth, 2 threads: median us a layer, and the cache's bytes over it.

    python benchmarks/results/cpu-avx512-longer-chunks-kernel.py REV bundled,1.7b
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from fastllama import cpu_decode
from fastllama.model import KVCache, attention_mask

torch.set_num_threads(2)
new = cpu_decode.attention_kernel()
src = subprocess.run(["git", "show", f"{sys.argv[1]}:fastllama/cpu_attention.cpp"], capture_output=True, text=True, check=True).stdout
old_source = Path(tempfile.mkdtemp()) / "old_attention.cpp"
old_source.write_text(src.replace("(fastllama,", "(fastllama_old,"))
cpp_extension.load("fastllama_old_attention", [str(old_source)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                   is_python_module=False)
old = torch.ops.fastllama_old.decode_attention
torch.manual_seed(0)
shapes = {"bundled": (30, 3, 3, (16, 256, 2048, 7000)), "1.7b": (24, 32, 1, (16, 1024, 4096))}
for name in sys.argv[2].split(","):
    layers, n_kv, group, depths = shapes[name]
    for store in (torch.bfloat16, torch.int8):
        for S in depths:
            caches = []
            for layer in range(layers):
                c = KVCache(1, S + 32, n_kv, 64, torch.bfloat16, store_dtype=store)
                c.write(torch.arange(S)[None], *(torch.randn(1, S, n_kv, 64, dtype=torch.bfloat16) for _ in "kv"))
                caches.append(c)
            mask = attention_mask(torch.tensor([[S - 1]]), torch.arange(S)[None]).to(torch.uint8)
            q = torch.randn(1, n_kv, group, 64, dtype=torch.bfloat16)
            sc = lambda c: (c.k_scales, c.v_scales) if store == torch.int8 else (None, None)
            ts = {"old": [], "new": []}
            for rep in range(31):
                for which, k in (("old", old), ("new", new)):
                    t = time.perf_counter()
                    for c in caches:
                        k(q, c.k_cache, c.v_cache, *sc(c), mask, 0.125)
                    ts[which].append((time.perf_counter() - t) / layers)
            nbytes = S * n_kv * 2 * 64 * store.itemsize + (S * n_kv * 2 * 2 if store == torch.int8 else 0)
            us = {w: statistics.median(t[1:]) * 1e6 for w, t in ts.items()}
            print(name, str(store).replace("torch.", ""), S,
                  " ".join(f"{w} {u:.1f} us ({nbytes / u / 1e3:.1f} GB/s)" for w, u in us.items()),
                  f"old/new {us['old'] / us['new']:.2f}x", flush=True)
            del caches
