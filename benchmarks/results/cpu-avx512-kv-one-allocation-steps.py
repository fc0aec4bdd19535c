"""Ad hoc: whole decode steps with every layer's KV cache in buffers of its own (as setup_caches makes them) against
the layers' caches as rows of one tensor a buffer (keys, values, and an int8 cache's scales), so that a layer's
cache under 2 MB lies in huge pages too. The bundled model's shape, a cache of 7168 positions as benchmark_depths.py
--no-own-cache makes it; depths 16 and 2048 in each process, processes in turn; each prints its median ms at 16 and
2048 and the KV GB/s between them (benchmarks/RESULTS.md, "One allocation for the weights").

    python benchmarks/results/cpu-avx512-kv-one-allocation-steps.py CHECKPOINT KV_DTYPE PAIRS
"""
import statistics
import subprocess
import sys
import time
from pathlib import Path

def side(stacked, ck, kv):
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from benchmark import compiled_apart
    from benchmark_depths import fill_at_random
    from fastllama import decode, generate
    from fastllama.model import KVCache
    torch.set_grad_enabled(False)
    m = generate.load_model(ck, "cpu", "bf16")
    m.setup_caches(1, 7168, kv_cache_dtype=getattr(torch, kv))
    if stacked:
        c0 = m.layers[0].attention.kv_cache
        n, (B, H, L, D) = len(m.layers), c0.k_cache.shape
        whole = KVCache(n * B, L, H, D, c0.dtype, None, c0.k_cache.dtype)
        for i, layer in enumerate(m.layers):
            c = layer.attention.kv_cache
            for name, b in whole.named_buffers():
                setattr(c, name, b[i * B:(i + 1) * B])
    torch.manual_seed(0); fill_at_random(m)
    out = []
    for depth in (16, 2048):
        step = compiled_apart()
        token, length, keys = torch.tensor([[1]]), torch.tensor([[depth]]), decode.key_positions(m, depth + 1)
        for _ in range(3): step(m, token, length, keys)
        times = []
        for _ in range(15):
            t = time.perf_counter()
            for _ in range(20): step(m, token, length, keys)
            times.append((time.perf_counter() - t) / 20 * 1e3)
        out.append(statistics.median(times))
    kvbytes = sum(b.nbytes for l in m.layers for b in l.attention.kv_cache.buffers()) / 7169 * (2048 - 16)
    return f"{out[0]:.3f} {out[1]:.3f} {kvbytes / (out[1] - out[0]) / 1e6:.1f}"

if sys.argv[1] == "--side":
    print(side(sys.argv[2] == "stacked", sys.argv[3], sys.argv[4])); sys.exit()
ck, kv, pairs = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(pairs):
    for s in ("apart", "stacked") if i % 2 == 0 else ("stacked", "apart"):
        r = subprocess.run([sys.executable, __file__, "--side", s, ck, kv], capture_output=True, text=True)
        print(kv, s, r.stdout.split()[-3:] if r.returncode == 0 else r.stderr[-2000:], flush=True)
