"""The speed ladder, side by side in one run and printed as one table: the model's matmul floor,
HF transformers' `generate` on the same weights (eager, and with its static cache + torch.compile),
our eager and compiled decoding, quantized (int8, int4, GPTQ), speculative, and tensor parallel;
tok/s, GB/s of weights read, MBU against the device's measured copy bandwidth, time to first token,
compile time and peak memory.

    python scripts/benchmark.py --hf-compile --quantized checkpoints/X/fastllama_int8.safetensors checkpoints/X/fastllama_int4.g32.safetensors
    python scripts/benchmark.py --model Llama-3.1-8B --random-weights --device cuda --hf-compile --quantized int8 int4 --json out.json
    python scripts/benchmark.py --llama-bench PATH/llama-bench    # llama.cpp on the bundled GGUF, in the same table
    python scripts/benchmark.py --model Llama-3.1-8B --random-weights --gpt-fast PATH   # gpt-fast's code beside ours
    python scripts/benchmark.py --speculative [--draft_checkpoint_path DRAFT]   # instead: drafters on three prompts
    python scripts/plot_ladder.py out.json ladder.png

Random weights (--model NAME --random-weights) are built on the device and quantized in memory:
decode time does not depend on the values. Speculative rungs need real weights (acceptance does).
The floor is the summed time of the model's weight matmuls at one row (F.linear on each weight shape,
with enough copies of each weight that none stays in cache): what a decode step would cost if
nothing but reading the weights took time.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, installed or not
sys.path.insert(1, str(Path(__file__).resolve().parent))  # peers.py beside this file, when the tests load it

import apart  # noqa: E402
import peers  # noqa: E402
from ladder_models import (dense_twin, full_config, hf_model_from, in_memory, load, quantized_copy,  # noqa: E402
                           quantized_models, resident_bytes, scheme_of)
from fastllama import cpu_decode, decode, generate as gen, quantize, speculative, tp  # noqa: E402
from shapes import shape  # noqa: E402
from fastllama.checkpoint import read_metadata, write_json  # noqa: E402
from fastllama.convert import bundled_gguf  # noqa: E402
from fastllama.errors import UserError, refuse, run_cli  # noqa: E402
from fastllama.model import ModelArgs, Transformer  # noqa: E402
from fastllama.moe import MoEFeedForward  # noqa: E402


def timed(fn, device) -> float:
    gen.synchronize(device)
    t0 = time.perf_counter()
    fn()
    gen.synchronize(device)
    return time.perf_counter() - t0


def compiled_apart():
    """decode_one_token compiled as generate.py compiles it, under a code object of its own, for an A/B run of
    two models or kernels in one process: dynamo keeps one code object's graphs together and tries the newest
    first, so that through one compiled step the other side would pay for those guards failing before its own
    pass (a few percent of a small model's CPU step: benchmarks/RESULTS.md, "Rounds of ours and llama-bench in
    turn; A/B runs through one compiled step")."""
    f = decode.decode_one_token
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return gen.copied_out(torch.compile(own, mode="reduce-overhead", fullgraph=True, dynamic=False))


def decode_speed(full: list[float], first: list[float], n_new: int) -> dict:
    """From the seconds of runs of n_new tokens and of 1 (prefill and sampling): median ms per decoded token,
    (full - first) / (n_new - 1), so prefill does not count; tok/s of the whole run as a user sees it; and ms
    to the first token; and the runs' seconds, as measured."""
    runs = dict(full_s=list(full), first_s=list(first))
    full, first = statistics.median(full), statistics.median(first)
    return dict(ms_per_token=(full - first) / (n_new - 1) * 1e3, e2e_tok_s=n_new / full, ttft_ms=first * 1e3, **runs)


def copy_bandwidth_gbs(device: str, nbytes: int = 512 << 20) -> float:
    """What the device's memory really moves: bytes read plus written by a large copy, median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / statistics.median(timed(lambda: dst.copy_(src), device) for _ in range(5)) / 1e9


def matmul_floor_ms(model: Transformer, device: str, linear=F.linear, cache_bytes: int = 256 << 20) -> float:
    """Summed linear(x, w) time at M=1 over every weight of the model that a step reads (of a MoE
    layer's experts, the active ones), each shape timed on rotating copies that together exceed the caches."""
    shapes = Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear))
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            for experts in (m.w13, m.w2):
                shapes[tuple(experts.weight.shape[1:])] += m.top_k
    dtype = model.output.weight.dtype
    total = 0.0
    for (n, k), count in shapes.items():
        copies = max(2, -(-cache_bytes // (n * k * dtype.itemsize)) + 1)  # more than the caches hold, however small
        weights = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(copies)]
        x = torch.randn(1, k, dtype=dtype, device=device)
        iters = max(20, 4 * copies)
        for w in weights:
            linear(x, w)
        seconds = timed(lambda: [linear(x, weights[i % copies]) for i in range(iters)], device) / iters
        total += count * seconds
    return total * 1e3


def ladder_prompt(args) -> tuple[Tensor, str]:
    """Random tokens for random weights; for real weights the extraction prompt below, where
    speculative decoding is meant to pay, so that every rung decodes the same text."""
    if args.model:
        vocab = shape(args.model).vocab_size
        return torch.randint(0, vocab, (args.prompt_length,), device=args.device), "random tokens"
    tokenizer = gen.get_tokenizer(args.checkpoint_path)
    text = SPECULATIVE_PROMPTS["extract"]
    return torch.tensor(tokenizer.encode_prompt(text, chat=tokenizer.can_chat), device=args.device), "extract"


class Ladder:
    """The table: name -> decode_speed()'s figures, the seconds of the rung's first run (compiling included),
    weight bytes read a step, the model's memory, a note."""

    def __init__(self, args, prompt: Tensor):
        self.args, self.prompt, self.rows, self.runs = args, prompt, {}, {}

    def wants(self, name: str) -> bool:
        """Whether the rung `name` is to be made (a OneRung makes one)."""
        return True

    def add(self, name: str, run, holder: torch.nn.Module, weight_bytes: int | None, note: str = ""):
        """A rung, run(n) decoding n tokens with the model `holder`: its first run now (where it compiles),
        its timed runs in measure()."""
        args = self.args
        first_run_s = timed(lambda: run(args.max_new_tokens), args.device)
        run(1)
        self.runs[name] = run
        self.rows[name] = dict(first_run_s=first_run_s, weight_bytes=weight_bytes, note=note,
                               memory_gb=resident_bytes(holder) / 1e9)
        print(f"{name}: first run {first_run_s:.1f} s", flush=True)

    def measure(self):
        """Every rung's timed runs, a round at a time with each rung once a round, so that a drift in the
        machine's speed (clocks, heat, another process) falls on all of them alike."""
        args, times = self.args, {name: ([], []) for name in self.runs}
        for _ in range(args.runs):
            for name, run in self.runs.items():
                times[name][0].append(timed(lambda: run(args.max_new_tokens), args.device))
                times[name][1].append(timed(lambda: run(1), args.device))
        for name, (full, first) in times.items():
            self.rows[name].update(decode_speed(full, first, args.max_new_tokens))

    def ours(self, name: str, model: Transformer, note: str = "", steps: decode.Steps = decode.EAGER, **kw):
        """generate() greedy on the ladder's prompt with steps; kw: speculative arguments."""
        run = lambda n: gen.generate(model, self.prompt, n, temperature=0, steps=steps, **kw)  # noqa: E731
        # a speculative step reads the weights for several tokens: bytes per token are not the model's
        self.add(name, run, model, None if kw else gen.weight_bytes_per_token(model), note)

    def compiled(self, model: Transformer, suffix: str = "", rank: int = 0, world: int = 1, config=None):
        """Our compiled rungs: the model, then each quantized one unless --skip quantized (config: the model's
        whole shape)."""
        args, steps = self.args, gen.compiled_steps()
        if self.wants(rung := f"ours {args.precision} compiled{suffix}"):
            self.ours(rung, model, steps=steps)
        if "quantized" not in args.skip:
            for name, make in quantized_models(args, model, rank, world, config).items():
                if self.wants(rung := f"ours {name} compiled{suffix}"):
                    self.ours(rung, make(), steps=steps)


class OneRung(Ladder):
    """The ladder of the one rung that --rung names, in a child process of --apart (scripts/apart.py): made
    when the parent says so, compiled at once, then timed a run at a time when the parent asks."""

    def __init__(self, args, prompt: Tensor, base: Transformer, channel: apart.Channel):
        super().__init__(args, prompt)
        self.base, self.channel = base, channel

    def wants(self, name: str) -> bool:
        return name == self.args.rung

    def add(self, name: str, run, holder: torch.nn.Module, weight_bytes: int | None, note: str = ""):
        args = self.args
        apart.release(self.base, keep=holder)  # the rung's own weights stay, the unquantized ones it made them from go
        self.channel.say("built")
        super().add(name, run, holder, weight_bytes, note)  # its first run, which compiles
        self.channel.say("ready", **self.rows[name])
        while self.channel.heard("run"):
            full = timed(lambda: run(args.max_new_tokens), args.device)
            self.channel.say("times", full=full, first=timed(lambda: run(1), args.device))


def one_rung(args):
    """--rung NAME: a child of --apart, which makes the rung when told to (the parent's turns keep one
    unquantized model at a time beyond what the rungs keep) and answers the parent's rounds."""
    channel = apart.Channel()
    if not channel.heard("build"):
        return
    torch.manual_seed(0)  # the prompt and the weights of the parent's and every child's
    prompt, _ = ladder_prompt(args)
    model = load(args)
    gf = peers.load_gpt_fast(args.gpt_fast) if args.gpt_fast else None
    ladder = OneRung(args, prompt, model, channel)
    ladder.compiled(model)
    if gf:
        gpt_fast_rows(ladder, model, gf)
    if not ladder.rows:
        raise UserError(f"--rung {args.rung}: no such compiled rung in this ladder")


def compiled_rungs(args) -> list[str]:
    """The names of the ladder's compiled rungs (not the dense twin's), in the table's order."""
    names = [f"ours {args.precision} compiled"]
    if "quantized" not in args.skip:
        names += [f"ours {name} compiled" for name in quantized_models(args, None)]
    return names + (list(gpt_fast_models(args, None, None, 0)) if args.gpt_fast else [])


def rungs_apart(args) -> dict[str, list[str]]:
    """--apart's children, a command a compiled rung, in the order they make their models: the quantized
    ones first, while the others hold little, the unquantized last."""
    me = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
    names = sorted(compiled_rungs(args), key=lambda name: f" {args.precision} " in name)
    return {name: [*me, "--rung", name] for name in names}


def rows_apart(args, said: dict) -> dict:
    """The table's rows of --apart's children that did not fail."""
    rows = {}
    for name in compiled_rungs(args):
        figures = said[name]
        if "error" not in figures:
            rows[name] = dict(figures, **decode_speed(figures["full_s"], figures["first_s"], args.max_new_tokens))
    return rows


@torch.no_grad()
def main(args):
    if "LOCAL_RANK" in os.environ:  # a rank of tp_rows' torchrun
        return tp_worker(args)
    if args.rung:
        return one_rung(args)
    if args.apart:  # before this process puts anything on the device
        said = apart.measure(rungs_apart(args), args.runs)
    torch.manual_seed(0)  # then the prompt and the weights, in the order tp_worker takes them
    prompt, prompt_name = ladder_prompt(args)
    model = load(args)
    # loaded before any of ours compiles, so that what its import sets is seen against torch's own settings
    gf = peers.load_gpt_fast(args.gpt_fast) if args.gpt_fast else None
    schemes = [scheme_of(args, q) for q in args.quantized]
    groupsizes = {None} | {scheme.groupsize for scheme in schemes if scheme}
    if args.tp is None:  # every GPU of the machine, where the model and its int4 copies split so many ways
        gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
        args.tp = [gpus] if gpus > 1 and splits(model.config, gpus, groupsizes) else []
    for world in args.tp:  # before minutes of measuring, not after
        check_splits(model.config, world, groupsizes)
    ladder = Ladder(args, prompt)
    rows = ladder.rows
    bandwidth = copy_bandwidth_gbs(args.device)
    weight_bytes = gen.weight_bytes_per_token(model)
    floor = matmul_floor_ms(model, args.device)
    rows["matmul floor (F.linear)"] = dict(ms_per_token=floor, weight_bytes=weight_bytes)
    if args.device == "cpu":  # what compiled decoding uses on CPU instead (cpu_decode.py)
        ms = matmul_floor_ms(model, args.device, torch.compile(cpu_decode.one_row_product))
        rows["floor (compiled mul-sum)"] = dict(ms_per_token=ms, weight_bytes=weight_bytes)
    failed = {}
    if args.apart:
        failed = {name: figures["error"] for name, figures in said.items() if "error" in figures}
        rows.update(rows_apart(args, said))
        peer = peers.describe(gf) if gf else None
    else:
        peer = measure_in_process(ladder, model, gf)
    for world in args.tp:
        rows.update(tp_rows(args, world))

    peak = gen.peak_memory_gb(args.device)
    print(f"\n{args.model or args.checkpoint_path or 'bundled SmolLM2-135M-Instruct'}, {args.precision}, "
          f"{args.device}, prompt: {prompt_name} ({len(prompt)} tokens), {args.max_new_tokens} new (stop tokens "
          f"ignored), greedy, "
          f"median of {args.runs}; measured copy bandwidth {bandwidth:.1f} GB/s (MBU = weight GB/s / that); "
          f"peak memory {peak:.2f} GB" + (" (this process; --apart: each compiled rung in a process of its own, "
                                          "their first runs compiling side by side)" if args.apart else ""))
    print_table(rows, bandwidth, floor)
    for name, error in failed.items():
        print(f"{name}: failed, {error}")
    if peer:
        print(f"gpt-fast: {peer['path']}; its rows compiled with what its generate.py sets at import "
              f"{peer['compile_settings']}; its code changed for PyTorch {torch.__version__}:"
              + "".join(f"\n  - {change}" for change in peer["changes"]))
    if args.json:
        write_record(args, prompt=prompt_name, prompt_tokens=len(prompt), copy_bandwidth_gbs=bandwidth,
                   peak_memory_gb=peak, rows=rows, gpt_fast=peer, failed=failed)


def measure_in_process(ladder: Ladder, model: Transformer, gf: peers.GptFast | None) -> dict | None:
    """Every rung the arguments ask for, made and measured in this process; returns what peers.describe says
    of gpt-fast, where it is there."""
    args, rows = ladder.args, ladder.rows
    if not args.no_hf:
        hf_rows(ladder, model)
    if args.llama_bench:
        rows["llama.cpp (llama-bench) on the GGUF"] = llama_bench(args, len(ladder.prompt))
    if "eager" not in args.skip:
        ladder.ours(f"ours {args.precision} eager", model)
    ladder.compiled(model)
    peer = gpt_fast_rows(ladder, model, gf) if gf else None
    if args.dense_twin:
        twin = dense_twin(model.config, args)
        ladder.compiled(twin, " (dense twin)", config=twin.config)
        del twin
    if not args.model and not args.no_speculative:  # acceptance needs real weights
        speculative_rows(ladder, model)
    ladder.measure()
    return peer


def hf_rows(ladder: Ladder, model: Transformer):
    """HF transformers' generate on the same weights: eager, and with its static cache + compile."""
    import transformers

    args, prompt = ladder.args, ladder.prompt[None]
    hf = hf_model_from(model)
    kw = dict(do_sample=False, pad_token_id=0)
    ladder.add(f"HF {args.precision} eager", lambda n: hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw),
               hf, gen.weight_bytes_per_token(model))
    if args.hf_compile:  # HF's own fast path: a static cache, and generate compiles its decoding forward itself
        # (compiling hf.forward by hand put prefill under CUDA graphs too, whose outputs the first decoding
        # replay overwrote: results/h100-cuda-tests-speculative.txt)
        compile_config = transformers.CompileConfig(fullgraph=True)  # mode reduce-overhead: CUDA graphs on a GPU
        compile_config._compile_all_devices = True  # else HF compiles on accelerators only, not on CPU
        kw.update(cache_implementation="static", compile_config=compile_config)
        ladder.add(f"HF {args.precision} static cache + compile",
                   lambda n: hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw),
                   hf, gen.weight_bytes_per_token(model))


