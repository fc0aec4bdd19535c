"""Generation with a static KV cache: prefill, then one compiled token at a time.

    python generate.py --prompt "Tell me about Paris"              # the bundled SmolLM2-135M-Instruct
    python generate.py --checkpoint_path checkpoints/X/model.safetensors --compile
"""

import argparse
import contextlib
import importlib.util
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

from checkpoint import load_config, read_safetensors, resolve_checkpoint
import quantize
import tp
from model import Attention, ModelArgs, Transformer, UserError
from tokenizer import Tokenizer, load_tokenizer

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------
# Loading


def load_model(checkpoint_path: Path | str | None = None, device: str | None = None,
               precision: str = "bf16", rank: int = 0, world_size: int = 1) -> Transformer:
    """Build the model on the meta device, swap in quantized modules if the checkpoint says so, and
    load the weights into it in place (`assign=True`): neither a randomly initialized nor a bf16 copy
    of a quantized model ever exists. None means the bundled model. With world_size > 1 (tp.py), this
    rank's slice of the model, reading only its slice of the weights."""
    checkpoint_path = resolve_checkpoint(checkpoint_path)
    device = device or default_device()
    config = load_config(checkpoint_path)
    select = None
    if world_size > 1:
        with safe_open(str(checkpoint_path), framework="pt") as f:  # reads the header only
            scheme = quantize.read_scheme(f.metadata() or {})
        tp.check_divisible(config, world_size, scheme["groupsize"] if scheme and scheme["mode"] == "int4" else None)
        select = tp.shard_selector(config, rank, world_size)
        config = tp.local_config(config, world_size)
    state_dict, metadata = read_safetensors(checkpoint_path, device, PRECISIONS[precision], select)
    try:
        model = assemble(config, state_dict, quantize.read_scheme(metadata))
    except RuntimeError as e:
        raise UserError(f"{checkpoint_path} does not fit its {checkpoint_path.parent}/model_config.json: "
                        f"{str(e).splitlines()[1].strip()}")
    quantize.pack_for_device(model)
    if world_size > 1:
        tp.add_all_reduces(model)
    return model.eval()


def assemble(config: ModelArgs, state_dict: dict[str, Tensor], scheme: dict | None = None) -> Transformer:
    """A model built on the meta device, its linears swapped for `scheme`'s quantized modules, holding
    state_dict's tensors themselves (`assign=True`); not yet packed for a device (quantize.pack_for_device).
    Empties state_dict, so that packing frees each neutral-layout int4 weight as it goes. Raises
    load_state_dict's RuntimeError when the tensors do not fit `config`."""
    with torch.device("meta"):
        model = Transformer(config)
    if scheme:
        quantize.swap_linears(model, scheme)
    tied = config.tie_embeddings and "output.weight" not in state_dict  # quantized heads are stored apart
    if tied:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    model.load_state_dict(state_dict, assign=True)
    state_dict.clear()
    if tied:  # assign=True replaced the tied parameter: tie it again
        model.output.weight = model.tok_embeddings.weight
    return model


def get_tokenizer(checkpoint_path: Path | str | None = None) -> Tokenizer:
    """The tokenizer stored beside a checkpoint (None: the bundled model's)."""
    return load_tokenizer(resolve_checkpoint(checkpoint_path).parent)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------------
# Sampling and decoding


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> Tensor:
    """logits: (B, V) -> probabilities (B, V) after temperature, top-k and nucleus (top-p) filtering."""
    logits = logits.float() / max(temperature, 1e-5)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p; the top one always stays
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    return logits.softmax(-1)


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None) -> Tensor:
    """logits: (B, V) -> next tokens (B, 1). Temperature 0 is exact argmax."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    return sample_from(logits_to_probs(logits, temperature, top_k, top_p))


def sample_from(probs: Tensor) -> Tensor:
    """probs: (B, V) -> one draw per row (B, 1). argmax(p / Exp(1)) is a draw from p, without the
    host sync of torch.multinomial."""
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1, keepdim=True)


def prefill(model: Transformer, idx: Tensor, input_pos: Tensor, last: Tensor, **sampling) -> Tensor:
    """idx: (B, T) right-padded prompts; input_pos: (T,); last: (B,) index of each prompt's last token.
    Fills the cache and returns the first new token of each row, (B, 1)."""
    logits = model(idx, input_pos)  # (B, T, V)
    return sample(logits[torch.arange(idx.shape[0], device=idx.device), last], **sampling)


def decode_one_token(model: Transformer, cur_token: Tensor, input_pos: Tensor, **sampling) -> Tensor:
    """cur_token: (B, 1); input_pos: (B, 1), each row's own position. Returns the next tokens (B, 1)."""
    logits = model(cur_token, input_pos)  # (B, 1, V)
    return sample(logits[:, -1], **sampling)


