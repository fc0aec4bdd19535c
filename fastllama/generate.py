"""Generation with a static KV cache: prefill, then one compiled token at a time.

    python generate.py --prompt "Tell me about Paris"              # the bundled SmolLM2-135M-Instruct
    python generate.py --checkpoint_path checkpoints/X --compile
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import os
import resource
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import Tensor

from . import cpu_decode, decode, quantize, speculative, tp
from .checkpoint import (CHECKPOINT_NAME, load_config, read_json, read_metadata, read_safetensors, resolve_checkpoint,
                        write_json)
from .errors import UserError, refuse, run_cli
from .model import PREFILL_CHUNK, ModelArgs, MoEFeedForward, Transformer, check_kv_cache_dtype
from .tokenizer import TextPieces, Tokenizer, load_tokenizer

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KV_CACHE_DTYPES = {**PRECISIONS, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
PROMPT = "Tell me about Paris"  # the command line's default
# Without --max_new_tokens a chat answer runs to its end of turn, within this many positions with its
# prompt (or the context, where shorter): about 3,000 words, past what answers run to, in a cache that
# fits where the whole context's would not (Llama-3.1-8B's 131,072 positions hold 16 GiB in bf16).
ANSWER_POSITIONS = 4096
DEFAULT_NEW_TOKENS = 200  # a continuation's, or --ignore_eos's: they have no end of turn to stop them
# the command line's sampling where neither it nor the checkpoint's generation_config.json sets one
SAMPLING = dict(temperature=0.8, top_k=200, top_p=None)
# how generation_config.json (and the command line, and a harness task) say "no filter"
NO_FILTER = dict(top_k=0, top_p=1)


# ---------------------------------------------------------------------------------------------
# Loading


def find_checkpoint(checkpoint_path: Path | str | None) -> Path:
    """The checkpoint file a user means; None is the bundled model, and a GGUF file its conversion, both
    converted on first use."""
    if checkpoint_path is None:
        from .convert import bundled_checkpoint  # conversion code is loaded only when it may be needed

        return bundled_checkpoint()
    if Path(checkpoint_path).suffix == ".gguf":
        return gguf_checkpoint(Path(checkpoint_path))
    return resolve_checkpoint(checkpoint_path)


def gguf_checkpoint(gguf_path: Path) -> Path:
    """The checkpoint a GGUF file is converted into (convert_gguf), in convert.GGUF_CHECKPOINTS: converted
    on its first use, and again when the file has changed since (by its size and modification time) or an
    earlier version of the import converted it."""
    from . import convert

    if not gguf_path.is_file():
        raise UserError(f"no GGUF file at {gguf_path}")
    gguf_path = gguf_path.resolve()
    out_dir = convert.GGUF_CHECKPOINTS / gguf_path.stem
    stamp = {"source": str(gguf_path), "size": gguf_path.stat().st_size, "mtime_ns": gguf_path.stat().st_mtime_ns,
             "import": convert.GGUF_IMPORT}
    if (out_dir / convert.GGUF_STAMP).is_file() and read_json(out_dir / convert.GGUF_STAMP) == stamp:
        return out_dir / CHECKPOINT_NAME
    print(f"converting {gguf_path.name} into {out_dir} (once)", file=sys.stderr)
    (out_dir / convert.GGUF_STAMP).unlink(missing_ok=True)  # a conversion cut short is done again
    checkpoint = convert_gguf(gguf_path, out_dir)
    write_json(out_dir / convert.GGUF_STAMP, stamp)  # last: the folder is whole
    return checkpoint


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama-architecture GGUF file into a checkpoint in out_dir (its weights, config and
    tokenizer), the linears quantized as convert.gguf_mode says, with its notice on stderr where that is
    not the file's own numbers. Returns the checkpoint file. (Here, not in convert.py: it quantizes, and
    quantize.py reads convert.py's GGUF names.)"""
    import tempfile

    from . import convert

    contents = convert.read_gguf(gguf_path)
    mode, notice = convert.gguf_mode(contents[1], gguf_path)
    if notice:
        print(notice, file=sys.stderr)
    if mode is None:
        return convert.import_gguf(gguf_path, out_dir, torch.bfloat16, contents)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix="dequantized-") as dequantized:
        # bf16: what the unquantized tensors (embeddings, norms) are kept in, and near enough for rounding
        # the others again (Q4_0, Q4_1, Q4_K and IQ4 linears are copied from the GGUF itself)
        source = convert.import_gguf(gguf_path, Path(dequantized), torch.bfloat16, contents)
        return quantize.quantize(source, mode, output=out_dir / CHECKPOINT_NAME)


