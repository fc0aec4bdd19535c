"""Issue 49's "KV GB/s" from steps taken in pairs: one compiled decode step at the first depth, then one at a deeper
one, in turn, PAIRS times, so that this VM's swings (its memory bandwidth moves by up to 2x within seconds) fall on
both steps of a pair alike. A pair's difference is the step's time beyond the first depth; its cache bytes over that
time is the pair's read rate. Prints, for each cache format and depth, the median ms of each side, the median of the
pairs' differences, and the read rate of that median with the rates' quartiles over the pairs. Every format's model
is loaded at once and a round takes each format's pair in turn, so that the formats compare too: each format's
median ms at each depth over the first format's, and the quartiles of the rounds' ratios (issue 49 asks the int8
cache to be faster than bf16 from 2k on). A format FORMAT@VARIANT.cpp has its attention read by VARIANT.cpp, a
cpu_attention.cpp to try, built under an op namespace of its own, against the checkout's kernel for FORMAT beside it.
benchmark_depths.py times each depth's runs of 16 steps apart, seconds to minutes from the first depth's, and each
format's after the other's.

    python benchmarks/results/cpu-kv-read-paired.py GGUF FORMATS DEPTH0 DEPTH [DEPTH ...] [--pairs N]
    python benchmarks/results/cpu-kv-read-paired.py bundled.gguf bf16,int8 16 2048 7000
    python benchmarks/results/cpu-kv-read-paired.py bundled.gguf int8,int8@variant.cpp 16 2048 7000
"""
import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd  # noqa: E402
from benchmark import compiled_apart  # noqa: E402
from fastllama import cpu_decode, decode, generate as gen  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("gguf")
parser.add_argument("formats")
parser.add_argument("depths", type=int, nargs="+")
parser.add_argument("--pairs", type=int, default=200)
cli = parser.parse_args()
torch.set_grad_enabled(False)
args = bd.model_arguments("").parse_args(["--checkpoint_path", cli.gguf])
first, deeper = cli.depths[0], cli.depths[1:]


print(f"{cli.gguf}, {torch.get_num_threads()} threads, {cli.pairs} rounds of a pair of steps a format (depth {first}, "
      "then the deeper one)")


def variant_kernel(path, i):
    """VARIANT.cpp's decode attention, called as cpu_decode.decode_attention calls the checkout's"""
    build, root = Path(tempfile.mkdtemp()), Path(cpu_decode.__file__).parent
    (build / "attention.cpp").write_text(Path(path).read_text().replace("(fastllama,", f"(fastllama_try{i},"))
    shutil.copy(root / "cpu_vectors.h", build / "cpu_vectors.h")
    cpp_extension.load(f"fastllama_try{i}", [str(build / "attention.cpp")], is_python_module=False,
                       extra_cflags=["-O3", "-march=native", "-fopenmp"])
    torch.library.register_fake(f"fastllama_try{i}::decode_attention")(
        lambda q, k, v, k_scales, v_scales, mask, scale: q.new_empty(q.shape, dtype=torch.float32))
    op = getattr(torch.ops, f"fastllama_try{i}").decode_attention
    return lambda q, k, v, k_scales, v_scales, mask, scale: op(q, k, v, k_scales, v_scales, mask.to(torch.uint8), scale)


formats, models, steps = cli.formats.split(","), {}, {}
for i, kv in enumerate(formats):
    torch.manual_seed(0)
    models[kv] = bd.load(args)
    models[kv].setup_caches(1, decode.padded_length(max(deeper) + 1, models[kv].config.block_size),
                            kv_cache_dtype=gen.KV_CACHE_DTYPES[kv.split("@")[0]])
    if "@" in kv:
        kernel = variant_kernel(kv.split("@")[1], i)
        for layer in models[kv].layers:
            assert layer.attention.decode_kernel is not None, "the checkout's kernel is not in use: nothing to replace"
            layer.attention.decode_kernel = kernel
    bd.fill_at_random(models[kv])
    steps[kv] = compiled_apart()
token = torch.zeros((1, 1), dtype=torch.long)


def timed(kv, depth):
    start = time.perf_counter()
    steps[kv](models[kv], token, torch.tensor([[depth]]), decode.key_positions(models[kv], depth + 1))
    return (time.perf_counter() - start) * 1e3


def quartiles(x):
    return "-".join(f"{q:.3f}" for q in statistics.quantiles(x, n=4)[::2])


for depth in deeper:
    for kv in formats:
        for _ in range(8):  # compiles the first time; then warm
            timed(kv, first), timed(kv, depth)
    shallow, deep = {kv: [] for kv in formats}, {kv: [] for kv in formats}
    for i in range(cli.pairs):
        for kv in (formats if i % 2 == 0 else formats[::-1]):
            shallow[kv].append(timed(kv, first))
            deep[kv].append(timed(kv, depth))
    for kv in formats:
        beyond = sorted(d - s for s, d in zip(shallow[kv], deep[kv]))
        # the cache bytes beyond the first depth's, as benchmark_depths.py counts them (scales included)
        gone = bd.bytes_read_per_step(models[kv], depth, 1) - bd.bytes_read_per_step(models[kv], first, 1)
        rates = sorted(gone / (x * 1e-3) / 1e9 for x in beyond if x > 0)
        b2, (q1, _, q3) = statistics.median(beyond), statistics.quantiles(rates, n=4)
        print(f"{kv} cache, depth {first} / {depth}: {statistics.median(shallow[kv]):.2f} / "
              f"{statistics.median(deep[kv]):.2f} ms, beyond {b2:.3f} ms (quartiles {quartiles(beyond)}): KV GB/s "
              f"{gone / (b2 * 1e-3) / 1e9:.1f} (pairs' quartiles {q1:.1f}-{q3:.1f}; {len(beyond) - len(rates)} pairs "
              "not slower)", flush=True)
    for kv in formats[1:]:
        for d, times in ((first, shallow), (depth, deep)):
            ratios = [a / b for a, b in zip(times[kv], times[formats[0]])]
            print(f"  {kv} / {formats[0]} at depth {d}: {statistics.median(times[kv]) / statistics.median(times[formats[0]]):.3f}"
                  f" (the rounds' quartiles {quartiles(ratios)})", flush=True)
