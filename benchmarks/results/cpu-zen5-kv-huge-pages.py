"""Does a KV cache buffer's page size change its read rate? PyTorch's allocator gives huge pages to tensors of 2 MB
or more (fastllama/__init__.py sets THP_MEM_ALLOC_ENABLE=1), and a layer's int8 cache of the bundled model at 7168
slots is 1.3 MB, its bf16 one 2.6 MB. Variants FORMAT:LENGTH[:big], each a model with caches of that many slots;
`big`: each cache buffer inside an aligned 2 MiB of an allocation of 6 MiB (a huge page; the process's count of
them says). Pairs of compiled steps at depth 16 and DEPTH in turn, every variant each round, as
cpu-kv-read-paired.py takes them.

    python benchmarks/results/cpu-zen5-kv-huge-pages.py GGUF int8:7168,int8:7168:big 7000 60
"""
import statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd
from benchmark import compiled_apart
from fastllama import decode, generate as gen

gguf, variants, depth, pairs = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
torch.set_grad_enabled(False)
args = bd.model_arguments("").parse_args(["--checkpoint_path", gguf])
models, steps = {}, {}


def huge_kb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


import os
print("THP_MEM_ALLOC_ENABLE", os.environ.get("THP_MEM_ALLOC_ENABLE"), torch.get_num_threads(), "threads")
for v in variants:
    kv, length, *big = v.split(":")
    torch.manual_seed(0)
    m = bd.load(args)
    m.setup_caches(1, int(length), kv_cache_dtype=gen.KV_CACHE_DTYPES[kv])
    if big:
        before = huge_kb()
        for layer in m.layers:
            c = layer.attention.kv_cache
            for name in ("k_cache", "v_cache"):
                t = getattr(c, name)
                flat = torch.zeros((6 << 20) // t.element_size(), dtype=t.dtype)
                at = (-flat.data_ptr()) % (2 << 20) // t.element_size()  # the buffer within one aligned 2 MiB
                setattr(c, name, flat[at:at + t.numel()].view(t.shape))
        print(f"\n{v}: the process's huge pages grew by {(huge_kb() - before) / 1024:.0f} MiB for {2 * len(m.layers)} "
              "buffers, each in an aligned 2 MiB of an allocation of 6 MiB", flush=True)
    bd.fill_at_random(m)
    k = m.layers[0].attention.kv_cache.k_cache
    models[v], steps[v] = m, compiled_apart()
    # how many of the buffer's bytes are in huge pages: from /proc/self/smaps, the mapping holding it
    addr = k.data_ptr()
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, l in enumerate(lines):
        if "-" in l.split()[0] and not l.startswith(("Size", "Rss")):
            try:
                a, b = (int(x, 16) for x in l.split()[0].split("-"))
            except ValueError:
                continue
            if a <= addr < b:
                for l2 in lines[i + 1:i + 25]:
                    if l2.startswith(("AnonHugePages", "Rss:", "THPeligible", "Size:")):
                        print(v, "k_cache", tuple(k.shape), k.dtype, f"{k.nbytes/2**20:.2f} MiB;", l2.split(":")[0], l2.split(":")[1].strip(), flush=True)
                break
token = torch.zeros((1, 1), dtype=torch.long)
def timed(v, d):
    s = time.perf_counter()
    steps[v](models[v], token, torch.tensor([[d]]), decode.key_positions(models[v], d + 1))
    return (time.perf_counter() - s) * 1e3
for v in variants:
    for _ in range(8):
        timed(v, 16), timed(v, depth)
sh, dp = {v: [] for v in variants}, {v: [] for v in variants}
for i in range(pairs):
    for v in (variants if i % 2 == 0 else variants[::-1]):
        sh[v].append(timed(v, 16)); dp[v].append(timed(v, depth))
for v in variants:
    beyond = [d - s for s, d in zip(sh[v], dp[v])]
    gone = bd.bytes_read_per_step(models[v], depth, 1) - bd.bytes_read_per_step(models[v], 16, 1)
    b = statistics.median(beyond)
    print(f"{v}: depth 16 {statistics.median(sh[v]):.3f} ms, {depth} {statistics.median(dp[v]):.3f} ms, beyond {b:.3f} ms: {gone/(b*1e-3)/1e9:.1f} GB/s", flush=True)
for v in variants[1:]:
    r = [a / b for a, b in zip(dp[v], dp[variants[0]])]
    q = statistics.quantiles(r, n=4)
    print(f"  {v} / {variants[0]} at {depth}: {statistics.median(dp[v])/statistics.median(dp[variants[0]]):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
