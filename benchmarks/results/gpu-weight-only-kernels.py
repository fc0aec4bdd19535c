"""kernels.py's int8 products against cuBLAS on bf16 weights and tinygemm on int4, on a GPU, at
Llama-3.1-8B's shapes: a layer's four products (wqkv, wo, w13, w2) and the output head, at 1 row (a decode
step) and 6 (a verify step of k = 5). Each form's products over several copies of the layer (more bytes
than the L2 holds) are recorded in one CUDA graph, so that launch overhead is not what is timed (Triton's
autotuner is Python each call); median of the replays. Each form is checked against the dequantized
weight in fp64 first. (An int4 Triton kernel of the same design ran too, at commit 810eafe, and lost to
tinygemm: benchmarks/RESULTS.md, "A sixth GPU session".)

    python benchmarks/results/gpu-weight-only-kernels.py [--rows 1 6] [--copies 4] [--replays 20]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fastllama import kernels, quantize  # noqa: E402

LAYER = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336)}
HEAD = {"output": (128256, 4096)}
GROUPSIZE = 32


def forms(n: int, k: int) -> dict:
    """form -> (weight bytes, a product x -> y, the weight it stands for in fp64, made when asked) for one
    random weight (n, k)."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, s = quantize.quantize_int8(w)
    scales, mins = quantize.int4_group_params(w, GROUPSIZE)
    packed = quantize.pack_int4(quantize.quantize_int4(w, scales, mins))
    scales, mins = scales.bfloat16(), mins.bfloat16()
    int4 = lambda: quantize.dequantize_int4(packed, scales, mins, torch.float64)  # noqa: E731
    tiny, scales_and_zeros = quantize.int4_kernel_layout("cuda", packed.clone(), scales, mins)
    int4_bytes = packed.nbytes + scales.nbytes + mins.nbytes
    return {
        "bf16 cuBLAS": (w.nbytes, lambda x: F.linear(x, w), w.double),
        "int8 triton": (q.nbytes + s.nbytes, lambda x: kernels.int8_rows(x, q, s),
                        lambda: q.double() * s.double()[:, None]),
        "int4 tinygemm": (int4_bytes, lambda x: torch.ops.aten._weight_int4pack_mm(x, tiny, GROUPSIZE,
                                                                                     scales_and_zeros), int4),
    }


SEEN = set()


def print_tuning(what: str):
    """The autotuner's timings of every tile it tried, for the shape it last tuned (once a tuning)."""
    for tuned in kernels.TUNED.values():
        timings = getattr(tuned, "configs_timings", None)
        if timings and id(timings) not in SEEN:
            SEEN.add(id(timings))
            ms = sorted(((t[0] if isinstance(t, (list, tuple)) else t), c) for c, t in timings.items())
            print(f"  tuned {what}: " + "; ".join(f"{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}"
                  f"{' dot' if c.kwargs['DOT'] else ''} w{c.num_warps}s{c.num_stages} {t * 1e3:.1f}us" for t, c in ms),
                  flush=True)


def time_graph(fn, replays: int) -> float:
    """Median ms of a replay of fn recorded as one CUDA graph."""
    fn()  # autotunes, compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.no_grad()
def main(args):
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    results = {}
    for group, shapes in (("layer", LAYER), ("head", HEAD)):
        copies = args.copies if group == "layer" else 2
        weights = [{name: forms(*shape) for name, shape in shapes.items()} for _ in range(copies)]
        for rows in args.rows:
            for form in weights[0][next(iter(shapes))]:
                products = [(name, *copy[name][form]) for copy in weights for name in shapes]
                xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes.values()}
                worst = 0.0
                for name, _, product, ref in products[: len(shapes)]:
                    x = xs[shapes[name][1]]
                    y = product(x)
                    print_tuning(f"{form} {name} rows {rows}")
                    exact = x.double() @ ref().T
                    worst = max(worst, ((y.double() - exact).norm() / exact.norm()).item())
                assert worst < 1e-2, f"{form}: relative error {worst:.2e} at {rows} rows"
                ms = time_graph(lambda: [product(xs[shapes[name][1]]) for name, _, product, _ in products],
                                args.replays)
                nbytes = sum(b for _, b, _, _ in products)
                us = ms * 1e3 / copies
                results[group, rows, form] = us
                print(f"{group:5} rows {rows}  {form:14} {us:8.1f} us a {group}  {nbytes / ms / 1e6:7.0f} GB/s  "
                      f"rel err {worst:.1e}", flush=True)
    print("\nchosen tiles, by row block: {(N, K): config}")
    for bm, tuned in kernels.TUNED.items():
        if tuned.cache:
            print(f"  rows {bm}:", {key[:2]: str(config) for key, config in tuned.cache.items()})
    print("\nform            " + "  ".join(f"{g} {r} row(s)" for g in ("layer", "head") for r in args.rows))
    for form in ("bf16 cuBLAS", "int8 triton", "int4 tinygemm"):
        cells = [f"{results[g, r, form]:9.1f} us" for g in ("layer", "head") for r in args.rows]
        print(f"{form:14}  " + "  ".join(cells))
    for r in args.rows[1:]:
        print(f"{r} rows / 1 row, a layer: " + ", ".join(
            f"{form} {results['layer', r, form] / results['layer', args.rows[0], form]:.2f}x"
            for form in ("bf16 cuBLAS", "int8 triton", "int4 tinygemm")))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    p.add_argument("--copies", type=int, default=4, help="copies of the layer's weights a replay reads")
    p.add_argument("--replays", type=int, default=20)
    main(p.parse_args())
