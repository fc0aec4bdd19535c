"""kernels.py's decode attention against the compiled written-out form it replaces on a GPU, at
Llama-3.1-8B's attention shape (8 key/value heads of 4 query heads, head_dim 128, batch 1): a decode step
(T = 1) and a verify step (T = 6), over bf16, int8 and fp8 caches, at depths 8192 and 32,768. Each form's
attention over several layers' caches (more bytes than the L2 holds) is recorded in one CUDA graph; median
of the replays. The written-out form is model.py's attend_cache without a kernel, compiled as the step is
(it converts a scaled cache to bf16 for cuBLAS). Every form is checked against fp32 attention first. Then
the kernel's tiles and slice counts at 32k, to choose them (the eighth GPU session's record ran an earlier
list, with 8-warp tiles, slower everywhere; those now try more keys a block for one-byte caches). The ninth
session's record also timed a form since dropped, an int8 cache's levels made floats by their bits with tf32
products: 1.5-1.6x slower.

    python benchmarks/results/gpu-decode-attention-kernel.py [--layers 4] [--replays 20] [--no-tiles]
"""

import argparse
import runpy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fastllama import kernels  # noqa: E402
from fastllama.generate import KV_CACHE_DTYPES  # noqa: E402
from fastllama.model import Attention, KVCache, ModelArgs, attention_mask  # noqa: E402

# a form's median ms a replay, recorded as one CUDA graph: the weight-only kernels' benchmark's way
time_graph = runpy.run_path(str(Path(__file__).with_name("gpu-weight-only-kernels.py")))["time_graph"]

N_KV, GROUP, HD, LENGTH = 8, 4, 128, 32768 + 256
# block of keys, warps, pipeline stages
TILES = [(32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 4, 4), (256, 4, 3)]


def layers(store: torch.dtype, n: int) -> list[Attention]:
    """n attentions of the 8B's shape, each with a cache of random contents."""
    out = []
    for _ in range(n):
        a = Attention(ModelArgs(n_head=N_KV * GROUP, n_local_heads=N_KV, head_dim=HD, dim=4096))
        a.kv_cache = KVCache(1, LENGTH, N_KV, HD, torch.bfloat16, "cuda", store)
        for name, buffer in a.kv_cache.named_buffers():
            if name.endswith("scales"):
                buffer.uniform_(0.01, 0.02)
            elif buffer.dtype == torch.int8:
                buffer.random_(-127, 128)
            else:
                buffer.copy_(torch.randn(buffer.shape, device="cuda"))
        out.append(a)
    return out


def bytes_read(store: torch.dtype, S: int) -> int:
    """Keys and values of S positions of one layer, and their scales for a scaled cache."""
    element = torch.empty(0, dtype=store).element_size()
    return 2 * N_KV * S * HD * element + (2 * N_KV * S * 2 if element == 1 else 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--kv", nargs="+", default=["bf16", "int8", "fp8"])
    p.add_argument("--no-tiles", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; attention of Llama-3.1-8B's shape over "
          f"{args.layers} layers' caches, one CUDA graph, median of {args.replays} replays; us a layer (GB/s)")
    for kv in args.kv:
        store = KV_CACHE_DTYPES[kv]
        attentions = layers(store, args.layers)

        @torch.compile(fullgraph=True)
        def step(q, mask, k_cache, v_cache, k_scales=None, v_scales=None):
            """KVCache.read and Attention.attend, as a compiled step without a kernel runs them."""
            S = mask.shape[-1]
            k, v = k_cache[:, :, :S].to(q.dtype), v_cache[:, :, :S].to(q.dtype)
            if k_scales is not None:
                k, v = k * k_scales[:, :, :S], v * v_scales[:, :, :S]
            return attentions[0].attend(q, k, v, mask)
        for T in (1, 6):
            for S in (8192, 32768):
                depth = torch.arange(S - T, S, device="cuda")[None]  # the step's positions, the last slot's last
                mask = attention_mask(depth, torch.arange(S, device="cuda")[None])
                q = torch.randn(1, N_KV * GROUP, T, HD, device="cuda", dtype=torch.bfloat16)
                k, v = attentions[0].kv_cache.read(1, S, 0, torch.bfloat16)
                exact = attentions[0].attend(q.float(), k.float(), v.float(), mask)
                written = lambda a: step(q, mask, *a.kv_cache.buffers())  # noqa: E731
                kernel = lambda a, **tiles: kernels.attend(  # noqa: E731
                    q.reshape(1, N_KV, GROUP * T, HD), a.kv_cache.k_cache, a.kv_cache.v_cache,
                    getattr(a.kv_cache, "k_scales", None), getattr(a.kv_cache, "v_scales", None), mask, a.scale,
                    **tiles).view(1, N_KV * GROUP, T, HD)
                forms = {"written, compiled": written, "kernel": kernel}
                if S == 32768 and not args.no_tiles:
                    forms.update({f"kernel {n}x{w}w{s}s": lambda a, n=n, w=w, s=s: kernel(
                        a, block_n=n, num_warps=w, num_stages=s) for n, w, s in TILES})
                    forms.update({f"kernel, {c} slices": lambda a, c=c: kernel(a, slices=c) for c in (64, 256)})
                for name, form in forms.items():
                    try:
                        error = ((form(attentions[0]).float() - exact).abs().max() / exact.abs().max()).item()
                        ms = time_graph(lambda: [form(a) for a in attentions], args.replays)
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
                        print(f"{kv:5} T={T} S={S:6} {name:22} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    us = ms / args.layers * 1e3
                    print(f"{kv:5} T={T} S={S:6} {name:22} {us:8.1f} us ({bytes_read(store, S) / us / 1e3:6.0f} GB/s)"
                          f"  error {error:.1e}", flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
