"""Long context: decode ms/token after D tokens of context, for each of --depths, per KV cache format
(--kv_cache_dtype), for --precision's model or each --quantized one, all in one cache sized for the
deepest (a step's cost must follow its depth, not the cache's size); prefill of the deepest prompt
with its peak memory beyond what the model holds; llama.cpp at the same depths beside them (its
llama-bench, or llama-cpp-python with --llama-cpp). MBU counts the weights and the KV bytes a step
reads; "KV GB/s", the cache bytes a step reads beyond the first depth's over the time it takes beyond it.
With --rounds R all of it is measured R times in turn, ours then llama.cpp, and each figure is the
rounds' median (a ratio, the median of the rounds' own ratios).

    python scripts/benchmark_depths.py --depths 0 1024 4096 8000 --quantized int4 --kv_cache_dtype bf16 int8 --llama-bench PATH/llama-bench
    python scripts/benchmark_depths.py --gguf model.gguf --depths 0 1024 4096 --kv_cache_dtype bf16 int8 --no-prefill --llama-cpp
    python scripts/benchmark_depths.py --gguf model.gguf --depths 16 2048 --no-prefill --no-own-cache --rounds 5 --llama-bench PATH/llama-bench
    python scripts/benchmark_depths.py --model Llama-3.1-8B --random-weights --device cuda --depths 0 8192 32768 --kv_cache_dtype bf16 int8 fp8 --no-prefill
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, installed or not

from fastllama import decode, generate as gen, quantize  # noqa: E402
from benchmark import (check_model_arguments, copy_bandwidth_gbs, llama_bench_json, model_arguments,  # noqa: E402
                       timed, write_record)
from ladder_models import full_config, load, quantized_models  # noqa: E402
from fastllama.checkpoint import read_metadata  # noqa: E402
from fastllama.convert import bundled_gguf  # noqa: E402
from fastllama.errors import UserError, refuse, run_cli  # noqa: E402
from fastllama.model import Transformer  # noqa: E402


@torch.no_grad()
def depths_main(args):
    """Decode ms/token after `depth` tokens of context, for each of --depths, each KV cache format and
    model (--quantized's, or else --precision's), in one cache sized for the deepest: a step's cost must
    follow its depth, not the cache's size (the first depth past 0 is measured again in a cache sized
    for it alone, unless --no-own-cache). Then prefill of the deepest prompt: tok/s and its peak memory
    beyond what the model holds (with --no-prefill, none: the steps read random cache contents).
    llama-bench (-d, and -p) beside them."""
    if args.no_prefill and full_config(args).sliding_window:
        raise UserError("--no-prefill fills full caches only: a sliding-window model's ring holds what a prefill "
                        "writes into it; leave --no-prefill out")
    torch.manual_seed(0)
    model = load(args)
    depths, n = sorted(args.depths), args.max_new_tokens
    if depths[-1] + n > model.config.block_size:
        raise UserError(f"depth {depths[-1]} and {n} new tokens exceed the model's context of {model.config.block_size}: "
                        f"ask for shallower --depths or fewer --max_new_tokens")
    steps = gen.compiled_steps(dynamic_prefill=True)
    scheme = None if args.model else quantize.read_scheme(read_metadata(gen.find_checkpoint(args.checkpoint_path)))
    # a quantized checkpoint's method, and a GGUF's counts of linears kept in int8 and in IQ4 (quantize.Int4GGUF)
    method = scheme and scheme.method + "".join(f" + {len(layers)} {kind}" for kind, layers in
                                                (("int8", scheme.int8_layers), ("iq4", scheme.iq4_layers)) if layers)
    name = f"{method}, {args.precision}" if scheme else args.precision
    models = [(name, model)] if not args.quantized else [(q, make()) for q, make in quantized_models(args, model).items()]
    deepest_cache = decode.padded_length(depths[-1] + n, model.config.block_size)
    shallow = next((d for d in depths if d > 0), 0)
    bandwidth = copy_bandwidth_gbs(args.device)
    print(f"\n{args.model or args.checkpoint_path or 'bundled SmolLM2-135M-Instruct'}, {args.device}, "
          f"{torch.get_num_threads()} threads, decode ms/token ({n} steps, median of {args.runs}"
          f"{f'; the median of {args.rounds} rounds' if args.rounds > 1 else ''}"
          f"{', ours and llama.cpp in turn' if args.rounds > 1 and (args.llama_bench or args.llama_cpp) else ''}) after "
          f"{'random cache contents' if args.no_prefill else 'a random prompt'} of each depth, in a cache of "
          f"{deepest_cache} positions; MBU: weight and KV bytes a step reads over the measured copy bandwidth, "
          f"{bandwidth:.0f} GB/s")
    # Each round measures ours, then llama.cpp: the machine's slower and faster spells fall on both, and
    # a ratio is taken within a round before the rounds' median (a VM's speed swings within minutes).
    rows, peers, rounds = {}, {}, []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"round {r + 1} of {args.rounds}", flush=True)
        ms = {}
        for name, m in models:
            for kv in args.kv_cache_dtype:
                if r == 0:
                    rows[name, kv] = dict(weights=name, kv_cache=kv, cache_positions=deepest_cache, own_cache=None)
                if r == 0 and 0 < shallow < depths[-1] and not args.no_own_cache:  # setup_caches keeps a larger cache
                    m.setup_caches(1, decode.padded_length(shallow + n, m.config.block_size),
                                   kv_cache_dtype=gen.KV_CACHE_DTYPES[kv])
                    rows[name, kv]["own_cache"] = dict(depth=shallow, cache_positions=m.max_seq_length,
                                                       ms_per_token=decode_ms_at_depth(m, shallow, n, args, steps))
                m.setup_caches(1, deepest_cache, kv_cache_dtype=gen.KV_CACHE_DTYPES[kv])
                ms[name, kv] = dict(zip(depths, (decode_ms_at_depth(m, d, n, args, steps) for d in depths)))
                if r == 0:
                    prefill_tok_s, peak_mb = ((None, None) if args.no_prefill
                                              else prefill_at_depth(m, depths[-1], args, steps))
                    rows[name, kv].update(kv_cache_mb=kv_cache_bytes(m) / 1e6, prefill_tok_s=prefill_tok_s,
                                          prefill_peak_mb=peak_mb,
                                          bytes_read={d: bytes_read_per_step(m, d, n) for d in depths})
        if args.llama_bench:
            tg = llama_bench_json(args, "-p", "0", "-n", str(n), "-d", ",".join(map(str, depths)))
            ms["llama-bench"] = {t["n_depth"]: 1e3 / t["avg_ts"] for t in tg}
            if r == 0:
                peers["llama-bench"] = dict(weights=f"llama.cpp {tg[0]['model_type']}",
                                            kv_cache=tg[0].get("type_k", "f16"), build=tg[0]["build_commit"])
                if not args.no_prefill:
                    peers["llama-bench"]["prefill_tok_s"] = llama_bench_json(
                        args, "-p", str(depths[-1]), "-n", "0")[0]["avg_ts"]
            print("  llama-bench: " + ", ".join(f"depth {d} {x:.2f}" for d, x in ms["llama-bench"].items())
                  + " ms/token", flush=True)
        if args.llama_cpp:
            ms["llama-cpp-python"] = llama_cpp_ms(args, depths, n)
            peers["llama-cpp-python"] = dict(weights="llama.cpp (llama-cpp-python)", kv_cache="f16")
        rounds.append(ms)

    def median(f):  # a figure's median over the rounds, at each depth: f(a round's ms, depth)
        per_round = [[f(ms, d) for ms in rounds] for d in depths]
        return {d: statistics.median(x) if None not in x else None for d, x in zip(depths, per_round)}

    def over_depth0(key):  # the cache read beyond the first depth's, over the time beyond it
        gone = rows[key]["bytes_read"]
        return lambda ms, d: ((gone[d] - gone[depths[0]]) / ((ms[key][d] - ms[key][depths[0]]) / 1e3) / 1e9
                              if d > depths[0] and ms[key][d] > ms[key][depths[0]] else None)

    print(f"{'weights':24} {'KV cache':8} {'KV MB':>7} " + " ".join(f"{'d ' + str(d):>9}" for d in depths)
          + ("" if args.no_prefill else f" {'prefill tok/s':>13} {'peak MB':>8}"))
    for key, row in rows.items():
        row["ms_per_token"] = median(lambda ms, d: ms[key][d])
        row["mbu"] = {d: row["bytes_read"][d] / (x / 1e3) / 1e9 / bandwidth for d, x in row["ms_per_token"].items()}
        row["kv_gb_s"] = median(over_depth0(key))
        row["ms_per_token_by_round"] = [ms[key] for ms in rounds]
        print(f"{row['weights']:24} {row['kv_cache']:8} {row['kv_cache_mb']:7.1f} "
              + " ".join(f"{x:9.2f}" for x in row["ms_per_token"].values())
              + ("" if args.no_prefill else f" {row['prefill_tok_s']:13.1f} {row['prefill_peak_mb']:8.1f}"))
        print(f"{'':24} {'MBU':8} {'':7} " + " ".join(f"{x:9.0%}" for x in row["mbu"].values()))
        print(f"{'':24} {'KV GB/s':8} {'':7} " + " ".join(f"{x:9.1f}" if x else f"{'':9}"
                                                           for x in row["kv_gb_s"].values()))
        if row["own_cache"]:
            own = row["own_cache"]
            print(f"{'':33} depth {shallow} in a cache of {own['cache_positions']} positions: "
                  f"{own['ms_per_token']:.2f} ms (in the deep cache: "
                  f"{row['ms_per_token'][shallow] / own['ms_per_token']:.2f}x)")
    for peer, row in peers.items():
        row["ms_per_token"] = median(lambda ms, d: ms[peer][d])
        row["ms_per_token_by_round"] = [ms[peer] for ms in rounds]
        print(f"{row['weights']:24} {row['kv_cache']:8} {'':7} "
              + " ".join(f"{x:9.2f}" for x in row["ms_per_token"].values())
              + (f" {row['prefill_tok_s']:13.1f}" if "prefill_tok_s" in row else ""))
        for key, ours in rows.items():  # how many times faster ours decodes, each round's ratio's median
            ours.setdefault("speedup", {})[peer] = median(lambda ms, d: ms[peer][d] / ms[key][d])
            print(f"{'ours / ' + peer:24} {ours['kv_cache']:8} {'':7} "
                  + " ".join(f"{x:8.2f}x" for x in ours["speedup"][peer].values()))
    rows = list(rows.values()) + list(peers.values())
    if args.json:
        write_record(args, depths=depths, copy_bandwidth_gbs=bandwidth, rows=rows)


def decode_ms_at_depth(model: Transformer, depth: int, n: int, args, steps: decode.Steps) -> float:
    """Median ms per step of n decode steps after a random prompt of `depth` tokens (at least 1), each
    step as generate() takes it; every run starts again from the same depth."""
    prompt = torch.randint(0, model.config.vocab_size, (1, max(depth, 1)), device=args.device)
    length = torch.tensor([prompt.shape[1]], device=args.device)
    start = time.perf_counter()
    if args.no_prefill:  # the same steps, over random cache contents
        fill_at_random(model)
        first = torch.zeros((1, 1), dtype=torch.long, device=args.device)  # strides as prefill's token
    else:
        first = decode.prefill(model, prompt, length, steps)

    def decode_n():
        token = first
        for i in range(n):
            keys = decode.key_positions(model, prompt.shape[1] + i + 1)
            token = steps.decode_one_token(model, token, length[:, None] + i, keys)

    decode_n()  # compiles, the first time
    gen.synchronize(args.device)
    first_s = time.perf_counter() - start
    ms = statistics.median(timed(decode_n, args.device) for _ in range(args.runs)) / n * 1e3
    # a line as each depth is done, for a run cut short (a lent GPU's minutes) and to show compile time
    what = "cache filled at random and first pass" if args.no_prefill else "first prefill and pass"
    print(f"  {model.kv_cache_dtype or 'model dtype'} cache, depth {depth}: {ms:.2f} ms/token ({what} "
          f"{first_s:.1f} s, compiling included)", flush=True)
    return ms


def llama_cpp_ms(args, depths: list[int], n: int) -> dict[int, float]:
    """llama.cpp's decode ms/token after each depth, through llama-cpp-python on as many threads as ours
    (its default KV cache, f16): a random prompt of that depth evaluated once, untimed, then n one-token
    steps from that depth, each run (the cache past the depth is dropped before each)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise UserError("--llama-cpp needs llama-cpp-python: pip install llama-cpp-python")
    llm = Llama(str(args.gguf or bundled_gguf()), n_ctx=depths[-1] + n + 1, n_batch=512,
                n_threads=torch.get_num_threads(), verbose=False)
    generator = torch.Generator().manual_seed(0)
    ms = {}
    for depth in depths:
        prompt = torch.randint(0, llm.n_vocab(), (max(depth, 1),), generator=generator).tolist()
        steps = torch.randint(0, llm.n_vocab(), (n,), generator=generator).tolist()  # the tokens each step takes
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - start

        def decode_n():
            llm.n_tokens = len(prompt)  # back to the depth: eval drops the cache past it
            for token in steps:
                llm.eval([token])

        decode_n()
        ms[depth] = statistics.median(timed(decode_n, "cpu") for _ in range(args.runs)) / n * 1e3
        print(f"  llama.cpp, depth {depth}: {ms[depth]:.2f} ms/token (prompt {prefill_s:.1f} s)", flush=True)
    return ms