def load_model(checkpoint_path: Path | str | None = None, device: str | None = None,
               precision: str = "bf16", rank: int = 0, world_size: int = 1) -> Transformer:
    """Build the model on the meta device, swap in quantized modules if the checkpoint says so, and
    load the weights into it in place (`assign=True`): neither a randomly initialized nor a bf16 copy
    of a quantized model ever exists. None means the bundled model. With world_size > 1 (tp.py), this
    rank's slice of the model, holding only its slice of the weights."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    checkpoint_path = find_checkpoint(checkpoint_path)
    device = device or default_device()
    check_device(device)
    scheme = quantize.read_scheme(read_metadata(checkpoint_path))
    model, select = empty_model(load_config(checkpoint_path), scheme, rank, world_size)
    repacked = quantize.repacked_names(model)  # apart, to be freed as packing goes
    state_dict, _ = read_safetensors(checkpoint_path, device, PRECISIONS[precision], select,
                                     together=lambda name: name not in repacked)
    try:
        fill(model, state_dict)
    except RuntimeError as e:
        raise UserError(f"{checkpoint_path} does not fit its {checkpoint_path.parent}/model_config.json: "
                        f"{str(e).splitlines()[1].strip()}")
    quantize.pack_for_device(model, scheme)
    device_forms(model)
    return model.eval()


def device_forms(model: Transformer):
    """Give the model the forms its device runs fastest: cpu_decode.py's on CPU, kernels.py's decode
    attention on a GPU with Triton."""
    cpu_decode.apply(model)
    if quantize.kernels:
        quantize.kernels.apply(model)


def empty_model(config: ModelArgs, scheme: quantize.Scheme | None = None, rank: int = 0, world_size: int = 1):
    """The model on the meta device: this rank's slice of it (tp.apply_tp) with `scheme`'s quantized
    modules. Returns it and which rows of each checkpoint tensor the rank reads (None: all)."""
    with torch.device("meta"):
        model = Transformer(config)
        select = None
        if world_size > 1:
            select = tp.apply_tp(model, rank, world_size, scheme.groupsize if scheme else None)
        if scheme:
            quantize.swap_linears(model, scheme)
    return model, select


def fill(model: Transformer, state_dict: dict[str, Tensor]):
    """Give a meta model state_dict's tensors themselves (`assign=True`), not yet packed for a device
    (quantize.pack_for_device). Empties state_dict, so that packing frees each neutral-layout int4
    weight as it goes. Raises load_state_dict's RuntimeError when the tensors do not fit the model."""
    tied = model.config.tie_embeddings and "output.weight" not in state_dict  # quantized heads are stored apart
    if tied:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    model.load_state_dict(state_dict, assign=True)
    state_dict.clear()
    if tied:  # assign=True replaced the tied parameter: tie it again
        model.output.weight = model.tok_embeddings.weight


def get_tokenizer(checkpoint_path: Path | str | None = None) -> Tokenizer:
    """The tokenizer stored beside a checkpoint (None: the bundled model's)."""
    return load_tokenizer(find_checkpoint(checkpoint_path).parent)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str):
    """Refuse, in one line, a device this PyTorch does not know or this machine does not have."""
    try:
        index = torch.device(device).index
    except RuntimeError:
        raise UserError(f"--device {device} is not a device PyTorch knows: cpu, cuda or cuda:N, for example")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}, but this PyTorch has no CUDA device: leave out --device, or install "
                        f"PyTorch's CUDA build")
    if device.startswith("cuda") and index is not None and index >= torch.cuda.device_count():
        raise UserError(f"--device {device}, but this machine has {torch.cuda.device_count()} CUDA device(s), "
                        f"numbered from cuda:0")


# ---------------------------------------------------------------------------------------------
# Generating


