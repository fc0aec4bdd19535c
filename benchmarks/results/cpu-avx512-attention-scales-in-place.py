"""The CPU attention kernel alone over 30 layers' caches of the bundled model's shape (3 key/value heads of 3
query heads, head_dim 64, bf16 model, int8 cache with bf16 scales), one row at depths 2048 and 7000: median
us a layer. Run once per checkout, alternating (the kernel's op has one name: one build a process):

    PYTHONPATH=<checkout before> python benchmarks/results/cpu-avx512-attention-scales-in-place.py before
    python benchmarks/results/cpu-avx512-attention-scales-in-place.py after
"""
import time, statistics, torch, sys
from fastllama import cpu_decode
from fastllama.model import KVCache, attention_mask
torch.set_num_threads(2)
k = cpu_decode.attention_kernel()
torch.manual_seed(0)
out = {}
for store in (torch.int8,):
    for S in (2048, 7000):
        caches = []
        for layer in range(30):
            c = KVCache(1, 8192, 3, 64, torch.bfloat16, store_dtype=store)
            c.write(torch.arange(S)[None], *(torch.randn(1, S, 3, 64, dtype=torch.bfloat16) for _ in "kv"))
            caches.append(c)
        S_read = -(-S // 32) * 32
        mask = attention_mask(torch.tensor([[S - 1]]), torch.arange(S_read)[None])
        q = torch.randn(1, 3, 3, 64, dtype=torch.bfloat16)
        sc = lambda c: (c.k_scales, c.v_scales) if store == torch.int8 else (None, None)
        ts = []
        for rep in range(45):
            t = time.perf_counter()
            for c in caches: k(q, c.k_cache, c.v_cache, *sc(c), mask, 0.125)
            ts.append((time.perf_counter() - t) / 30)
        out[(str(store), S)] = statistics.median(ts[5:]) * 1e6
for key, us in out.items(): print(sys.argv[1], key, f"{us:.1f} us a layer")