def gpt_fast_rows(ladder: Ladder, model: Transformer, gf: peers.GptFast) -> dict:
    """gpt-fast's own code on the same weights (scripts/peers.py), compiled as its main() compiles: the model,
    then each of --quantized int8 / int4 quantized by its own handlers. Returns what peers.describe says of it."""
    for rung, make in gpt_fast_models(ladder.args, model, gf, len(ladder.prompt)).items():
        if ladder.wants(rung):
            theirs = make()
            ladder.add(rung, peers.runner(gf, theirs, ladder.prompt), theirs, peers.weight_bytes_per_token(theirs))
    return peers.describe(gf)


def gpt_fast_models(args, model: Transformer | None, gf: peers.GptFast | None, prompt_length: int) -> dict:
    """Rung name -> make() of gpt-fast's model: of --precision, then of each of --quantized int8 / int4."""
    length = prompt_length + args.max_new_tokens
    makers = {f"gpt-fast {args.precision} compiled": lambda: peers.gpt_fast_model(gf, model, length)}
    for q in [q for q in args.quantized if q in ("int8", "int4")]:  # not checkpoints: it quantizes its own
        name = f"int4 g{args.groupsize}" if q == "int4" else q
        makers[f"gpt-fast {name} compiled"] = lambda q=q: peers.gpt_fast_quantized(gf, model, q, args.groupsize,
                                                                                    length)
    return makers


