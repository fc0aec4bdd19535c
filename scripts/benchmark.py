"""Decode speed, side by side in one run: our eager and compiled decoding, HF transformers' `generate`
on the same weights, and the model's matmul floor.

    python scripts/benchmark.py                                  # the bundled SmolLM2-135M-Instruct, bf16
    python scripts/benchmark.py --quantized checkpoints/X/model_int8.safetensors checkpoints/X/model_int4.g32.safetensors
    python scripts/benchmark.py --model Llama-3.1-8B --random-weights --device cuda --json out.json
    python scripts/benchmark.py --speculative [--draft_checkpoint_path DRAFT]   # drafters on real prompts

The floor is the summed time of the model's weight matmuls at one row (F.linear on each weight shape,
with enough copies of each weight that none stays in cache) plus the output head: what a decode step
would cost if nothing but reading the weights took time.
"""

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

import generate as gen
from checkpoint import fused_parts, hf_names
from model import ModelArgs, Transformer


def timed(fn, device) -> float:
    gen.synchronize(device)
    t0 = time.perf_counter()
    fn()
    gen.synchronize(device)
    return time.perf_counter() - t0


def decode_ms_per_token(run, n_new: int, runs: int, device: str) -> tuple[float, float, float]:
    """Median ms per decoded token, from run(n_new) - run(1) so prefill does not count; tok/s of
    the whole run(n_new) as a user sees it; and ms to the first token (run(1): prefill and sampling).
    The first calls (warm-up, compilation) are not counted."""
    run(n_new), run(1)
    full = [timed(lambda: run(n_new), device) for _ in range(runs)]
    first = [timed(lambda: run(1), device) for _ in range(runs)]
    per_token = (statistics.median(full) - statistics.median(first)) / (n_new - 1)
    return per_token * 1e3, n_new / statistics.median(full), statistics.median(first) * 1e3


def copy_bandwidth_gbs(device: str, nbytes: int = 512 << 20) -> float:
    """What the device's memory really moves: bytes read plus written by a large copy, median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / statistics.median(timed(lambda: dst.copy_(src), device) for _ in range(5)) / 1e9


def matmul_floor_ms(model: Transformer, device: str, linear=F.linear, cache_bytes: int = 256 << 20) -> float:
    """Summed linear(x, w) time at M=1 over every weight of the model, each shape timed on rotating
    copies that together exceed the caches."""
    shapes = Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear))
    dtype = model.output.weight.dtype
    total = 0.0
    for (n, k), count in shapes.items():
        copies = max(2, min(64, cache_bytes // (n * k * dtype.itemsize)))
        weights = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(copies)]
        x = torch.randn(1, k, dtype=dtype, device=device)
        iters = max(20, 4 * copies)
        for w in weights:
            linear(x, w)
        seconds = timed(lambda: [linear(x, weights[i % copies]) for i in range(iters)], device) / iters
        total += count * seconds
    return total * 1e3


def hf_model_from(model: Transformer):
    """HF transformers' LlamaForCausalLM holding the same weights (split back into q/k/v, gate/up)."""
    import transformers

    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_local_heads,
        head_dim=c.head_dim, max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_base, rope_scaling=c.rope_scaling, tie_word_embeddings=c.tie_embeddings)
    weight = model.output.weight
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config)
    # the inverse of our conversion: each of our tensors split into the HF tensors it was made of
    state, ours, sizes = {"lm_head.weight": model.output.weight}, model.state_dict(), fused_parts(c)
    for name, parts in hf_names(c).items():
        state.update(zip(parts, ours[name].split(sizes.get(".".join(name.split(".")[2:4]), [len(ours[name])]))))
    hf.load_state_dict({k: v.contiguous() for k, v in state.items()}, assign=True, strict=False)
    with torch.device(weight.device):  # its buffers were made on meta
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)
    return hf.to(weight.dtype).eval()


def load(args) -> Transformer:
    if args.model:
        with torch.device(args.device):  # random weights built where they run: no host copy of a 70B
            model = Transformer(ModelArgs.from_name(args.model))
        return model.to(gen.PRECISIONS[args.precision]).eval()
    return gen.load_model(args.checkpoint_path, args.device, args.precision)