@torch.no_grad()
def generate(model: Transformer, prompt_tokens: Tensor | list[Tensor], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             stop_ids: list[int] | None = None, callback=None, drafter: speculative.Drafter | None = None,
             speculate_k: int = speculative.SPECULATE_K, stats: dict | None = None,
             prefill_chunk: int = PREFILL_CHUNK, kv_cache_dtype: torch.dtype | None = None,
             steps: decode.Steps = decode.EAGER) -> Tensor | list[Tensor]:
    """Continue one prompt (a 1-D LongTensor) or a batch of prompts (a list of them, any lengths).
    Returns the prompt followed by its new tokens, for each prompt; a row ends after its first stop
    token. callback, if given, is called after each step with one list of new token ids per row:
    the row's text, up to and including its stop token, and nothing after it (for streaming). steps:
    the forwards to run, decode.EAGER or compiled_steps().

    With a drafter (speculative.DraftModel, PromptLookup, HeadDrafter) it decodes speculatively:
    several tokens a target forward; `stats` then receives the acceptance counts. prefill_chunk: the
    most positions a forward takes (prefill goes through the prompt in chunks of it; a sliding-window
    layer's cache holds the window + this many). kv_cache_dtype: the cache's (None: the model's;
    torch.int8: half bf16's bytes, model.KVCache).

    What is guaranteed: in fp32, a prompt gives the same tokens alone, in a batch, and speculatively.
    In bf16 the logits agree up to rounding (a batch or a verify step sums in another order), so a
    near-tie between two tokens can resolve either way and the texts part from there."""
    single = isinstance(prompt_tokens, Tensor)
    prompts = [prompt_tokens] if single else list(prompt_tokens)
    check_generate_args(prompts, max_new_tokens, temperature, top_k, top_p, model.config)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    if drafter is not None:
        outputs = speculative.speculative_generate(model, prompts, max_new_tokens, drafter, speculate_k=speculate_k,
                                                   stop_ids=stop_ids, callback=callback, stats=stats,
                                                   prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype,
                                                   steps=steps, **sampling)
        return outputs[0] if single else outputs
    device = next(model.parameters()).device
    B = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lengths.max())
    model.setup_caches(B, decode.padded_length(T + max_new_tokens, model.config.block_size), prefill_chunk,
                       kv_cache_dtype)

    # Right-pad and prefill from position 0: each row's cache then holds exactly its own prompt; the
    # padding's cache entries lie beyond the row's position and are overwritten as it decodes
    # (decode.prompt_positions).
    next_token = decode.prefill(model, decode.right_padded(prompts, T, device), lengths, steps, **sampling).clone()
    new_tokens = [next_token]
    input_pos = lengths.unsqueeze(1)  # (B, 1)
    stops = torch.tensor(stop_ids or [], device=device)
    done = torch.isin(next_token, stops)  # (B, 1)
    if callback:
        decode.stream(callback, next_token, torch.ones_like(done))
    for step in range(1, max_new_tokens):
        keys = decode.key_positions(model, T + step)  # the latest position is T + step - 1
        next_token = steps.decode_one_token(model, next_token, input_pos, keys, **sampling)
        input_pos = input_pos + 1
        new_tokens.append(next_token)
        if callback:  # streaming looks at the host every step anyway
            decode.stream(callback, next_token, ~done)
        if stop_ids:
            done |= torch.isin(next_token, stops)
            # look at the host only now and then when nobody streams: it waits for the GPU
            if (callback or step % 8 == 0) and done.all():
                break

    new_tokens = torch.cat(new_tokens, dim=1).cpu()  # (B, generated)
    outputs = [torch.cat([p.cpu(), decode.until_stop(row, stop_ids)]) for p, row in zip(prompts, new_tokens)]
    return outputs[0] if single else outputs


def check_generate_args(prompts, max_new_tokens, temperature, top_k, top_p, config: ModelArgs):
    if not prompts:
        raise UserError("no prompts given")
    if any(not isinstance(p, Tensor) or p.ndim != 1 or len(p) == 0 for p in prompts):
        raise UserError("each prompt must be a non-empty 1-D tensor of token ids (a list of them for a batch)")
    if any(p.min() < 0 or p.max() >= config.vocab_size for p in prompts):
        raise UserError(f"a prompt holds token ids outside this model's vocabulary (0 to {config.vocab_size - 1}): "
                        f"encode it with the model's own tokenizer")
    context = config.block_size
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context:
        raise UserError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceed the model's "
                        f"context length {context}: shorten one or the other")
    if not temperature >= 0:  # NaN too
        raise UserError(f"temperature must be a number >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 <= top_p <= 1:
        raise UserError(f"top_p must be in [0, 1], got {top_p}")


def compiled_steps(dynamic_prefill: bool = False) -> decode.Steps:
    """decode's steps compiled: the one-token step, speculative decoding's verify, draft-model and
    draft-head steps, and a server's joined step with fixed shapes (CUDA graphs on GPU); prefill's forward
    of one chunk, with dynamic_prefill, for any chunk length (else eager). Each compiles on its first call,
    for any model. The same object for the same argument."""
    return compiled_once(bool(dynamic_prefill))


# cached, so that a second rung of a benchmark, or a second test, finds the steps compiled already and
# their graphs, rather than new functions that compile the same graphs again; behind compiled_steps,
# as functools.cache keys on the arguments as written (f() apart from f(False))
@functools.cache
def compiled_once(dynamic_prefill: bool) -> decode.Steps:
    if dynamic_prefill:  # the fixed-shape steps are the same objects as without: one set of graphs for both
        return dataclasses.replace(compiled_once(False), prefill_chunk=torch.compile(
            decode.prefill_chunk, fullgraph=True, dynamic=True))
    # On GPU, inductor turns a one-row matmul into a multiply-and-sum (torch/_inductor/decomposition.py,
    # mm) only with coordinate-descent tuning on: a matrix-vector kernel that reaches the memory's
    # bandwidth, and the form into which an int8 weight's conversion fuses, read once as int8 (else
    # each step would write a bf16 copy of every weight first). Inductor's CPU code ignores both.
    torch._inductor.config.coordinate_descent_tuning = True
    torch._inductor.config.triton.unique_kernel_names = True  # a profile names each kernel by what it does
    torch._inductor.config.fx_graph_cache = True  # a later run reuses this one's compiled graphs
    # a CUDA graph per count of key blocks read (decode.key_positions) is the design, not a mistake to warn of
    torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit = None
    # Before each call dynamo checks its guards down the module tree to every weight: on a small model's CPU
    # step, a sixth of its time. With dict tags, a subtree whose dicts have not changed since passes in one
    # look (benchmarks/RESULTS.md, "Dynamo's guards by dict tags on Python 3.12"; caches made anew turn that
    # off for the graphs compiled before them). Only where Python watches dicts for it: before 3.12 the tags
    # are read through raw pointers, unsafe once a module is replaced (setup_caches does) while its parent
    # lives (pytorch/pytorch#188101). Set either way: PyTorch 2.11 has it on for every Python, 2.13 for none.
    torch._dynamo.config.use_recursive_dict_tags_for_guards = (
        sys.version_info >= (3, 12) and not sysconfig.get_config_var("Py_GIL_DISABLED"))

    def fixed(step):  # dynamic=False: a new cache length or batch size compiles anew, no shape turns symbolic
        return copied_out(torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False))

    return decode.Steps(decode_one_token=fixed(decode.decode_one_token), target_step=fixed(decode.target_step),
                        joined_step=fixed(decode.joined_step), draft_step=fixed(decode.draft_step),
                        head_step=fixed(decode.head_step))


