"""int8 (and int4) weight-only products of one and of a few rows on a GPU, in the forms a compiled step
may take (issue 15: on an H200 a verify step of 6 tokens cost 6.62x a plain step with int8 weights,
1.61x with bf16 ones). Llama-3.1-8B's four weight shapes a layer, --copies of each so that none stays in cache,
one compiled function a form and row count, timed over many calls:

  dequantize  F.linear(x, w.to(bf16)) * scales: Int8Linear's form off CPU. At one row compiled code
              reads the int8 weight once; at several it may write a bf16 copy first for cuBLAS
  rows        cpu_decode.few_rows_product: a reduction per row over the same int8 weight, which
              inductor may fuse into one pass that reads each weight element once for all rows
  out-major   one reduction over (out, rows): the rows of an output sit side by side, so the lanes
              that share a weight element load it together, once from memory for all rows (rows
              reads each weight row once per input row, from cache at best)
  triton-mm   the dequantize form with inductor's gemm autotuning on and Triton templates only: a
              template may take the int8 conversion into its loads (prologue fusion), where cuBLAS
              needs a bf16 copy written first
  bf16        F.linear on bf16 weights: twice the bytes, cuBLAS
  int4-tinygemm    PyTorch's int4 kernel (groups of 32), Int4Linear's on a GPU: on an H200 it read the
                   8B's int4 weights at about 1.7 TB/s in a step
  int4-dequantize  the same levels in quantize.py's neutral layout (two to a byte, a scale and a min a
                   group), dequantized in the product: compiled, one pass over the packed bytes?

Compiled with decode.compile_steps's inductor settings (coordinate-descent tuning, under which a
one-row matmul becomes a multiply-and-sum). The first run, 2026-11-27 on an H200, had them off.

Prints microseconds per layer (its four products) and GB/s of the bytes a form's weights take
(scales and mins included).
python3 benchmarks/results/gpu-int8-few-rows.py [--rows 1 6] [--forms ...] [--copies 8] [--profile]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
from fastllama import cpu_decode, generate as gen, quantize  # noqa: E402
from fastllama.model import transformer_configs  # noqa: E402

FORMS = {
    "dequantize": lambda x, w, s: F.linear(x, w.to(x.dtype)) * s,
    "rows": lambda x, w, s: (cpu_decode.few_rows_product(x, w) * s).to(x.dtype),
    "out-major": lambda x, w, s: ((w.to(x.dtype)[:, None, :] * x[None]).sum(-1).t() * s).to(x.dtype),
    "triton-mm": lambda x, w, s: F.linear(x, w.to(x.dtype)) * s,
    "bf16": lambda x, w, s: F.linear(x, w),
    "int4-tinygemm": lambda x, w, scales_and_zeros: quantize.int4_matmul(
        "cuda" if x.is_cuda else "cpu", x, w, GROUPSIZE, scales_and_zeros),
    "int4-dequantize": lambda x, packed, scales, mins: F.linear(
        x, quantize.dequantize_int4(packed, scales, mins, x.dtype)),
}
GROUPSIZE = 32
GEMM_BACKENDS = torch._inductor.config.max_autotune_gemm_backends


def operands(form: str, w: torch.Tensor, s: torch.Tensor) -> tuple:
    """What a form's product reads besides x, made from one int8 weight and its scales."""
    if form == "bf16":  # the same values, twice the bytes
        return w.to(torch.bfloat16), s
    if form.startswith("int4"):
        levels = ((w.short() + 128) >> 4).to(torch.uint8)  # 0..15
        scales = s[:, None].expand(-1, w.shape[1] // GROUPSIZE).contiguous()
        int4 = quantize.pack_int4(levels), scales, -8 * scales
        if form == "int4-dequantize":
            return int4
        return quantize.int4_kernel_layout("cuda" if w.is_cuda else "cpu", *int4)
    return w, s


def layer_shapes(name: str) -> list[tuple[int, int]]:
    """(out, in) of a layer's fused products: wqkv, wo, w13 (gate and up), w2."""
    c = transformer_configs[name]
    head_dim = c["dim"] // c["n_head"]
    hidden = c["intermediate_size"]
    return [((c["n_head"] + 2 * c["n_local_heads"]) * head_dim, c["dim"]), (c["dim"], c["n_head"] * head_dim),
            (2 * hidden, c["dim"]), (c["dim"], hidden)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Llama-3.1-8B")
    p.add_argument("--forms", nargs="+", default=list(FORMS))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    p.add_argument("--copies", type=int, default=8, help="layers of weights, each read once a pass")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", action="store_true", help="the kernels of one pass, for each form and row count")
    args = p.parse_args()
    torch.manual_seed(0)
    torch._inductor.config.coordinate_descent_tuning = True  # as decode.compile_steps sets it
    shapes = layer_shapes(args.model)
    layers = [[(torch.randint(-127, 128, shape, dtype=torch.int8, device=args.device),
                torch.rand(shape[0], dtype=torch.bfloat16, device=args.device) / 100) for shape in shapes]
              for _ in range(args.copies)]
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}, torch {torch.__version__}; "
          f"{args.model}'s layer shapes {shapes}, {args.copies} copies, median of {args.runs} runs of {args.calls} passes")
    print(f"{'form':15} {'rows':>4} {'us/layer':>9} {'GB/s':>6} {'compile s':>9}")
    for form in args.forms:
        product = FORMS[form]
        weights = [[operands(form, w, s) for w, s in layer] for layer in layers]
        bytes_read = sum(t.nbytes for ops in weights[0] for t in ops)  # a layer's
        for rows in args.rows:
            xs = {i: torch.randn(rows, i, dtype=torch.bfloat16, device=args.device) for _, i in shapes}

            def one_pass():
                return [product(xs[k], *ops) for layer in weights for (_, k), ops in zip(shapes, layer)]

            torch._dynamo.reset()
            torch._inductor.config.max_autotune_gemm = form == "triton-mm"
            torch._inductor.config.max_autotune_gemm_backends = "TRITON" if form == "triton-mm" else GEMM_BACKENDS
            compiled = torch.compile(one_pass, fullgraph=True)
            start = time.perf_counter()
            compiled()
            gen.synchronize(args.device)
            compile_s = time.perf_counter() - start
            times = []
            for _ in range(args.runs):
                gen.synchronize(args.device)
                start = time.perf_counter()
                for _ in range(args.calls):
                    compiled()
                gen.synchronize(args.device)
                times.append((time.perf_counter() - start) / args.calls / args.copies)
            seconds = statistics.median(times)
            print(f"{form:15} {rows:4} {seconds * 1e6:9.1f} {bytes_read / seconds / 1e9:6.0f} {compile_s:9.1f}",
                  flush=True)
            if args.profile and args.device == "cuda":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    compiled()
                    gen.synchronize(args.device)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=70))


if __name__ == "__main__":
    with torch.no_grad():
        main()