@torch.no_grad()
def main(args):
    torch.manual_seed(0)
    model = load(args)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_length,), device=args.device)
    n_new = args.max_new_tokens
    rows = {}  # name -> (ms per token, tok/s, weight bytes per token)

    def measure(name: str, m: Transformer):
        run = lambda n: gen.generate(m, prompt, n, temperature=0)  # noqa: E731
        ms, tok_s, ttft = decode_ms_per_token(run, n_new, args.runs, args.device)
        rows[name] = (ms, tok_s, gen.weight_bytes_per_token(m), ttft)

    bandwidth = copy_bandwidth_gbs(args.device)
    floor = matmul_floor_ms(model, args.device)
    rows["matmul floor (F.linear)"] = (floor, 1e3 / floor, gen.weight_bytes_per_token(model), None)
    if args.device == "cpu":  # what compiled decoding uses on CPU instead (generate.CPUDecodeLinear)
        ms = matmul_floor_ms(model, args.device, torch.compile(gen.one_row_linear))
        rows["floor (compiled mul-sum)"] = (ms, 1e3 / ms, gen.weight_bytes_per_token(model), None)
    measure(f"ours {args.precision} eager", model)
    if not args.no_hf:
        hf = hf_model_from(model)
        run = lambda n: hf.generate(prompt[None], max_new_tokens=n, min_new_tokens=n, do_sample=False,  # noqa: E731
                                    pad_token_id=0)
        ms, tok_s, ttft = decode_ms_per_token(run, n_new, args.runs, args.device)
        rows[f"HF {args.precision} eager"] = (ms, tok_s, gen.weight_bytes_per_token(model), ttft)
        if args.hf_compile:  # HF's own fast path: a static cache and a compiled forward
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
            run = lambda n: hf.generate(prompt[None], max_new_tokens=n, min_new_tokens=n, do_sample=False,  # noqa: E731
                                        pad_token_id=0, cache_implementation="static")
            ms, tok_s, ttft = decode_ms_per_token(run, n_new, args.runs, args.device)
            rows[f"HF {args.precision} static cache + compile"] = (ms, tok_s, gen.weight_bytes_per_token(model), ttft)
        del hf
    gen.compile_functions()
    gen.use_cpu_decode_modules(model)
    compile_s = timed(lambda: gen.generate(model, prompt, n_new, temperature=0), args.device)
    measure(f"ours {args.precision} compiled", model)
    for path in args.quantized:
        quantized = gen.load_model(path, args.device, args.precision)
        gen.use_cpu_decode_modules(quantized)
        measure(f"ours {Path(path).stem} compiled", quantized)
        del quantized

    print(f"\n{args.model or args.checkpoint_path or 'bundled SmolLM2-135M-Instruct'}, {args.precision}, "
          f"{args.device}, prompt {args.prompt_length} tokens, {n_new} new, median of {args.runs}; "
          f"first compiled run {compile_s:.1f} s")
    hf_ms = rows.get(f"HF {args.precision} eager", (None,))[0]
    print(f"measured copy bandwidth {bandwidth:.1f} GB/s; MBU = weight GB/s / that; "
          f"peak memory {gen.peak_memory_gb(args.device):.2f} GB")
    print(f"{'':32} {'ms/token':>9} {'tok/s':>7} {'GB/s':>6} {'MBU':>5} {'TTFT ms':>8} {'x floor':>8} {'vs HF':>6}")
    for name, (ms, tok_s, nbytes, ttft) in rows.items():
        vs_hf = f"{hf_ms / ms:6.2f}" if hf_ms else ""
        gbs = nbytes / ms / 1e6
        ttft = f"{ttft:8.1f}" if ttft else " " * 8
        print(f"{name:32} {ms:9.2f} {tok_s:7.1f} {gbs:6.1f} {gbs / bandwidth:5.0%} {ttft} {ms / floor:8.2f} {vs_hf}")
    if args.json:
        write_json(args, compile_s=compile_s, copy_bandwidth_gbs=bandwidth,
                   peak_memory_gb=gen.peak_memory_gb(args.device),
                   rows={name: dict(ms_per_token=ms, tok_s=tok_s, weight_bytes=nbytes, ttft_ms=ttft)
                         for name, (ms, tok_s, nbytes, ttft) in rows.items()})