def copied_out(step):
    """step, its outputs copied: a CUDA graph's outputs live in memory that its next replay, or another
    graph's, may overwrite, and callers keep them past the next call (a clone inside the compiled
    function would live there too)."""
    @functools.wraps(step)
    def copied(*args, **kwargs):
        out = step(*args, **kwargs)
        return out.clone() if isinstance(out, Tensor) else tuple(t.clone() for t in out)
    return copied


# ---------------------------------------------------------------------------------------------
# Reporting


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights read to decode one token: the state dict (caches are not in it), tied tensors
    once, and no embedding table that is not also the head (untied, or a quantized head kept apart):
    a step reads only one row of it. Of a MoE layer's experts, only the active ones count."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    if model.tok_embeddings.weight is not model.output.weight:
        tensors.pop(model.tok_embeddings.weight.data_ptr())
    inactive = 0
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            expert_bytes = sum(t.nbytes for layer in (m.w13, m.w2) for t in layer.state_dict().values())
            inactive += expert_bytes * (m.n_experts - m.top_k) // m.n_experts
    return sum(t.nbytes for t in tensors.values()) - inactive


def peak_memory_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux


def synchronize(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Command line


def main(args) -> list[Tensor] | None:
    rank, world_size = tp.maybe_init_distributed(args.device)
    threads = torch.get_num_threads()
    try:
        return run(args, rank, world_size)
    finally:
        torch.set_num_threads(threads)  # run() fits them to the free cores: an in-process caller gets its own back
        if world_size > 1:
            torch.distributed.destroy_process_group()


def run(args, rank: int = 0, world_size: int = 1) -> list[Tensor] | None:
    """The CLI's job; returns the last sample's rows (prompt and new tokens), or None for --interactive."""
    if rank != 0:  # only rank 0 speaks (a user error on every rank is printed by rank 0 alone)
        sys.stdout = sys.stderr = open(os.devnull, "w")
    device = args.device or default_device()
    check_run_args(args, device, world_size)
    if world_size > 1:
        # one rank converts the bundled model on first use; the others wait for the finished files
        checkpoint_path = tp.rank_zero_first(lambda: find_checkpoint(args.checkpoint_path))
        tp.check_divisible(load_config(checkpoint_path), world_size)  # every rank, before any reads its shard
        torch.manual_seed(tp.shared_seed())  # the same logits on every rank must sample the same tokens
    else:
        checkpoint_path = find_checkpoint(args.checkpoint_path)
    t0, clock = time.perf_counter(), cpu_clock()
    model = load_model(checkpoint_path, device, args.precision, rank, world_size)
    tokenizer = get_tokenizer(checkpoint_path)
    synchronize(device)
    print(f"Loaded the model in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    if device == "cpu":
        fit_threads(busy_cores(clock))  # before anything compiles: inductor writes the thread count into its code
    drafter = load_drafter(args, checkpoint_path, model, device, world_size)
    # generate()'s settings beyond the prompt, the same for every sample and every turn of a chat
    options = dict(**sampling_options(args, checkpoint_path), drafter=drafter, speculate_k=args.speculate_k,
                   prefill_chunk=args.prefill_chunk,
                   kv_cache_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype or args.precision],
                   steps=compiled_steps(args.compile_prefill) if args.compile else decode.EAGER)
    if args.interactive:
        context = model.config.block_size if args.context is None else args.context
        return chat(model, tokenizer, args.max_new_tokens, options, context)

    use_chat = tokenizer.can_chat if args.chat is None else args.chat
    prompt = torch.tensor(tokenizer.encode_prompt(args.prompt, chat=use_chat), dtype=torch.long)
    stop_ids = [] if args.ignore_eos else tokenizer.stop_ids
    max_new_tokens = new_token_budget(args.max_new_tokens, len(prompt), model.config.block_size,
                                      ends_itself=bool(use_chat and stop_ids))
    weight_bytes = weight_bytes_per_token(model)
    if args.compile:
        print("compiling the decode step: the first run takes minutes on CPU, seconds once cached (for texts "
              "up to the same cache length)", file=sys.stderr)
        # compiled graphs fit one cache length; inductor keeps them on disk for the next run, which then
        # finds them whatever its prompt and --max_new_tokens, as long as its text fits the same bucket
        model.setup_caches(args.batch_size, compiled_cache_length(len(prompt) + max_new_tokens,
                                                                  model.config.block_size),
                           args.prefill_chunk, options["kv_cache_dtype"])
    # the first sample compiles; when compiling, a warm-up sample is run and not counted
    for i in range(-1 if args.compile else 0, args.num_samples):
        synchronize(device)
        t0, clock = time.perf_counter(), cpu_clock()
        profiling = args.profile and i == args.num_samples - 1 and rank == 0
        stats = {}
        # one row streams as it is made (each sample in turn, as a chat's answers); rows decoded together
        # end together, and are printed then, one after another, each labelled
        streaming = args.batch_size == 1 and i >= 0
        stream = TextStream(tokenizer, None if use_chat else prompt.tolist()) if streaming else None
        with profiler(args.profile) if profiling else contextlib.nullcontext(), said_if_interrupted(stream):
            outputs = generate(model, [prompt] * args.batch_size, max_new_tokens, stop_ids=stop_ids, stats=stats,
                               callback=stream, **options)
        synchronize(device)
        seconds = time.perf_counter() - t0
        if i < 0:
            print(f"Compilation (warm-up sample) took {seconds:.2f} s", file=sys.stderr)
            continue
        if stream:
            print()  # the streamed text's line ends
        else:
            for row, output in enumerate(outputs):
                text = tokenizer.decode(output[len(prompt) if use_chat else 0:].tolist())
                print(f"[{row + 1}/{len(outputs)}] {text}")
        new = sum(len(o) - len(prompt) for o in outputs)
        cut = sum(len(o) - len(prompt) == max_new_tokens and int(o[-1]) not in stop_ids for o in outputs)
        if cut and not args.ignore_eos:
            bound = (f"--max_new_tokens {max_new_tokens}" if args.max_new_tokens or not use_chat else
                     f"{len(prompt) + max_new_tokens} positions, the bound without --max_new_tokens")
            print(f"({cut} of {len(outputs)} rows stopped at {bound}, not at the end of the answer)", file=sys.stderr)
        if stats:
            print(speculative.format_stats(stats, args.speculate_k), file=sys.stderr)
        # a step's weight bytes per token read: not a speculative run's, whose step reads them for several tokens
        bandwidth = "" if drafter else f"bandwidth {weight_bytes * new / args.batch_size / seconds / 1e9:.2f} GB/s, "
        print(f"Sample {i + 1}: {new} tokens in {seconds:.2f} s, {new / seconds:.2f} tok/s "
              f"({args.batch_size} rows, {new / args.batch_size:.0f} tokens a row), {bandwidth}"
              f"peak memory {peak_memory_gb(device):.2f} GB", file=sys.stderr)
        if device == "cpu":
            note_if_crowded(busy_cores(clock))
    return outputs


def sampling_options(args, checkpoint_path: Path) -> dict:
    """--temperature, --top_k and --top_p: each as given, else as the generation_config.json beside the
    checkpoint recommends (Hugging Face's generate and vLLM read these settings from it too; a do_sample
    of false there means greedy), else SAMPLING's."""
    recommended = read_json(Path(checkpoint_path).parent / "generation_config.json")
    if recommended.get("do_sample") is False:
        recommended = dict(temperature=0.0)
    recommended = {name: None if recommended[name] == NO_FILTER.get(name) else recommended[name]
                   for name in SAMPLING if name in recommended}
    given = {name: None if getattr(args, name) == NO_FILTER.get(name) else getattr(args, name)
             for name in SAMPLING if getattr(args, name) is not None}
    used = {name: value for name, value in recommended.items() if name not in given}
    if used:
        settings = ", ".join(f"{name} {'none' if value is None else value}" for name, value in used.items())
        print(f"sampling as the checkpoint's generation_config.json recommends: {settings}", file=sys.stderr)
    return {**SAMPLING, **used, **given}


def compiled_cache_length(n: int, context: int) -> int:
    """The cache the command line gives compiled decoding for n positions: a power of two, at least
    1024, never past the context. A step reads only the slots its text fills (decode.key_positions),
    so the longer cache costs memory, not time."""
    return min(max(1024, 1 << (n - 1).bit_length()), context)


def new_token_budget(max_new_tokens: int | None, prompt_length: int, context: int, ends_itself: bool) -> int:
    """--max_new_tokens where given; else, for an answer that ends at its end of turn, what ANSWER_POSITIONS
    (or, for a longer prompt, DEFAULT_NEW_TOKENS) leaves after the prompt within the context; else
    DEFAULT_NEW_TOKENS."""
    if max_new_tokens is not None:
        return max_new_tokens
    if not ends_itself:
        return DEFAULT_NEW_TOKENS
    return max(1, min(context, max(ANSWER_POSITIONS, prompt_length + DEFAULT_NEW_TOKENS)) - prompt_length)


class TextStream:
    """generate()'s callback for one row: prints its text as the tokens come (tokenizer.TextPieces).
    `text`: what was printed, from the prompt's tokens, where given (a continuation), on."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int] | None = None):
        self.stop_ids, self.pieces, self.text = tokenizer.stop_ids, TextPieces(tokenizer, prompt), ""

    def __call__(self, rows: list[list[int]]):
        new = self.pieces.add([t for t in rows[0] if t not in self.stop_ids])
        print(new, end="", flush=True)
        self.text += new


@contextlib.contextmanager
def said_if_interrupted(stream: TextStream | None):
    """Ctrl-C (or SIGTERM, SIGHUP: errors.run_cli) during generation keeps what was streamed, ends its
    line, and says so on stderr; the exit code stays run_cli's."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        if stream:
            print(flush=True)
        print(f"generation interrupted{', the text so far above' if stream else ''}", file=sys.stderr)
        raise


def cpu_clock() -> tuple[float, float, float] | None:
    """Seconds: the wall clock, the CPU time every process has spent on the cores this one may run on
    (Linux's /proc/stat: all but idle and iowait, a hypervisor's steal included), and this process's own
    CPU time, with its children's that have ended (a CPU kernel built at first use compiles in them: not
    another process's load). None where there is no /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    cores = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    ticks = [[int(n) for n in line.split()[1:9]] for line in lines if line.split(maxsplit=1)[0] in cores]
    own = sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                         resource.RUSAGE_CHILDREN)))
    busy = sum(sum(t) - t[3] - t[4] for t in ticks) / os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), busy, own


def busy_cores(since: tuple[float, float, float] | None) -> float | None:
    """How many of this process's cores other processes kept busy, on average, since cpu_clock() gave `since`."""
    now = cpu_clock()
    if since is None or now is None:
        return None
    wall, busy, own = (b - a for a, b in zip(since, now))
    return max(0.0, busy - own) / wall


def free_cores(busy: float) -> int:
    return max(1, len(os.sched_getaffinity(0)) - round(busy))


def fit_threads(busy: float | None):
    """Decode on the cores other processes leave free, unless OMP_NUM_THREADS says how many threads. An
    OpenMP team waits, spinning, for its slowest thread at every op: one that shares its core with another
    process holds up the whole team, which then runs slower than one thread alone; on a free machine the
    threads pay (benchmarks/RESULTS.md#a-busy-core-openmps-threads, with the wait policies tried instead)."""
    if busy is None or "OMP_NUM_THREADS" in os.environ or free_cores(busy) >= torch.get_num_threads():
        return
    print(f"other processes keep {busy:.1f} of this machine's cores busy: decoding on {free_cores(busy)} "
          f"thread(s) (OMP_NUM_THREADS=N to choose)", file=sys.stderr)
    torch.set_num_threads(free_cores(busy))


def note_if_crowded(busy: float | None):
    """Say what to do when other processes took cores this run's threads were decoding on (a load that came
    after fit_threads, or OMP_NUM_THREADS asking for more): the team then waits on its slowest thread."""
    if busy is not None and free_cores(busy) < torch.get_num_threads():
        print(f"(other processes kept {busy:.1f} cores busy while {torch.get_num_threads()} threads decoded: if "
              f"this sample ran slowly, run with OMP_NUM_THREADS={free_cores(busy)})", file=sys.stderr)


def check_run_args(args, device: str, world_size: int):
    """What can be refused before anything is loaded."""
    check_device(device)
    if args.compile and device == "cpu" and not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")):
        raise UserError("--compile on CPU needs a C++ compiler (g++ or clang++) on PATH")
    if args.compile and device.startswith("cuda") and importlib.util.find_spec("triton") is None:
        raise UserError("--compile on GPU needs triton (it comes with PyTorch's CUDA wheels)")
    if args.kv_cache_dtype:
        check_kv_cache_dtype(KV_CACHE_DTYPES[args.kv_cache_dtype], torch.device(device))
    if args.batch_size < 1 or args.num_samples < 1:
        raise UserError("--batch_size and --num_samples must be at least 1")
    if args.interactive and (args.batch_size > 1 or args.num_samples > 1):
        raise UserError("--interactive is one dialog: leave out --batch_size and --num_samples")
    if args.context is not None and not args.interactive:
        raise UserError("--context sizes the cache of --interactive; elsewhere the cache holds the prompt and "
                        "--max_new_tokens")
    if args.interactive and world_size > 1:
        raise UserError("--interactive reads the terminal from one process: run it without torchrun")
    if not args.interactive and not args.prompt:
        raise UserError("the prompt is empty")


def load_drafter(args, checkpoint_path: Path, model: Transformer, device: str,
                 world_size: int = 1) -> speculative.Drafter | None:
    """The drafter of --draft, --draft_checkpoint_path or --draft_head, or None. Under torchrun every
    rank holds all of a draft model or head (replicated, not sharded)."""
    alternatives = args.draft_alternatives
    if args.draft_checkpoint_path:
        return speculative.DraftModel(load_model(args.draft_checkpoint_path, device, args.precision), alternatives)
    if args.draft == "self-int4":
        def int4_copy() -> Path:
            path = quantize.output_path(checkpoint_path, "int4", 32)
            if not path.is_file():
                print(f"quantizing the target to int4 for drafting, once: {path}", file=sys.stderr)
                quantize.quantize(checkpoint_path, "int4", 32)
            return path

        path = tp.rank_zero_first(int4_copy) if world_size > 1 else int4_copy()
        return speculative.DraftModel(load_model(path, device, args.precision), alternatives)
    if args.draft == "prompt-lookup":
        return speculative.PromptLookup()
    if args.draft == "head" or args.draft_head:
        return speculative.head_drafter(args.draft_head or checkpoint_path.parent / speculative.HEAD_NAME, model,
                                        alternatives)
    return None


@contextlib.contextmanager
def profiler(path: str):
    with torch.profiler.profile() as prof:
        yield
    partial = Path(f"{path}.{os.getpid()}.partial")  # renamed into place once whole (checkpoint.write_atomically)
    try:
        prof.export_chrome_trace(str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    print(f"profile written to {path} (open it in chrome://tracing or ui.perfetto.dev)", file=sys.stderr)


def chat(model: Transformer, tokenizer: Tokenizer, max_new_tokens: int | None, options: dict, context: int):
    """A multi-turn chat in the model's template, printing tokens as they come; options: generate()'s.
    The dialog may reach `context` positions, for which the KV cache is made once; where a message and
    a whole answer would not fit, the oldest exchanges are forgotten (said on stderr) until they do."""
    if not tokenizer.can_chat:
        raise UserError("this tokenizer has no chat template, so --interactive cannot format a dialog")
    if not 1 <= context <= model.config.block_size:
        raise UserError(f"--context must be between 1 and the model's context length {model.config.block_size}, "
                        f"got {context}")
    # the cache holds the whole context from the first turn (as generate() pads it, and keeps a larger
    # cache), so that compiled decoding never recompiles for a longer dialog; a step reads only the
    # dialog's slots (decode.key_positions)
    model.setup_caches(1, decode.padded_length(context, model.config.block_size), options["prefill_chunk"],
                       options["kv_cache_dtype"])
    messages = []
    while True:
        try:
            user = input("You: ").strip()
        except EOFError:  # the end of the input: end the prompt's line, as Enter would have
            print()
            return
        if not sys.stdin.isatty():  # a terminal echoes what is typed; from a pipe, the answer would follow on its line
            print(user)
        if not user:
            continue
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.encode_dialog(messages)
        forgotten = 0
        # the room a whole answer needs: --max_new_tokens, else the least new_token_budget gives
        room = DEFAULT_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        while len(prompt) + room > context and len(messages) > 1:
            del messages[:2]  # the oldest question and its answer
            forgotten += 1
            prompt = tokenizer.encode_dialog(messages)
        if forgotten:
            print(f"(the dialog would pass --context {context} positions: its {forgotten} oldest "
                  f"exchange{'s' if forgotten > 1 else ''} forgotten)", file=sys.stderr)
        budget = min(new_token_budget(max_new_tokens, len(prompt), context, ends_itself=True), context - len(prompt))
        if budget < 1:
            raise UserError(f"this message takes {len(prompt)} positions in the chat template, which leaves no "
                            f"room for an answer in --context {context}: raise --context or write less")
        print("Assistant: ", end="", flush=True)
        stream = TextStream(tokenizer)
        with said_if_interrupted(stream):
            generate(model, torch.tensor(prompt, dtype=torch.long), budget, stop_ids=tokenizer.stop_ids,
                     callback=stream, **options)
        print()
        # what was printed: an answer cut inside a character by max_new_tokens keeps no U+FFFD for it
        messages.append({"role": "assistant", "content": stream.text})


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows each option's default where one is set and its help
    does not already say it (argparse's own formatter adds "(default: None)" to every option)."""

    def _get_help_string(self, action):
        help = action.help or ""
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if unset or "default" in help or not action.option_strings:
            return help
        return help + " (default: %(default)s)"


def parse_args(argv=None):
    # allow_abbrev=False: --max_new_token is a mistake to point out, not --max_new_tokens
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="a converted checkpoint's directory or .safetensors file (default: the bundled "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default=None, help=f"what to continue (or answer, in chat) (default: {PROMPT!r})")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: when it has one)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat, streaming the answers")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="--interactive: the most positions a dialog may reach, its KV cache made for them once "
                        "(default: the model's context length; lower it where that cache does not fit)")
    p.add_argument("--num_samples", type=int, default=1, help="times to generate, each timed")
    p.add_argument("--batch_size", type=int, default=1, help="rows decoded together, each from the prompt")
    p.add_argument("--max_new_tokens", type=int, default=None,
                   help=f"at most this many new tokens a row (default: a chat answer's end of turn, within "
                        f"{ANSWER_POSITIONS} positions with its prompt; {DEFAULT_NEW_TOKENS} for a continuation "
                        f"and with --ignore_eos)")
    p.add_argument("--ignore_eos", action="store_true",
                   help="decode max_new_tokens whatever the model says (for benchmarks), not stopping at "
                        "the end of the answer")
    recommended = "the checkpoint's generation_config.json, else"
    p.add_argument("--temperature", type=float, default=None,
                   help=f"0 is greedy (exact argmax) (default: {recommended} {SAMPLING['temperature']})")
    p.add_argument("--top_k", type=int, default=None,
                   help=f"sample from the k most likely tokens, 0 for all (default: {recommended} {SAMPLING['top_k']})")
    p.add_argument("--top_p", type=float, default=None,
                   help=f"sample from the smallest set of tokens holding this mass, 1 for all (default: {recommended} "
                        f"none)")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="speculative decoding with this draft model (same vocabulary as the target)")
    p.add_argument("--draft", choices=["prompt-lookup", "self-int4", "head"], default=None,
                   help="speculative decoding, drafting from n-grams of the text so far, with an int4 copy "
                        "of the target, or with the draft head trained for it (scripts/train_draft_head.py)")
    p.add_argument("--draft_head", type=Path, default=None,
                   help=f"speculative decoding with this draft head (default with --draft head: "
                        f"{speculative.HEAD_NAME} beside the checkpoint)")
    p.add_argument("--speculate_k", type=int, default=None,
                   help=f"tokens drafted per step (default: {speculative.SPECULATE_K})")
    p.add_argument("--draft_alternatives", type=int, default=0, metavar="M",
                   help="tree drafting: the target also checks the drafter's next M best tokens at each depth, "
                        "in the same forward (a draft model or head)")
    p.add_argument("--compile", action="store_true", help="compile decoding (CUDA graphs on GPU)")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill, for any prompt length")
    p.add_argument("--prefill_chunk", type=int, default=PREFILL_CHUNK,
                   help="prompt positions a prefill forward takes: activation memory is bounded by it")
    p.add_argument("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="the KV cache's dtype (default: --precision's); int8 (and fp8 e4m3, on GPUs that have it) "
                        "store half bf16's bytes")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="activations and unquantized weights")
    p.add_argument("--profile", default=None, metavar="TRACE.json",
                   help="write a torch profiler trace of the last sample")
    args = p.parse_args(argv)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        refuse("--max_new_tokens must be at least 1")
    if args.prefill_chunk < 1:
        refuse("--prefill_chunk must be at least 1")
    if args.profile and not Path(args.profile).resolve().parent.is_dir():
        refuse(f"--profile {args.profile}: its folder does not exist")
    if args.profile and Path(args.profile).is_dir():
        refuse(f"--profile {args.profile} is a folder: give the trace's file name, e.g. trace.json")
    if args.temperature is not None and not args.temperature >= 0:  # NaN too
        refuse(f"--temperature must be a number >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        refuse(f"--top_k must be >= 0 (0: no filter), got {args.top_k}")
    if args.top_p is not None and not 0 <= args.top_p <= 1:  # NaN too
        refuse(f"--top_p must be in [0, 1] (1: no filter), got {args.top_p}")
    ignored = [name for name, given in (("--prompt", args.prompt is not None), ("--profile", args.profile),
                                        ("--ignore_eos", args.ignore_eos), ("--no-chat", args.chat is False))
               if given]
    if args.interactive and ignored:
        refuse(f"--interactive reads its prompts from the terminal, in the chat template, and stops at the end of "
               f"each answer: leave out {', '.join(ignored)}")
    if args.compile_prefill and not args.compile:
        refuse("--compile_prefill goes with --compile")
    head = args.draft_head or args.draft == "head"
    drafters = (args.draft_checkpoint_path, head, args.draft not in (None, "head"))
    if sum(map(bool, drafters)) > 1:
        refuse("--draft, --draft_checkpoint_path and --draft_head name different drafters: choose one")
    if args.speculate_k is not None and not any(drafters):
        refuse("--speculate_k goes with a drafter: --draft, --draft_checkpoint_path or --draft_head")
    if args.speculate_k is not None and args.speculate_k < 1:
        refuse("--speculate_k must be at least 1")
    args.prompt = PROMPT if args.prompt is None else args.prompt
    args.speculate_k = speculative.SPECULATE_K if args.speculate_k is None else args.speculate_k
    if args.draft_alternatives < 0:
        refuse("--draft_alternatives must be 0 or more")
    if args.draft_alternatives and not (args.draft_checkpoint_path or head or args.draft == "self-int4"):
        refuse("--draft_alternatives goes with a drafter that ranks tokens: --draft_checkpoint_path, --draft self-int4 "
                "or --draft head")
    return args


def cli():
    """python generate.py's command line."""
    run_cli(main, parse_args())


if __name__ == "__main__":
    cli()