def speculative_rows(ladder: Ladder, model: Transformer):
    """Compiled decoding with each drafter on the ladder's prompt, and how much of each draft it kept."""
    args, steps = ladder.args, gen.compiled_steps()
    for name, kw in drafters(args, model).items():
        stats, rung = {}, f"ours {args.precision} compiled + {name}"
        first_run_s = timed(lambda: gen.generate(model, ladder.prompt, args.max_new_tokens, stats=stats,
                                                 speculate_k=args.speculate_k, steps=steps, **kw),
                            args.device)  # compiles
        ladder.ours(rung, model, steps=steps, speculate_k=args.speculate_k,
                    note=f"k={args.speculate_k}, {speculative.acceptance_rate(stats, args.speculate_k):.0%} of "
                         f"drafts kept", **kw)
        ladder.rows[rung]["first_run_s"] = first_run_s  # the run that compiled, as every rung's


def drafters(args, target: Transformer) -> dict:
    """generate()'s speculative arguments for each drafter: prompt lookup, the draft head trained for
    the target (--draft_head, or the one beside its checkpoint), and --draft_checkpoint_path's model;
    with --draft_alternatives, each model drafter also drafting as a tree."""
    found = {"prompt lookup": dict(drafter=speculative.PromptLookup())}

    def model_drafter(name: str, make):  # make(m): the drafter with m alternatives; with --draft_alternatives, both
        found[name] = dict(drafter=make(0))
        if args.draft_alternatives:
            found[f"{name} +{args.draft_alternatives} alt."] = dict(drafter=make(args.draft_alternatives))

    head = args.draft_head or gen.find_checkpoint(args.checkpoint_path).parent / speculative.HEAD_NAME
    if args.draft_head or head.is_file():  # scripts/train_draft_head.py writes it there
        model_drafter("draft head", lambda m: speculative.head_drafter(head, target, m))
    if args.draft_checkpoint_path:
        draft_model = gen.load_model(args.draft_checkpoint_path, args.device, args.precision)
        name = Path(args.draft_checkpoint_path).stem.removeprefix("fastllama_")
        model_drafter(f"draft {name}", lambda m: speculative.DraftModel(draft_model, m))
    return found