# Prompts for speculative decoding: prompt lookup pays where the answer copies from the input
SPECULATIVE_PROMPTS = {
    "open-ended": "Write a short story about a dragon who learns to paint.",
    "extract": "List every number that appears in this text, in order:\n\n{readme}",
    "code-edit": "Rename the variable `config` to `cfg` in this code and print the whole code:\n```python\n{code}\n```",
}


@torch.no_grad()
def speculative_main(args):
    """Plain decoding against each drafter, compiled, on real prompts; acceptance and speedup."""
    import speculative

    model = gen.load_model(args.checkpoint_path, args.device, args.precision)
    tokenizer = gen.get_tokenizer(args.checkpoint_path)
    drafters = {"prompt-lookup": dict(draft="prompt-lookup")}
    if args.draft_checkpoint_path:
        drafters["draft model"] = dict(draft_model=gen.load_model(args.draft_checkpoint_path, args.device,
                                                                  args.precision))
    for m in [model] + [d["draft_model"] for d in drafters.values() if "draft_model" in d]:
        gen.use_cpu_decode_modules(m)
    gen.compile_functions()
    speculative.compile_functions()
    here = Path(__file__).parent.parent
    fill = dict(readme=(here / "README.md").read_text()[3000:4500], code=(here / "model.py").read_text()[2000:3500])
    print(f"\n{args.checkpoint_path or 'bundled SmolLM2-135M-Instruct'}, {args.precision}, {args.device}, "
          f"{args.max_new_tokens} new tokens, greedy, k={args.speculate_k}, median of {args.runs}")
    print(f"{'prompt':12} {'drafter':14} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7}  acceptance")
    rows = []
    for name, text in SPECULATIVE_PROMPTS.items():
        prompt = torch.tensor(tokenizer.encode_prompt(text.format(**fill), chat=True), device=args.device)

        def run(**kw):
            gen.generate(model, prompt, args.max_new_tokens, temperature=0, speculate_k=args.speculate_k, **kw)

        run()
        plain = statistics.median(timed(run, args.device) for _ in range(args.runs))
        for drafter, kwargs in drafters.items():
            run(**kwargs)
            spec = statistics.median(timed(lambda: run(**kwargs), args.device) for _ in range(args.runs))
            stats = {}
            run(**kwargs, stats=stats)
            n = args.max_new_tokens
            print(f"{name:12} {drafter:14} {n / plain:11.1f} {n / spec:10.1f} {plain / spec:7.2f}  "
                  f"{speculative.format_stats(stats, args.speculate_k)}")
            rows.append(dict(prompt=name, drafter=drafter, plain_tok_s=n / plain, speculative_tok_s=n / spec,
                             speedup=plain / spec, **stats))
    if args.json:
        write_json(args, rows=rows)


def write_json(args, **results):
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), command=" ".join(sys.argv),
                  torch=torch.__version__, threads=torch.get_num_threads(),
                  hardware=torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name(),
                  **results, args=vars(args))
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", default=None, help="default: the bundled model")
    p.add_argument("--model", default=None, help="a known shape (model.transformer_configs), with --random-weights")
    p.add_argument("--random-weights", action="store_true", help="random weights of --model's shape")
    p.add_argument("--device", default=gen.default_device())
    p.add_argument("--precision", choices=gen.PRECISIONS, default="bf16")
    p.add_argument("--prompt_length", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quantized", nargs="*", default=[], metavar="PATH",
                   help="quantized checkpoints (quantize.py) to measure in the same run")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    p.add_argument("--hf-compile", action="store_true",
                   help="also HF with its static cache and a compiled forward (compiling takes minutes on CPU)")
    p.add_argument("--speculative", action="store_true",
                   help="instead: plain decoding against prompt lookup (and --draft_checkpoint_path) on real prompts")
    p.add_argument("--draft_checkpoint_path", default=None, help="a draft model for --speculative")
    p.add_argument("--speculate_k", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args()
    if bool(args.model) != args.random_weights:
        p.error("--model and --random-weights go together")
    gen.run_cli(speculative_main if args.speculative else main, args)
