"""Decode attention's two products on a GPU, in the forms a compiled step may take, for each KV cache
format: a 4-layer model of Llama-3.1-8B's layer shape (random weights, a small vocabulary), CUDA-graphed
steps at depths 0, 8192 and 32,704 over random cache contents (no prefill to compile). What a step
costs beyond depth 0 is its attention over the cache: the bytes of keys and values it reads over the
extra time give the bandwidth attention reaches.

Forms (Attention.product, the hook cpu_decode.py uses on CPU):
  matmul     torch.matmul, cuBLAS's batched product (the GPU form so far)
  rows       cpu_decode.attention_product: a reduction per query row, fused into one pass over the keys
  mul-sum    (a[..., None] * b[..., None, :, :]).sum(-2): one reduction over (rows, k, n)
  split      probs @ v as a product per block of 256 keys, summed after (where the keys are whole blocks)
  triton-mm  torch.matmul, with inductor's gemm autotuning on and Triton templates only: a template
             can take a scaled cache's conversion to bf16 into its loads (prologue fusion), where
             cuBLAS needs a bf16 copy written first
python3 benchmarks/results/gpu-decode-attention-forms.py [--forms ...] [--kv ...] [--cache N] [--profile]
Results: benchmarks/RESULTS.md, "A third GPU session"."""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "scripts")]
from fastllama import cpu_decode, decode, generate as gen  # noqa: E402
from benchmark_depths import fill_at_random  # noqa: E402
from fastllama.model import Attention, ModelArgs, Transformer  # noqa: E402
from shapes import SHAPES  # noqa: E402


def mul_sum(a, b):
    return (a.unsqueeze(-1).float() * b.unsqueeze(-3).float()).sum(-2)


def split_keys(a, b, block=decode.KV_BLOCK):
    """a @ b; where it sums over many keys (probs @ v), a product per block of keys, summed after: many
    small products in parallel rather than a few long ones."""
    S = a.shape[-1]
    if S % block or S <= block:
        return torch.matmul(a, b)
    *batch, m, _ = a.shape
    blocks = a.view(*batch, m, S // block, block).transpose(-3, -2) @ b.view(*batch, S // block, block, b.shape[-1])
    return blocks.float().sum(-3)


FORMS = {"matmul": torch.matmul, "rows": cpu_decode.attention_product, "mul-sum": mul_sum, "split": split_keys,
         "triton-mm": torch.matmul}
GEMM_BACKENDS = torch._inductor.config.max_autotune_gemm_backends


def step_ms(model, step, depth, n, runs, device):
    token = torch.zeros(1, 1, dtype=torch.long, device=device)

    def steps():
        t = token
        for i in range(n):
            t = step(model, t, torch.tensor([[depth + i]], device=device), decode.key_positions(model, depth + i + 1))

    steps()
    steps()  # the first pass at a new block count records its CUDA graphs
    times = []
    for _ in range(runs):
        gen.synchronize(device)
        start = time.perf_counter()
        steps()
        gen.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--forms", nargs="+", default=list(FORMS))
    p.add_argument("--kv", nargs="+", default=["bf16", "int8", "fp8"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--depths", type=int, nargs="+", default=[0, 8192, 32704])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cache", type=int, help="positions (default: the deepest depth and its steps)")
    p.add_argument("--profile", action="store_true", help="the kernels of a few steps at the deepest depth")
    args = p.parse_args()
    config = ModelArgs(**{**SHAPES["Llama-3.1-8B"], "n_layer": args.layers, "vocab_size": 4096})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Transformer(config)
    for w in model.parameters():
        w.data.normal_(0, 0.02)
    model = model.to(torch.bfloat16).eval()
    cache = args.cache or max(args.depths) + args.steps
    kv_per_position = 2 * config.n_local_heads * config.head_dim * args.layers  # elements of keys and values
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}, torch {torch.__version__}; "
          f"{args.layers} layers of Llama-3.1-8B's shape, cache {cache} positions, {args.steps} steps, "
          f"median of {args.runs}")
    print(f"{'form':8} {'KV':5} " + " ".join(f"{'d ' + str(d):>9}" for d in args.depths)
          + "   attention GB/s at each depth > 0 (KV bytes read / extra ms); compile s")
    for kv in args.kv:
        dtype = gen.KV_CACHE_DTYPES[kv]
        element = 1 if dtype in (torch.int8, torch.float8_e4m3fn) else 2
        for form in args.forms:
            torch._dynamo.reset()
            Attention.product = staticmethod(FORMS[form])
            torch._inductor.config.max_autotune_gemm = form == "triton-mm"
            torch._inductor.config.max_autotune_gemm_backends = "TRITON" if form == "triton-mm" else GEMM_BACKENDS
            step = gen.compiled_steps().decode_one_token  # compiles anew after the reset
            model.setup_caches(1, cache, kv_cache_dtype=dtype)
            fill_at_random(model)
            try:
                start = time.perf_counter()
                ms = [step_ms(model, step, d, args.steps, args.runs, args.device) for d in args.depths]
                compile_s = time.perf_counter() - start
            except Exception as e:  # noqa: BLE001 - a form that does not compile is a result too
                print(f"{form:8} {kv:5} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            # bytes a step reads beyond depth 0: keys, values (and a bf16 scale a position and head each)
            per_position = kv_per_position * element + (kv_per_position // config.head_dim * 2 if element == 1 else 0)
            gbs = [(d + args.steps / 2) * per_position / ((x - ms[0]) / 1e3) / 1e9
                   for d, x in zip(args.depths[1:], ms[1:])]
            print(f"{form:8} {kv:5} " + " ".join(f"{x:9.3f}" for x in ms) + "   "
                  + " ".join(f"{g:7.0f}" for g in gbs) + f"   {compile_s:.0f}", flush=True)
            if args.profile:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    step_ms(model, step, max(args.depths), 4, 1, args.device)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70))
    Attention.product = staticmethod(torch.matmul)


if __name__ == "__main__":
    with torch.no_grad():
        main()
