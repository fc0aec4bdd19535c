"""Issue 49's "KV GB/s" from steps taken in pairs: one compiled decode step at the first depth, then one at a deeper
one, in turn, PAIRS times, so that this VM's swings (its memory bandwidth moves by up to 2x within seconds) fall on
both steps of a pair alike. A pair's difference is the step's time beyond the first depth; its cache bytes over that
time is the pair's read rate. Prints, for each cache format and depth, the median ms of each side, the median of the
pairs' differences, and the read rate of that median with the rates' quartiles over the pairs.
benchmark_depths.py times each depth's runs of 16 steps apart, seconds to minutes from the first depth's.

    python benchmarks/results/cpu-kv-read-paired.py GGUF FORMATS DEPTH0 DEPTH [DEPTH ...] [--pairs N]
    python benchmarks/results/cpu-kv-read-paired.py bundled.gguf bf16,int8 16 2048 7000
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd  # noqa: E402
from benchmark import compiled_apart  # noqa: E402
from fastllama import decode, generate as gen  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("gguf")
parser.add_argument("formats")
parser.add_argument("depths", type=int, nargs="+")
parser.add_argument("--pairs", type=int, default=200)
cli = parser.parse_args()
torch.set_grad_enabled(False)
args = bd.model_arguments("").parse_args(["--checkpoint_path", cli.gguf])
first, deeper = cli.depths[0], cli.depths[1:]


print(f"{cli.gguf}, {torch.get_num_threads()} threads, {cli.pairs} pairs of steps (depth {first}, then the deeper one)")
for kv in cli.formats.split(","):
    torch.manual_seed(0)
    model = bd.load(args)
    model.setup_caches(1, decode.padded_length(max(deeper) + 1, model.config.block_size),
                       kv_cache_dtype=gen.KV_CACHE_DTYPES[kv])
    bd.fill_at_random(model)
    step, token = compiled_apart(), torch.zeros((1, 1), dtype=torch.long)

    def timed(depth):
        start = time.perf_counter()
        step(model, token, torch.tensor([[depth]]), decode.key_positions(model, depth + 1))
        return (time.perf_counter() - start) * 1e3

    for depth in deeper:
        for _ in range(8):  # compiles the first time; then warm
            timed(first), timed(depth)
        shallow, deep = [], []
        for _ in range(cli.pairs):
            shallow.append(timed(first))
            deep.append(timed(depth))
        beyond = sorted(d - s for s, d in zip(shallow, deep))
        # the cache bytes beyond the first depth's, as benchmark_depths.py counts them (scales included)
        gone = bd.bytes_read_per_step(model, depth, 1) - bd.bytes_read_per_step(model, first, 1)
        rates = sorted(gone / (x * 1e-3) / 1e9 for x in beyond if x > 0)
        (b1, b2, b3), (q1, _, q3) = statistics.quantiles(beyond, n=4), statistics.quantiles(rates, n=4)
        print(f"{kv} cache, depth {first} / {depth}: {statistics.median(shallow):.2f} / {statistics.median(deep):.2f} ms, "
              f"beyond {b2:.3f} ms (quartiles {b1:.3f}-{b3:.3f}): KV GB/s {gone / (b2 * 1e-3) / 1e9:.1f} "
              f"(pairs' quartiles {q1:.1f}-{q3:.1f}; {len(beyond) - len(rates)} pairs not slower)", flush=True)