def llama_bench(args, depth: int) -> dict:
    """llama.cpp's llama-bench on the GGUF: its decode test (tg) after `depth` tokens of context, as
    ours decodes after the prompt, on as many threads as we use."""
    result = llama_bench_json(args, "-p", "0", "-n", str(args.max_new_tokens), "-d", str(depth))[0]
    return dict(ms_per_token=1e3 / result["avg_ts"], weight_bytes=result["model_size"],
                note=f"{result['model_type']}, build {result['build_commit']}")


def llama_bench_json(args, *options: str) -> list[dict]:
    """llama-bench's JSON records for its runs on the GGUF, on as many threads as we use."""
    gguf = args.gguf or bundled_gguf()
    cmd = [args.llama_bench, "-m", str(gguf), *options, "-r", str(args.runs), "-t", str(torch.get_num_threads()),
           "-o", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise UserError(f"llama-bench failed on {gguf}: {(run.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(run.stdout)


def check_splits(config: ModelArgs, world: int, groupsizes: set):
    """One line, naming the world sizes that work, unless the model and its int4 copies of these group
    sizes split `world` ways."""
    for groupsize in groupsizes:
        tp.check_divisible(config, world, groupsize)


def splits(config: ModelArgs, world: int, groupsizes: set) -> bool:
    try:
        check_splits(config, world, groupsizes)
    except UserError:
        return False
    return True


def tp_rows(args, world: int) -> dict:
    """Our compiled rungs again with the model sharded `world` ways: torchrun runs this script, whose
    ranks run tp_worker, and rank 0 hands back its rows in a JSON file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={world}", __file__, *sys.argv[1:], "--json", str(out)])
        if run.returncode != 0:
            raise UserError(f"the TP {world} run failed: its error is printed above")
        return json.loads(out.read_text())["rows"]


@torch.no_grad()
def tp_worker(args):
    rank, world = tp.maybe_init_distributed(args.device)
    torch.manual_seed(0)  # the same random weights and prompt on every rank
    ladder = Ladder(args, ladder_prompt(args)[0])
    ladder.compiled(load(args, rank, world), f", TP {world}", rank, world)
    ladder.measure()
    for row in ladder.rows.values():
        row["note"] = "GB/s, MBU and memory: rank 0's slice"
    if rank == 0:
        write_record(args, rows=ladder.rows)
    torch.distributed.destroy_process_group()


def print_table(rows: dict, bandwidth: float, floor: float):
    """tok/s is decode only (1000 / ms per token); end to end counts prefill too, as a user waits.
    Memory: the model's weights, KV cache and RoPE tables. 1st run: compilation included."""
    hf_ms = next((row["ms_per_token"] for name, row in rows.items() if name.startswith("HF")), None)
    print(f"{'':44} {'ms/token':>9} {'tok/s':>7} {'GB/s':>6} {'MBU':>5} {'TTFT ms':>8} {'end to end':>10} "
          f"{'x floor':>8} {'vs HF':>6} {'mem GB':>6} {'1st run s':>9}")
    for name, row in rows.items():
        ms, nbytes = row["ms_per_token"], row.get("weight_bytes")
        gbs = f"{nbytes / ms / 1e6:6.1f} {nbytes / ms / 1e6 / bandwidth:5.0%}" if nbytes else " " * 12
        ttft, e2e, mem, first = (f"{row[k]:{w}.{d}f}" if row.get(k) else " " * w for k, w, d in (
            ("ttft_ms", 8, 1), ("e2e_tok_s", 10, 1), ("memory_gb", 6, 2), ("first_run_s", 9, 1)))
        vs_hf = f"{hf_ms / ms:6.2f}" if hf_ms else " " * 6
        print(f"{name:44} {ms:9.2f} {1e3 / ms:7.1f} {gbs} {ttft} {e2e} {ms / floor:8.2f} {vs_hf} {mem} {first}  "
              f"{row.get('note', '')}")


# Prompts for speculative decoding: prompt lookup pays where the answer copies from the input. Fixed
# texts, so that results do not move when the repository's files do.
REPORT = """The harbour of Velmora handled 4,812 ships in 2023, up from 4,377 in 2022. Its three container
terminals moved 1.26 million containers; the north terminal alone moved 540,000. Average waiting time
at anchor fell from 31 hours to 19 hours after the second dredging campaign, which cost 86 million euros
and deepened the channel to 14.5 metres. The port employs 2,940 people directly and about 11,000
indirectly. Passenger traffic reached 730,000 travellers on 6 ferry lines, and the cruise season ran
from 12 April to 28 October with 64 calls. The authority plans 2 new berths of 380 metres each by 2027."""

CODE = """def train(config, dataset):
    model = build_model(config.model_name, config.hidden_size)
    optimizer = make_optimizer(model, lr=config.learning_rate, weight_decay=config.weight_decay)
    for epoch in range(config.epochs):
        for batch in dataset.batches(config.batch_size):
            loss = model.loss(batch)
            loss.backward()
            if config.clip_grad:
                clip_gradients(model, config.clip_grad)
            optimizer.step()
            optimizer.zero_grad()
        print(f"epoch {epoch}: loss {loss.item():.3f}")
        if epoch % config.save_every == 0:
            save(model, config.output_dir, epoch)
    return model"""

SPECULATIVE_PROMPTS = {
    "open-ended": "Write a short story about a dragon who learns to paint.",
    "extract": f"List every number that appears in this text, in order, one per line:\n\n{REPORT}",
    "code-edit": f"Rename the variable `config` to `cfg` in this code and print the whole code:\n```python\n{CODE}\n```",
}


VERIFY_COSTS = ["target", "int8", "int4"]  # --verify-cost


class Foreseen(speculative.Drafter):
    """Drafts the very tokens the target's plain greedy decoding gave the prompt (text: the prompt and
    that answer, (L,)): every draft right while the speculative text stays the plain one (in bf16 a verify
    step's near-tie can go the other way, and the drafts after it are wrong: the acceptance says so). The
    most any drafter can give at this k, its own cost apart."""

    def __init__(self, text: Tensor):
        self.text = text

    def propose(self, tokens, lengths, k, **sampling):
        at = (lengths[:, None] + torch.arange(k, device=tokens.device)).clamp(max=len(self.text) - 1)
        return self.text[at], None


@torch.no_grad()
def speculative_main(args):
    """What a verify step costs against a plain step (--verify-cost: --precision's model, int8, int4),
    and (unless --verify-only) plain decoding against each drafter, compiled, on real prompts: acceptance
    and speedup, greedy and at each of --temperatures. Greedy, the drafters include "foreseen" (Foreseen):
    the most a drafter can give. With --model (random weights) the prompt is --prompt_length random
    tokens, and foreseen is the one drafter (the others' acceptance needs real weights). The target's
    verify cost comes first, then the decoding, which runs the same graphs, then the quantized models'
    verify costs (each compiles its own): a GPU call that runs out of time has the most in its record."""
    model = load(args)
    steps = gen.compiled_steps()
    # a graph per model, cache length and sampling setting: more than dynamo's default of 8 a function
    torch._dynamo.config.recompile_limit = 64
    drafts = {} if args.model else drafters(args, model)
    if args.model:
        prompts = {"random": torch.randint(model.config.vocab_size, (args.prompt_length,),
                                           generator=torch.Generator().manual_seed(0)).to(args.device)}
    else:
        tokenizer = gen.get_tokenizer(args.checkpoint_path)
        prompts = {name: torch.tensor(tokenizer.encode_prompt(text, chat=tokenizer.can_chat), device=args.device)
                   for name, text in SPECULATIVE_PROMPTS.items()}
    # the decoding's cache, made first: the verify steps' smaller one then keeps it (setup_caches), and a
    # cache of another length would be another compile of every step
    model.setup_caches(1, decode.padded_length(max(map(len, prompts.values())) + args.max_new_tokens,
                                               model.config.block_size))
    rows = []
    temperatures = [] if args.verify_only else args.temperatures

    def verify(which: str, name: str, make):
        if which in args.verify_cost:
            rows.append(verify_cost(name, make(), args, steps))
            if args.json:  # as each is done
                write_record(args, rows=rows)
    verify("target", args.precision, lambda: model)
    if temperatures:
        print(f"\n{args.model or args.checkpoint_path or 'bundled SmolLM2-135M-Instruct'}, {args.precision}, "
              f"{args.device}, {args.max_new_tokens} new tokens, k={args.speculate_k}, median of {args.runs} "
              f"interleaved runs (speedup: of each run's ratio to the plain run beside it, end to end; decode: past "
              f"the prompt's prefill, timed alone)")
        print(f"{'prompt':12} {'T':>3} {'drafter':16} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
              f"{'decode':>6}  acceptance")
    for temperature in temperatures:
        for name, prompt in prompts.items():
            def run(new_tokens=args.max_new_tokens, **kw):
                torch.manual_seed(0)
                return gen.generate(model, prompt, new_tokens, temperature=temperature, speculate_k=args.speculate_k,
                                    steps=steps, **kw)

            answer = run()  # the plain run, compiling its steps the first time
            ways = {"plain": {}, **drafts}
            if temperature == 0:
                ways["foreseen"] = dict(drafter=Foreseen(answer.to(args.device)))
            for kwargs in list(ways.values())[1:]:
                run(**kwargs)  # compiles, the first time
            # run by run, every way in turn: a shared machine's speed drifts between runs by more than
            # some drafters change it, and each run's ratio to the plain run beside it cancels the drift
            seconds = {way: [] for way in ways}
            prefill = []  # the prompt's prefill and first token, which every way spends before it decodes
            for _ in range(args.runs):
                prefill.append(timed(lambda: run(new_tokens=1), args.device))
                for way, kwargs in ways.items():
                    seconds[way].append(timed(lambda: run(**kwargs), args.device))
            n, plain = args.max_new_tokens, statistics.median(seconds["plain"])
            for drafter, kwargs in list(ways.items())[1:]:
                spec = statistics.median(seconds[drafter])
                speedup = statistics.median(p / s for p, s in zip(seconds["plain"], seconds[drafter]))
                decode_speedup = statistics.median((p - f) / (s - f) for p, s, f in
                                                   zip(seconds["plain"], seconds[drafter], prefill))
                stats = {}
                run(**kwargs, stats=stats)
                print(f"{name:12} {temperature:3} {drafter:16} {n / plain:11.1f} {n / spec:10.1f} {speedup:7.2f} "
                      f"{decode_speedup:6.2f}  {speculative.format_stats(stats, args.speculate_k)}")
                rows.append(dict(prompt=name, temperature=temperature, drafter=drafter, plain_tok_s=n / plain,
                                 speculative_tok_s=n / spec, speedup=speedup, decode_speedup=decode_speedup,
                                 prefill_s=statistics.median(prefill), **stats))
    if args.json:
        write_record(args, rows=rows)
    verify("int8", "int8", lambda: quantized_copy(model, model.config, "int8", args.groupsize))
    verify("int4", f"int4 g{args.groupsize}", lambda: quantized_copy(model, model.config, "int4", args.groupsize))


def verify_cost(name: str, model: Transformer, args, steps: decode.Steps, depth: int = 100) -> dict:
    """Median ms of a plain step (one token) and of a verify step (k + 1 tokens; with --draft_alternatives
    m, also of the tree of 1 + k + k * m), each of steps (compiled), at `depth`, and their ratios: what a
    speculative round costs beyond its drafts."""
    k, m = args.speculate_k, args.draft_alternatives
    model.setup_caches(1, decode.padded_length(depth + 64, model.config.block_size))
    cpu_decode.pack(model)  # as speculative_generate does
    token = torch.zeros(1, 1, dtype=torch.long, device=args.device)
    positions = depth + torch.arange(1 + k + k * m, device=args.device)[None]
    keys = decode.key_positions(model, depth + 1 + k + k * m)
    tree = speculative.draft_tree(k, m, args.device)
    runs = {"plain": lambda: steps.decode_one_token(model, token, positions[:, :1], keys),
            "verify": lambda: steps.target_step(model, token.expand(1, k + 1), positions[:, : k + 1], keys)}
    if m:
        runs["tree"] = lambda: steps.target_step(model, token.expand(1, len(tree)), positions, keys, tree)
    ms = {}
    for step, run in runs.items():
        run(), run()  # compiles, the first time
        ms[step] = statistics.median(timed(lambda: [run() for _ in range(20)], args.device)
                                     for _ in range(args.runs)) / 20 * 1e3
    tree_cost = f", tree of {len(tree)} {ms['tree']:.2f} ms = {ms['tree'] / ms['plain']:.2f}x" if m else ""
    print(f"{name}: plain step {ms['plain']:.2f} ms, verify step of {k + 1} tokens "
          f"{ms['verify']:.2f} ms = {ms['verify'] / ms['plain']:.2f}x{tree_cost}", flush=True)
    return dict(verify_cost=name, plain_ms=ms["plain"], verify_ms=ms["verify"], ratio=ms["verify"] / ms["plain"],
                **(dict(tree_nodes=len(tree), tree_ms=ms["tree"], tree_ratio=ms["tree"] / ms["plain"]) if m else {}))


@torch.no_grad()
def harness_main(args):
    """Requests/s of eval.py's harness adapter and of the harness's own HF backend scoring the same task
    (default: the repo's multiple-choice task) on the same weights, side by side, and their accuracy:
    the time of the loglikelihood call, and of the whole harness run (datasets, prompts, metrics)."""
    import transformers

    from fastllama import eval as ev

    ev.harness()  # lm_eval in a tested version, or one line that says what to install
    from lm_eval.models.huggingface import HFLM

    if len(ev.task_specs(args.harness)) != 1:
        raise UserError("--harness times one task at a time: give one task name or YAML")

    checkpoint = gen.find_checkpoint(args.checkpoint_path)
    model = gen.load_model(checkpoint, args.device, args.precision)
    ours = ev.HarnessModel(model, gen.get_tokenizer(checkpoint), str(checkpoint), args.eval_batch_size,
                           compile=args.eval_compile)
    first_run = None
    if args.eval_compile:  # its first run compiles: timed apart, before the runs compared
        first_run = timed(lambda: ev.evaluate_tasks(ours, args.harness, args.limit, args.num_fewshot), args.device)
        print(f"ours (eval.py --compile): the first run, compiling, took {first_run:.1f} s")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint.parent)  # from our copy of its files
    theirs = HFLM(pretrained=hf_model_from(model), tokenizer=hf_tokenizer, batch_size=args.eval_batch_size)
    print(f"\n{checkpoint}, {args.precision}, {args.device}, {torch.get_num_threads()} threads, task {args.harness}, "
          f"batch size {args.eval_batch_size}, limit {args.limit}, {args.num_fewshot or 0}-shot, median of {args.runs}")
    mine = "ours (eval.py --compile)" if args.eval_compile else "ours (eval.py)"
    backends = {"harness HF backend": theirs, mine: ours}
    calls = {name: timed_requests(lm, args.device) for name, lm in backends.items()}
    totals, results = {name: [] for name in backends}, {}
    for _ in range(args.runs):  # the two in turn, so that the machine's drift falls on both
        for name, lm in backends.items():
            totals[name].append(timed(lambda: results.update({name: ev.evaluate_tasks(lm, args.harness, args.limit,
                                                                                      args.num_fewshot)}),
                                      args.device))
            if not calls[name]:
                raise UserError(f"{args.harness} asks for no log-likelihoods (a generation task?): --harness times "
                                f"scoring, so give a multiple-choice task")
    rows = {}
    for name in backends:
        n = sum(count for count, _ in calls[name]) // args.runs  # requests a run (the same in each)
        scoring = statistics.median(seconds for _, seconds in calls[name])  # one loglikelihood call a run
        (task,) = results[name]["results"].values()
        rows[name] = dict(requests=n, scoring_s=scoring, requests_per_s=n / scoring,
                          whole_run_s=statistics.median(totals[name]), scoring_s_each_run=[s for _, s in calls[name]],
                          acc=task.get("acc,none"), acc_norm=task.get("acc_norm,none"))
        print(f"{name:20} {n} requests scored in {scoring:6.2f} s: {n / scoring:6.1f} requests/s (the whole "
              f"harness run {rows[name]['whole_run_s']:6.2f} s), " + ", ".join(
                  f"{metric} {task[metric + ',none']:.3f}" for metric in ("acc", "acc_norm") if metric + ",none" in task))
    ratios = [hf_s / our_s for (_, hf_s), (_, our_s) in zip(calls["harness HF backend"], calls[mine])]
    speedup = statistics.median(ratios)
    print(f"ours / the harness's HF backend: {speedup:.2f}x (median of the runs' ratios: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    if args.json:
        write_record(args, rows=rows, speedup=speedup, speedup_each_run=ratios, compiling_run_s=first_run)


def timed_requests(lm, device: str) -> list[tuple[int, float]]:
    """Wrap a harness LM's loglikelihood so that the returned list receives (requests, seconds) of
    each call: the scoring itself, without the harness's own work around it."""
    calls, score = [], lm.loglikelihood

    def timed_score(requests):
        results = []
        calls.append((len(requests), timed(lambda: results.extend(score(requests)), device)))
        return results

    lm.loglikelihood = timed_score
    return calls


def write_record(args, **results):
    """The run's results, with when, how and where it ran, to --json."""
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), command=" ".join(sys.argv),
                  torch=torch.__version__, threads=torch.get_num_threads(),
                  attention_kernel=cpu_decode.USE_ATTENTION_KERNEL,  # FASTLLAMA_ATTENTION_KERNEL=0: off, CPU and GPU
                  cpu_int4_kernel=cpu_decode.USE_INT4_KERNEL,  # FASTLLAMA_INT4_KERNEL=0: off
                  cpu_int8_kernel=cpu_decode.USE_INT8_KERNEL,  # FASTLLAMA_INT8_KERNEL=0: off
                  cpu_bf16_kernel=cpu_decode.USE_BF16_KERNEL,  # FASTLLAMA_BF16_KERNEL=0: off
                  hardware=torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name(),
                  **results, args=vars(args))
    write_json(Path(args.json), record)


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def model_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments every benchmark here takes: which model, where, how many tokens and runs, llama.cpp
    beside it, where the results go."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--checkpoint_path", default=None, help="default: the bundled model")
    p.add_argument("--model", default=None, help="a known shape (scripts/shapes.py), with --random-weights")
    p.add_argument("--random-weights", action="store_true", help="random weights of --model's shape")
    p.add_argument("--device", default=gen.default_device())
    p.add_argument("--precision", choices=gen.PRECISIONS, default="bf16")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quantized", nargs="*", default=[], metavar="PATH|int8|int4",
                   help="quantized checkpoints (quantize.py) to measure in the same run, or int8 / int4 to "
                        "quantize the weights in memory (round to nearest; the way with --random-weights)")
    p.add_argument("--groupsize", type=int, default=32, help="of --quantized int4")
    p.add_argument("--llama-bench", default=None, metavar="BIN",
                   help="llama.cpp's llama-bench binary: its decode speed on the GGUF, in the same run")
    p.add_argument("--gguf", default=None, help="the GGUF file for llama.cpp (default: the bundled one); "
                   "without --checkpoint_path or --model, ours runs on it too")
    p.add_argument("--json", default=None, help="write the results to this file")
    return p