def fill_at_random(model: Transformer):
    """Random keys and values in every cache slot (levels and scales for a scaled cache), for decode
    steps timed without a prefill."""
    for layer in model.layers:
        for name, buffer in layer.attention.kv_cache.named_buffers():
            if name.endswith("scales"):
                buffer.uniform_(0.01, 0.02)
            elif buffer.dtype == torch.int8:
                buffer.random_(-127, 128)
            else:
                buffer.copy_(torch.randn(buffer.shape, device=buffer.device))


def prefill_at_depth(model: Transformer, depth: int, args, steps: decode.Steps) -> tuple[float, float]:
    """Prefill tok/s of a random prompt of `depth` tokens (median of runs), and the most memory it took
    beyond what was held before it (MB): activations, bounded by the chunk whatever the prompt."""
    prompt = torch.randint(0, model.config.vocab_size, (1, depth), device=args.device)
    length = torch.tensor([depth], device=args.device)
    decode.prefill(model, prompt, length, steps)  # compiles, the first time
    before = memory_in_use(args.device, reset_peak=True)
    seconds = statistics.median(timed(lambda: decode.prefill(model, prompt, length, steps), args.device)
                                for _ in range(args.runs))
    return depth / seconds, (memory_in_use(args.device, peak=True) - before) / 1e6


