"""The CPU attention kernel of a commit (its cpu_attention.cpp built under another op namespace, "old") and of
the checkout ("new"), called in turn in one process over a model's layers of caches (bf16 model; a bf16 or an
int8 cache with bf16 scales), one row at each depth: median us a layer, and the cache's bytes over it.

    python benchmarks/results/cpu-avx512-int8-integer-products.py 212ee12 bundled,1.7b
"""
import subprocess, sys, statistics, tempfile, time
import torch
from pathlib import Path
from torch.utils import cpp_extension
from fastllama import cpu_decode
from fastllama.model import KVCache, attention_mask
torch.set_num_threads(2)
new = cpu_decode.attention_kernel()
src = subprocess.run(["git", "show", f"{sys.argv[1]}:fastllama/cpu_attention.cpp"], capture_output=True, text=True, check=True).stdout
old_source = Path(tempfile.mkdtemp()) / "old_attention.cpp"
old_source.write_text(src.replace("TORCH_LIBRARY_FRAGMENT(fastllama,", "TORCH_LIBRARY_FRAGMENT(fastllama_old,").replace("TORCH_LIBRARY_IMPL(fastllama,", "TORCH_LIBRARY_IMPL(fastllama_old,"))
cpp_extension.load("fastllama_old_attention", [str(old_source)], extra_cflags=["-O3", "-march=native", "-fopenmp"], is_python_module=False)
old = torch.ops.fastllama_old.decode_attention
torch.manual_seed(0)
shapes = {"bundled": (30, 3, 3, (512, 2048, 7000)), "1.7b": (24, 32, 1, (1024, 4096))}
stores = [getattr(torch, x) for x in (sys.argv[3] if len(sys.argv) > 3 else "bfloat16,int8").split(",")]
for name in sys.argv[2].split(","):
    layers, n_kv, group, depths = shapes[name]
    for store in stores:
        for S in depths:
            caches = []
            for layer in range(layers):
                c = KVCache(1, S + 32, n_kv, 64, torch.bfloat16, store_dtype=store)
                c.write(torch.arange(S)[None], *(torch.randn(1, S, n_kv, 64, dtype=torch.bfloat16) for _ in "kv"))
                caches.append(c)
            S_read = -(-S // 32) * 32
            mask = attention_mask(torch.tensor([[S - 1]]), torch.arange(S_read)[None])
            q = torch.randn(1, n_kv, group, 64, dtype=torch.bfloat16)
            sc = lambda c: (c.k_scales, c.v_scales) if store.itemsize == 1 else (None, None)
            ts = {"old": [], "new": []}
            for rep in range(31):
                for which, k in (("old", old), ("new", new)):
                    t = time.perf_counter()
                    for c in caches: k(q, c.k_cache, c.v_cache, *sc(c), mask, 0.125)
                    ts[which].append((time.perf_counter() - t) / layers)
            nbytes = S * n_kv * 2 * 64 * store.itemsize + (S * n_kv * 2 * 2 if store.itemsize == 1 else 0)
            us = {w: statistics.median(t[1:]) * 1e6 for w, t in ts.items()}
            print(name, str(store).replace("torch.", ""), S, " ".join(f"{w} {u:.1f} us ({nbytes / u / 1e3:.1f} GB/s)" for w, u in us.items()),
                  f"old/new {us['old'] / us['new']:.2f}x", flush=True)
            del caches