def check_model_arguments(args):
    """Refuse in one line, before minutes of measuring, what model_arguments' arguments cannot do."""
    if bool(args.model) != args.random_weights:
        refuse("--model and --random-weights go together")
    if args.llama_bench and not shutil.which(args.llama_bench):
        refuse(f"--llama-bench {args.llama_bench} is not an executable (the README says how to build it)")
    if args.llama_bench and (args.model or args.checkpoint_path) and not args.gguf:
        refuse("--llama-bench measures the bundled model's GGUF unless --gguf names this model's")
    if args.max_new_tokens < 2 or args.runs < 1:
        refuse("--max_new_tokens must be 2 or more (a decode step is timed past the first token) and --runs 1 or more")
    for path in args.quantized:
        if not in_memory(path) and not Path(path).exists():
            refuse(f"{path} does not exist")
    if args.groupsize not in quantize.GROUPSIZES:
        refuse(f"--groupsize must be one of {quantize.GROUPSIZES}")
    try:  # the device and the model's shape, as the run will take them
        gen.check_device(args.device)
        if args.model:
            shape(args.model)  # an unknown name is refused here
    except UserError as e:
        refuse(str(e))


if __name__ == "__main__":
    p = model_arguments(__doc__)
    p.add_argument("--prompt_length", type=int, default=16,
                   help="random prompt tokens, with --random-weights (real weights decode the extraction prompt)")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    p.add_argument("--dense-twin", action="store_true",
                   help="with a MoE --model: also the dense model of its active size, compiled (and --quantized)")
    p.add_argument("--hf-compile", action="store_true",
                   help="also HF with its static cache and a compiled forward (compiling takes minutes on CPU)")
    p.add_argument("--no-speculative", action="store_true", help="skip the speculative rungs")
    p.add_argument("--skip", nargs="+", choices=["eager", "quantized"], default=[],
                   help="leave out our eager rung (minutes for an 8B on a GPU) or our quantized ones (--quantized "
                        "then quantizes only for --gpt-fast's rungs)")
    p.add_argument("--gpt-fast", default=None, metavar="PATH",
                   help="a gpt-fast checkout: its compiled decoding on the same weights, and its own int8 / int4 of "
                        "--quantized int8 int4 (int4 on CUDA), beside ours (scripts/peers.py)")
    p.add_argument("--apart", action="store_true",
                   help="each compiled rung (ours and --gpt-fast's) in a process of its own: they compile side by "
                        "side, then take turns to be timed (scripts/apart.py); only those rungs, no eager, HF or "
                        "speculative ones")
    p.add_argument("--rung", default=None, help=argparse.SUPPRESS)  # a child of --apart
    p.add_argument("--tp", nargs="*", type=int, default=None, metavar="N",
                   help="also run the compiled rungs sharded N ways under torchrun (default: every GPU, when "
                        "there are several and the model splits so many ways; on CPU, gloo: for correctness, "
                        "not speed)")
    p.add_argument("--harness", nargs="?", default=None, metavar="TASK",
                   const=str(Path(__file__).resolve().parents[1] / "tasks" / "pydoc_cloze.yaml"),
                   help="instead: requests/s of eval.py's harness adapter against the harness's HF backend on a "
                        "loglikelihood task (default: tasks/pydoc_cloze.yaml)")
    p.add_argument("--eval_batch_size", type=int, default=8, help="with --harness")
    p.add_argument("--eval_compile", action="store_true",
                   help="with --harness: eval.py's --compile (its first run, which compiles, is timed apart)")
    p.add_argument("--limit", type=float, default=None, help="with --harness: examples of the task")
    p.add_argument("--num_fewshot", type=int, default=None, help="with --harness: examples before each question")
    p.add_argument("--speculative", action="store_true",
                   help="instead: the verify steps' cost against plain steps (bf16, int8, int4), then plain "
                        "decoding against each drafter (prompt lookup, the draft head, --draft_checkpoint_path; "
                        "greedy, foreseen: every draft right) on real prompts; with --model, random weights: the "
                        "verify steps and foreseen on a random prompt")
    p.add_argument("--draft_checkpoint_path", default=None, help="a draft model for the speculative rungs")
    p.add_argument("--draft_head", type=Path, default=None,
                   help=f"a draft head for the speculative rungs (default: {speculative.HEAD_NAME} beside the "
                        f"checkpoint, if there is one)")
    p.add_argument("--speculate_k", type=int, default=5)
    p.add_argument("--draft_alternatives", type=int, default=0, metavar="M",
                   help="also each model drafter with M alternatives at each depth (a tree), in the speculative "
                        "rungs and --speculative")
    p.add_argument("--verify-cost", nargs="*", choices=VERIFY_COSTS, default=VERIFY_COSTS, metavar="MODEL",
                   help="with --speculative: whose verify steps to time against plain steps (target: --precision's "
                        "model, int8, int4; none named: none, as their compiles can take most of a short GPU call)")
    p.add_argument("--verify-only", action="store_true", help="with --speculative: the verify steps' cost alone")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                   help="with --speculative: greedy (0) and/or sampling at these temperatures")
    args = p.parse_args()
    if args.tp is not None and (args.speculative or args.harness):
        refuse("--tp shards the ladder's rungs; --speculative and --harness run in one process")
    if args.speculative and args.model and args.temperatures != [0.0]:
        refuse("--speculative with --model (random weights) measures greedy decoding only: leave out --temperatures")
    if args.harness and args.model:
        refuse("--harness measures real weights: give --checkpoint_path (default: the bundled model), not --model")
    if (args.verify_cost != VERIFY_COSTS or args.verify_only) and not args.speculative:
        refuse("--verify-cost and --verify-only belong to --speculative")
    check_model_arguments(args)
    # the ladder's HF rungs (unless --no-hf) and the harness's HF backend need transformers; the other modes do not
    if args.harness or not (args.no_hf or args.speculative):
        try:
            import transformers  # noqa: F401 (checked before minutes of measuring)
        except ImportError:
            refuse("the HF rungs need transformers: pip install -e '.[bench]'" + ("" if args.harness else ", or pass --no-hf"))
    if any(n < 2 for n in args.tp or []):
        refuse("--tp takes world sizes of 2 or more (the unsharded rungs are always measured)")
    for path in [args.draft_checkpoint_path, args.draft_head]:  # found now, not after minutes of other rungs
        if path and not Path(path).exists():
            refuse(f"{path} does not exist")
    if args.speculate_k < 1 or args.draft_alternatives < 0 or args.prompt_length < 1:
        refuse("--speculate_k and --prompt_length must be at least 1, --draft_alternatives 0 or more")
    if args.dense_twin and not (args.model and shape(args.model).n_experts):
        refuse("--dense-twin goes with a mixture-of-experts --model")
    if args.checkpoint_path and not (args.speculative or args.harness):  # the ladder quantizes from bf16 weights
        try:
            quantized = quantize.read_scheme(read_metadata(gen.find_checkpoint(args.checkpoint_path)))
        except UserError as e:
            refuse(str(e))
        if quantized:
            refuse(f"{args.checkpoint_path} is quantized: the ladder starts from the unquantized checkpoint; give that "
                   f"as --checkpoint_path and this one as --quantized {args.checkpoint_path}")
    if args.apart and (args.speculative or args.harness or args.tp or args.dense_twin or args.hf_compile
                       or args.llama_bench):
        refuse("--apart measures the compiled rungs alone: drop --speculative, --harness, --tp, --dense-twin, "
               "--hf-compile and --llama-bench")
    if args.gpt_fast and (args.speculative or args.harness):
        refuse("--gpt-fast adds rungs to the ladder, not to --speculative or --harness")
    if args.gpt_fast:  # the checkout, and whether it can run this model, before minutes of measuring
        try:
            peers.gpt_fast_args(peers.load_gpt_fast(args.gpt_fast), full_config(args))
            if "int4" in args.quantized:
                peers.check_int4(args.device)
        except UserError as e:
            refuse(str(e))
    modes = dict(speculative=speculative_main, harness=harness_main)
    run_cli(next((mode for flag, mode in modes.items() if getattr(args, flag)), main), args)
