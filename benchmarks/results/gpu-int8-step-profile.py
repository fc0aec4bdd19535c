"""Where an int8 model's decode step spends its time on a GPU, against the bf16 one's: on an H200
(2026-11-27) Llama-3.1-8B's int8 step took 5.70 ms at depth 0, bf16's 5.43, though a layer's four int8
products alone took 73 us against bf16's 106 (gpu-int8-few-rows.py). A few layers of the 8B's shape,
random weights, a small vocabulary; each model's step compiled as generate compiles it, timed, then
its kernels over a few steps.

In the first run (2026-11-27, H200) a product whose input inductor computes inside its own kernel
(w2's from SiLU(w1 x) * w3 x, wqkv's and w13's from the norm) ran slower than alone: int8 w2 53 us
against 18. --realize runs each mode again with each linear's input realized, so that its product
reads a finished input as in gpu-int8-few-rows.py:
  view  through a no-op as_strided, which inductor cannot apply to an unrealized value: the trick
        cpu_decode.in_fp32_buffer plays on CPU for the same reason, and the form the model would take
  copy  through an opaque copy (a custom op inductor cannot see into), a kernel more a product: the
        control, should the view not realize on a GPU
python3 benchmarks/results/gpu-int8-step-profile.py [--layers 4] [--modes bf16 int8 int4] [--realize view copy]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "scripts")]
from fastllama import decode, generate as gen, quantize  # noqa: E402
from benchmark import quantized_copy, randomized  # noqa: E402
from fastllama.model import ModelArgs, Transformer, transformer_configs  # noqa: E402

STEP = decode.decode_one_token
FORWARDS = {cls: cls.forward for cls in (torch.nn.Linear, quantize.Int8Linear, quantize.Int4Linear)}


@torch.library.custom_op("fastllama_bench::copied", mutates_args=())
def copied(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@copied.register_fake
def _(x):
    return torch.empty_like(x)


REALIZED = {"view": lambda x: x.as_strided(x.shape, x.stride()), "copy": copied}


def realize_inputs(how: str | None):
    """Each linear's input realized `how` (REALIZED), or as the model has it (None)."""
    for cls, forward in FORWARDS.items():
        cls.forward = forward if how is None else (lambda self, x, f=forward: f(self, REALIZED[how](x)))


def steps(model, n, device):
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    for i in range(n):
        token = decode.decode_one_token(model, token, torch.tensor([[i]], device=device),
                                        decode.key_positions(model, i + 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=["bf16", "int8", "int4"])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--realize", nargs="*", choices=list(REALIZED), default=[],
                   help="each mode also with its linears' inputs realized so")
    args = p.parse_args()
    config = ModelArgs(**{**transformer_configs["Llama-3.1-8B"], "n_layer": args.layers, "vocab_size": 4096})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = randomized(Transformer(config).to(torch.bfloat16))
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}, torch {torch.__version__}; "
          f"{args.layers} layers of Llama-3.1-8B's shape, vocabulary 4096, depth 0, {args.steps} steps, "
          f"median of {args.runs}")
    for mode in args.modes:
        m = model if mode == "bf16" else quantized_copy(model, config, mode, 32)
        for how in [None, *args.realize]:
            realize_inputs(how)
            measure(m, f"{mode}{f', inputs realized by {how}' if how else ''}", args)
    realize_inputs(None)


def measure(m, name, args):
    """Step time over `steps` steps (the host's share included: a few layers' step may wait on it),
    then the kernels of 4 steps and their GPU time a step."""
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
    line = f"{name}: {statistics.median(times) * 1e3:.3f} ms a step; compile {compile_s:.0f} s"
    if args.device != "cuda":
        print(line, flush=True)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        steps(m, 4, args.device)
        gen.synchronize(args.device)
    kernels = prof.key_averages()
    gpu_us = sum(k.self_device_time_total for k in kernels) / 4
    print(f"{line}; kernels {gpu_us:.0f} us a step, {gpu_us / args.layers:.1f} us a layer", flush=True)
    print(kernels.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=90))


if __name__ == "__main__":
    with torch.no_grad():
        main()