def memory_in_use(device: str, peak: bool = False, reset_peak: bool = False) -> int:
    """Bytes the device's memory holds now (on CPU, the process's resident set), or the most it held
    since the last reset_peak."""
    if device.startswith("cuda"):
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
        return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    if reset_peak:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: the peak resident set (VmHWM) starts again from now
    field = "VmHWM" if peak else "VmRSS"
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(field))) * 1024


def kv_cache_bytes(model: Transformer) -> int:
    return sum(buffer.nbytes for layer in model.layers for buffer in layer.attention.kv_cache.buffers())


def bytes_read_per_step(model: Transformer, depth: int, n: int) -> float:
    """The fewest bytes a decode step reads, on average over n steps after `depth` tokens: the weights
    once, and the keys, values (and their scales) of the positions it attends to (a ring's at most)."""
    positions = depth + (n + 1) / 2
    kv = 0.0
    for layer in model.layers:
        cache = layer.attention.kv_cache
        slots = cache.k_cache.shape[2]
        kv += sum(buffer.nbytes for buffer in cache.buffers()) / slots * min(positions, slots)
    return gen.weight_bytes_per_token(model) + kv


if __name__ == "__main__":
    p = model_arguments(__doc__)
    p.add_argument("--depths", nargs="+", type=int, required=True, metavar="D",
                   help="context depths: decode ms/token after D tokens, for each D (and prefill of the deepest)")
    p.add_argument("--kv_cache_dtype", nargs="+", choices=gen.KV_CACHE_DTYPES, default=["bf16"],
                   help="the KV cache formats to measure")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure everything this many times in turn (ours, then llama.cpp) and give each figure's "
                        "median, each ratio's taken within a round: for a machine whose speed drifts")
    p.add_argument("--no-own-cache", action="store_true",
                   help="skip the first depth's run in a cache sized for it (two compiles a format)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also llama.cpp through llama-cpp-python on --gguf (default: the bundled model's GGUF)")
    p.add_argument("--no-prefill", action="store_true",
                   help="decode over random cache contents, no prompt prefilled (a step's cost is the same; on a "
                        "GPU, compiling the 8B's prefill took 169 s) and no prefill row")
    args = p.parse_args()
    if args.gguf and not (args.model or args.checkpoint_path):  # ours on the file llama.cpp runs
        args.checkpoint_path = args.gguf
    check_model_arguments(args)
    if args.llama_cpp and (args.model or args.checkpoint_path) and not args.gguf:
        refuse("--llama-cpp measures the bundled model's GGUF unless --gguf names this model's")
    if args.rounds < 1:
        refuse("--rounds takes 1 or more")
    if min(args.depths) < 0 or max(args.depths) == 0:
        refuse("--depths takes context depths, each 0 or more, the deepest above 0")
    run_cli(depths_main, args)
