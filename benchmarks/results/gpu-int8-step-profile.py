"""Where an int8 model's decode step spends its time on a GPU, against the bf16 one's: on an H200
(2026-11-27) Llama-3.1-8B's int8 step took 5.70 ms at depth 0, bf16's 5.43, though a layer's four int8
products alone took 73 us against bf16's 106 (gpu-int8-few-rows.py). A few layers of the 8B's shape,
random weights, a small vocabulary; each model's step compiled as generate compiles it, timed, then
its kernels over a few steps.
python3 benchmarks/results/gpu-int8-step-profile.py [--layers 4] [--modes bf16 int8 int4]
"""

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "scripts")]
import decode  # noqa: E402
import generate as gen  # noqa: E402
from benchmark import quantized_copy, randomized  # noqa: E402
from model import ModelArgs, Transformer, transformer_configs  # noqa: E402

STEP = decode.decode_one_token


def steps(model, n, device):
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    for i in range(n):
        token = decode.decode_one_token(model, token, torch.tensor([[i]], device=device), decode.key_positions(model, i + 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=["bf16", "int8", "int4"])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    config = ModelArgs(**{**transformer_configs["Llama-3.1-8B"], "n_layer": args.layers, "vocab_size": 4096})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = randomized(Transformer(config).to(torch.bfloat16))
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}, torch {torch.__version__}; "
          f"{args.layers} layers of Llama-3.1-8B's shape, vocabulary 4096, depth 0, {args.steps} steps, median of {args.runs}")
    for mode in args.modes:
        m = model if mode == "bf16" else quantized_copy(model, config, mode, 32)
        torch._dynamo.reset()
        decode.decode_one_token = STEP
        decode.compile_steps()
        m.setup_caches(1, 256)
        start = time.perf_counter()
        steps(m, 2, args.device)
        steps(m, 2, args.device)
        compile_s = time.perf_counter() - start
        times = []
        for _ in range(args.runs):
            gen.synchronize(args.device)
            start = time.perf_counter()
            steps(m, args.steps, args.device)
            gen.synchronize(args.device)
            times.append((time.perf_counter() - start) / args.steps)
        print(f"{mode}: {statistics.median(times) * 1e3:.3f} ms a step, {statistics.median(times) / args.layers * 1e6:.1f} us "
              f"a layer; compile {compile_s:.0f} s", flush=True)
        if args.device == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                steps(m, 4, args.device)
                gen.synchronize(args.device)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=90))


if __name__ == "__main__":
    with torch.no_grad():
        main()