# On CPU, compiled decoding computes its one-row products as plain multiply-and-sum expressions, which
# inductor fuses into single vectorized loops: a bf16 weight is read 1.5-1.8x faster than by the BLAS
# call aten.mm makes at M=1, an int8 one is converted in registers (faster than _weight_int8pack_mm at
# one row), and attention over the cache runs about 3x faster than SDPA's CPU kernel
# (scripts/benchmark.py measures the matmul side). Eager and many-row calls keep the library kernels.


class CPUDecodeLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1 and self.bias is None:
            return one_row_product(x, self.weight).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


class CPUDecodeInt8Linear(quantize.Int8Linear):
    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1:
            return (one_row_product(x, self.weight) * self.scales).to(x.dtype)
        return super().forward(x)


class CPUDecodeAttention(Attention):
    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and q.shape[2] == 1:
            return one_query_attention(q, k, v, mask)
        return super().attend(q, k, v, mask)


def one_row_product(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., k) of one row times weight (n, k) transposed, accumulated in fp32."""
    # as_strided (a no-op) makes inductor compute x into a buffer first. Otherwise it inlines x's
    # producer (a norm, an activation) into the loop over the weight's rows and recomputes it for
    # every one of the n outputs: that made compiled decoding 1.4x slower.
    x = x.as_strided(x.shape, x.stride())
    return (x.unsqueeze(-2).float() * weight.float()).sum(-1)


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA for one query a row: q (B, nh, 1, hd), k and v (B, n_kv, S, hd), mask (B, 1, 1, S)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()  # (B, nh, S, hd)
    scores = (q.float().unsqueeze(-2) * k.unsqueeze(2)).sum(-1) / math.sqrt(q.shape[-1])  # (B, nh, 1, S)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs.unsqueeze(-1) * v.unsqueeze(2)).sum(-2).to(q.dtype)  # (B, nh, 1, hd)


def use_cpu_decode_modules(model: Transformer):
    """On CPU, give linears and attention the forwards above (same weights, another forward)."""
    if next(model.parameters()).device.type == "cpu":
        swaps = {nn.Linear: CPUDecodeLinear, quantize.Int8Linear: CPUDecodeInt8Linear, Attention: CPUDecodeAttention}
        for module in model.modules():
            module.__class__ = swaps.get(type(module), type(module))


def compile_functions(dynamic_prefill: bool = False):
    """Compile decoding (CUDA graphs on GPU) and, optionally, prefill for any prompt length. Once
    per process: they stay compiled for every model."""
    global decode_one_token, prefill
    # dynamic=False: a new cache length or batch size compiles anew rather than turning every shape symbolic
    decode_one_token = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True, dynamic=False)
    if dynamic_prefill:
        prefill = torch.compile(prefill, fullgraph=True, dynamic=True)


@torch.no_grad()
def generate(model: Transformer, prompt_tokens: Tensor | list[Tensor], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             stop_ids: list[int] | None = None, callback=None, draft_model: Transformer | None = None,
             draft: str | None = None, speculate_k: int = 5, stats: dict | None = None) -> Tensor | list[Tensor]:
    """Continue one prompt (a 1-D LongTensor) or a batch of prompts (a list of them, any lengths).
    Returns the prompt followed by its new tokens, for each prompt; a row ends after its first stop
    token. callback(tokens (B,)) sees each step's tokens, e.g. for streaming.

    With draft_model (or draft="prompt-lookup") it decodes speculatively (speculative.py): the same
    output, several tokens a target forward; `stats` then receives the acceptance counts."""
    single = isinstance(prompt_tokens, Tensor)
    prompts = [prompt_tokens] if single else list(prompt_tokens)
    check_generate_args(prompts, max_new_tokens, temperature, top_k, top_p)
    if draft_model is not None or draft is not None:
        from speculative import speculative_generate  # it builds on this module

        outputs = speculative_generate(model, prompts, max_new_tokens, draft_model=draft_model,
                                       draft=draft or "model", speculate_k=speculate_k, stop_ids=stop_ids,
                                       stats=stats, temperature=temperature, top_k=top_k, top_p=top_p)
        return outputs[0] if single else outputs
    device = next(model.parameters()).device
    B = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lengths.max())
    model.setup_caches(max_batch_size=B, max_seq_length=padded_length(T + max_new_tokens))

    # Right-pad and prefill from position 0: each row's cache then holds exactly its own prompt; the
    # padding's cache entries lie beyond the row's position and are overwritten as it decodes.
    idx = torch.zeros(B, T, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        idx[i, : len(p)] = p.to(device)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    next_token = prefill(model, idx, torch.arange(T, device=device), lengths - 1, **sampling).clone()
    new_tokens = [next_token]
    input_pos = lengths.unsqueeze(1)  # (B, 1)
    stops = torch.tensor(stop_ids or [], device=device)
    done = torch.isin(next_token, stops)
    if callback:
        callback(next_token[:, 0])
    for step in range(1, max_new_tokens):
        # clone: CUDA graphs reuse their output buffers on the next replay
        next_token = decode_one_token(model, next_token, input_pos, **sampling).clone()
        input_pos = input_pos + 1
        new_tokens.append(next_token)
        if callback:
            callback(next_token[:, 0])
        if stop_ids:
            done |= torch.isin(next_token, stops)
            if step % 8 == 0 and done.all():  # look at the host only now and then: it waits for the GPU
                break

    new_tokens = torch.cat(new_tokens, dim=1).cpu()  # (B, generated)
    outputs = [torch.cat([p.cpu(), until_stop(row, stop_ids)]) for p, row in zip(prompts, new_tokens)]
    return outputs[0] if single else outputs


def until_stop(new_tokens: Tensor, stop_ids: list[int] | None) -> Tensor:
    """new_tokens up to and including the first stop token."""
    hits = torch.isin(new_tokens, torch.tensor(stop_ids or [])).nonzero()
    return new_tokens[: hits[0, 0] + 1] if len(hits) else new_tokens


def check_generate_args(prompts, max_new_tokens, temperature, top_k, top_p):
    if not prompts:
        raise UserError("no prompts given")
    if any(p.ndim != 1 or len(p) == 0 for p in prompts):
        raise UserError("each prompt must be a non-empty 1-D tensor of token ids")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1], got {top_p}")


def padded_length(n: int) -> int:
    """Cache length for n positions, rounded up to a multiple of 64 so that nearby lengths share
    one compiled decode graph."""
    return (n + 63) // 64 * 64


# ---------------------------------------------------------------------------------------------
# Reporting


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights read to decode one token: the state dict (caches are not in it), tied tensors
    once, and no embedding table that is not also the head (untied, or a quantized head kept apart):
    a step reads only one row of it."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    if model.tok_embeddings.weight is not model.output.weight:
        tensors.pop(model.tok_embeddings.weight.data_ptr())
    return sum(t.nbytes for t in tensors.values())


def peak_memory_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux


def synchronize(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Command line


def main(args):
    rank, world_size = tp.maybe_init_distributed()
    try:
        run(args, rank, world_size)
    finally:
        if world_size > 1:
            torch.distributed.destroy_process_group()


def run(args, rank: int = 0, world_size: int = 1):
    if rank != 0:  # only rank 0 speaks (a user error on every rank is printed by rank 0 alone)
        sys.stdout = sys.stderr = open(os.devnull, "w")
    if world_size > 1:
        if args.interactive:
            raise UserError("--interactive reads the terminal from one process: run it without torchrun")
        torch.manual_seed(tp.shared_seed())  # the same logits on every rank must sample the same tokens
    device = args.device or default_device()
    if args.compile and device == "cpu" and not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")):
        raise UserError("--compile on CPU needs a C++ compiler (g++ or clang++) on PATH")
    if args.compile and device.startswith("cuda") and importlib.util.find_spec("triton") is None:
        raise UserError("--compile on GPU needs triton (it comes with PyTorch's CUDA wheels)")
    if args.batch_size < 1 or args.num_samples < 1:
        raise UserError("--batch_size and --num_samples must be at least 1")
    t0 = time.perf_counter()
    model = load_model(args.checkpoint_path, device, args.precision, rank, world_size)
    tokenizer = get_tokenizer(args.checkpoint_path)
    synchronize(device)
    print(f"Loaded the model in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    speculation = load_drafter(args, model, device)
    if args.compile:
        for m in (model, speculation.get("draft_model")):
            if m is not None:
                use_cpu_decode_modules(m)
        compile_functions(dynamic_prefill=args.compile_prefill)
        if speculation:
            import speculative

            speculative.compile_functions()
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.interactive:
        return chat(model, tokenizer, args.max_new_tokens, sampling)

    if not args.prompt:
        raise UserError("the prompt is empty")
    use_chat = tokenizer.chat_format is not None if args.chat is None else args.chat
    prompt = torch.tensor(tokenizer.encode_prompt(args.prompt, chat=use_chat), dtype=torch.long)
    if len(prompt) + args.max_new_tokens > model.config.block_size:
        raise UserError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({args.max_new_tokens}) exceed the "
                        f"model's context length {model.config.block_size}")
    weight_bytes = weight_bytes_per_token(model)
    # the first sample compiles; when compiling, a warm-up sample is run and not counted
    for i in range(-1 if args.compile else 0, args.num_samples):
        synchronize(device)
        t0 = time.perf_counter()
        profiling = args.profile and i == args.num_samples - 1
        stats = {}
        with profiler(args.profile) if profiling else contextlib.nullcontext():
            outputs = generate(model, [prompt] * args.batch_size, args.max_new_tokens, **sampling, **speculation,
                               stats=stats)
        synchronize(device)
        seconds = time.perf_counter() - t0
        if i < 0:
            print(f"Compilation (warm-up sample) took {seconds:.2f} s", file=sys.stderr)
            continue
        print(tokenizer.decode(outputs[0][len(prompt) if use_chat else 0:].tolist()))
        new = sum(len(o) - len(prompt) for o in outputs)
        if stats:
            import speculative

            print(speculative.format_stats(stats, args.speculate_k), file=sys.stderr)
        print(f"Sample {i + 1}: {new} tokens in {seconds:.2f} s, {new / seconds:.2f} tok/s "
              f"({args.batch_size} x {new // args.batch_size}), "
              f"bandwidth {weight_bytes * new / args.batch_size / seconds / 1e9:.2f} GB/s, "
              f"peak memory {peak_memory_gb(device):.2f} GB", file=sys.stderr)


def load_drafter(args, model: Transformer, device: str) -> dict:
    """generate()'s speculative arguments for the CLI's --draft / --draft_checkpoint_path."""
    if args.draft_checkpoint_path:
        draft_model = load_model(args.draft_checkpoint_path, device, args.precision)
    elif args.draft == "self-int4":
        target = resolve_checkpoint(args.checkpoint_path)
        path = quantize.output_path(target, "int4", 32)
        if not path.is_file():
            print(f"quantizing the target to int4 for drafting, once: {path}", file=sys.stderr)
            quantize.quantize(target, "int4", 32)
        draft_model = load_model(path, device, args.precision)
    elif args.draft == "prompt-lookup":
        return dict(draft="prompt-lookup", speculate_k=args.speculate_k)
    else:
        return {}
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise UserError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) is not the "
                        f"target's ({model.config.vocab_size}): they must share a tokenizer")
    return dict(draft_model=draft_model, speculate_k=args.speculate_k)


@contextlib.contextmanager
def profiler(path: str):
    with torch.profiler.profile() as prof:
        yield
    prof.export_chrome_trace(path)
    print(f"profile written to {path} (open it in chrome://tracing or ui.perfetto.dev)", file=sys.stderr)


def chat(model: Transformer, tokenizer: Tokenizer, max_new_tokens: int, sampling: dict):
    """A multi-turn chat in the model's template, printing tokens as they come."""
    if tokenizer.chat_format is None:
        raise UserError("this tokenizer has no chat template, so --interactive cannot format a dialog")
    messages = []
    while True:
        try:
            user = input("You: ").strip()
        except EOFError:
            return
        if not user:
            continue
        messages.append({"role": "user", "content": user})
        prompt = torch.tensor(tokenizer.encode_dialog(messages), dtype=torch.long)
        budget = min(max_new_tokens, model.config.block_size - len(prompt))
        if budget < 1:
            raise UserError("the dialog has reached the model's context length")
        # the cache grows with the dialog by doubling, so that compiled decoding recompiles rarely
        needed = padded_length(len(prompt) + budget)
        model.setup_caches(1, min(1 << (needed - 1).bit_length(), model.config.block_size))
        new, printed = [], ""
        print("Assistant: ", end="", flush=True)

        def stream(tokens: Tensor):
            nonlocal printed
            new.append(int(tokens[0]))
            text = tokenizer.decode([t for t in new if t not in tokenizer.stop_ids])
            if not text.endswith("\ufffd"):  # wait for the rest of a character split across tokens
                print(text[len(printed):], end="", flush=True)
                printed = text

        generate(model, prompt, budget, stop_ids=tokenizer.stop_ids, callback=stream, **sampling)
        print()
        messages.append({"role": "assistant", "content": printed})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="model.safetensors of a converted checkpoint (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default="Tell me about Paris")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: when it has one)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat, streaming the answers")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (exact argmax)")
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="speculative decoding with this draft model (same vocabulary as the target)")
    p.add_argument("--draft", choices=["prompt-lookup", "self-int4"], default=None,
                   help="speculative decoding, drafting from n-grams of the text so far, or with an int4 copy "
                        "of the target")
    p.add_argument("--speculate_k", type=int, default=5, help="tokens drafted per step")
    p.add_argument("--compile", action="store_true", help="compile decoding (CUDA graphs on GPU)")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill, for any prompt length")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--profile", default=None, metavar="TRACE.json",
                   help="write a torch profiler trace of the last sample")
    args = p.parse_args(argv)
    if args.compile_prefill and not args.compile:
        p.error("--compile_prefill goes with --compile")
    if args.draft and args.draft_checkpoint_path:
        p.error("--draft and --draft_checkpoint_path are two drafters: choose one")
    return args


def run_cli(main, args):
    """Run a CLI's main, turning user errors into one line on stderr and exit code 1."""
    try:
        main(args)
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    run_cli(main, parse_args())
