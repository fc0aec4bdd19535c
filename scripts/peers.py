"""Peer libraries measured beside ours in the speed ladder (scripts/benchmark.py --gpt-fast PATH): their
own code, run on our weights, so that the table compares implementations and not checkpoints.

gpt-fast (BSD-3) stays a checkout of its own at PATH; nothing of it is copied here. Its files import
each other as top-level modules (`from model import Transformer`), names that this repository's
command-line scripts hold (generate.py, quantize.py), so load_gpt_fast loads them under private names. What the runner has to change in
gpt-fast's code for the PyTorch it runs on is listed in CHANGES, which the ladder prints.

    gf = load_gpt_fast(PATH)
    theirs = gpt_fast_model(gf, ours, max_seq_length)              # or gpt_fast_quantized(gf, ours, "int8", ...)
    run = runner(gf, theirs, prompt)                               # run(n): n new tokens, greedy
"""

import contextlib
import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

from fastllama.errors import UserError
from fastllama.model import ModelArgs, Transformer

# The changes made to gpt-fast's code to run it on this PyTorch (the ladder prints them and records them)
CHANGES = [
    "int4: torch.ops.aten._convert_weight_to_int4pack takes the 4-bit levels packed two per byte, uint8 (n, k/2), "
    "since PyTorch 2.5, where gpt-fast passes them one per int32 (n, k); its prepare_int4_weight_and_scales_and_zeros "
    "is replaced by one that quantizes with its own group_quantize_tensor, packs the levels as torchao does, and "
    "calls the op (its WeightOnlyInt4QuantHandler and WeightOnlyInt4Linear are unchanged)",
]

# gpt-fast's files, in the order they import each other
FILES = ("model", "tokenizer", "quantize", "generate")

# Greedy through gpt-fast's own sampling, which has no argmax path: top_k=1 leaves only the top token (exact ties
# aside, drawn among), whose probability is then exactly 1, so that its exponential draw picks it whatever the
# draw. Temperature 0 alone is not greedy there: it is clamped to 1e-5, under which a runner-up within about 1e-4
# of the top logit keeps a probability the draw can pick.
GREEDY = dict(temperature=1.0, top_k=1)


@dataclasses.dataclass
class GptFast:
    """gpt-fast's modules, loaded from a checkout under private names."""
    path: Path
    model: ModuleType
    generate: ModuleType
    quantize: ModuleType
    decode_one_token: Callable  # its step as written: generate.decode_one_token is rebound when compiled
    compile_settings: list  # (torch config module, {name: value}): what its generate.py sets at import

    def settings(self) -> contextlib.ExitStack:
        """Its compile settings in force for the block: its rows compile as its own runs do, ours as ours do."""
        stack = contextlib.ExitStack()
        for config, changes in self.compile_settings:
            stack.enter_context(config.patch(changes))
        return stack


def load_gpt_fast(path) -> GptFast:
    """gpt-fast's model.py, tokenizer.py, quantize.py and generate.py from the checkout at `path`, each under a
    private name. While they execute, the top-level names they import each other by are theirs; afterwards
    sys.modules, sys.path (its generate.py appends its parent folder) and torch's compile settings (its
    generate.py sets inductor flags at import) are as they were before."""
    root = Path(path).expanduser().resolve()
    check_checkout(root)
    saved_path, modules = sys.path[:], {}
    # None until each is loaded (an import out of order fails), and GPTQ blocked: its quantize.py imports GPTQ
    # (and through it an eval.py) only for GPTQ, under a bare except, and the ladder does not time GPTQ
    with top_level(dict.fromkeys((*FILES, "GPTQ"))), kept_settings() as compile_settings:
        try:
            for name in FILES:
                modules[name] = sys.modules[name] = load_private(root / f"{name}.py", f"_gpt_fast_{name}")
        except ImportError as e:  # a package its files import (its tokenizer's sentencepiece or tiktoken)
            raise UserError(f"gpt-fast's files at {root} import {e.name}, which is not installed: pip install {e.name}")
        finally:
            sys.path[:] = saved_path
    generate = modules["generate"]
    gf = GptFast(root, modules["model"], generate, modules["quantize"], generate.decode_one_token, compile_settings)
    # CHANGES: the int4 packing of PyTorch >= 2.5, where its handler looks the function up
    gf.quantize.prepare_int4_weight_and_scales_and_zeros = functools.partial(int4_packed, gf.quantize)
    return gf


def check_checkout(root: Path):
    """One line, unless root looks like a gpt-fast checkout (read, not run: a wrong path executes nothing)."""
    wanted = {"model.py": ["class Transformer", "transformer_configs"], "generate.py": ["def decode_one_token"],
              "quantize.py": ["class WeightOnlyInt8QuantHandler", "class WeightOnlyInt4QuantHandler"]}
    for file, names in wanted.items():
        text = (root / file).read_text() if (root / file).is_file() else ""
        missing = [name for name in names if name not in text]
        if missing:
            raise UserError(f"{root} is not a gpt-fast checkout: its {file} has no {' or '.join(missing)}")


def load_private(file: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # under its private name for good, as Python's import does with any module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def top_level(modules: dict):
    """sys.modules[name] = module for each of `modules` during the block (None: an import of it fails),
    then each name exactly as before: the module it was, or absent."""
    saved = {name: sys.modules[name] for name in modules if name in sys.modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


@contextlib.contextmanager
def kept_settings():
    """Torch's compile settings (inductor's, functorch's) as they are, whatever the block sets; yields a list
    that receives (config, what the block changed) for each config it changed."""
    configs = [torch._inductor.config, torch._functorch.config]
    before = [config.get_config_copy() for config in configs]
    changed = []
    try:
        yield changed
    finally:
        for config, old in zip(configs, before):
            changes = {name: value for name, value in config.get_config_copy().items() if value != old[name]}
            for name in changes:
                setattr(config, name, old[name])
            if changes:
                changed.append((config, changes))


def describe(gf: GptFast) -> dict:
    """What the ladder prints and records of the peer: where it came from and what was changed to run it."""
    settings = {name: value for _, changes in gf.compile_settings for name, value in changes.items()}
    return dict(path=str(gf.path), changes=CHANGES, compile_settings=settings)


def gpt_fast_args(gf: GptFast, c: ModelArgs):
    """gpt-fast's ModelArgs of our config's shape: its fields are named as ours are. A model it cannot express
    (anything but a plain Llama: biases, q/k norms, tied embeddings, sliding windows, experts, ...) is refused
    in one line naming what it lacks."""
    # head_dim not carried: gpt-fast derives it as dim // n_head, and so does ModelArgs when not given it
    shape = {f.name: getattr(c, f.name) for f in dataclasses.fields(gf.model.ModelArgs) if f.name != "head_dim"}
    plain = ModelArgs(**shape)  # the Llama of that shape, every variant at its default
    lacking = [f.name for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(plain, f.name)]
    rope_type = (c.rope_scaling or {}).get("rope_type")
    if c.rope_scaling and rope_type != "llama3":  # it scales RoPE as Llama 3.1 does, whatever the dict says
        lacking.append(f"rope_scaling of rope_type {rope_type}")
    if lacking:
        raise UserError(f"gpt-fast's Transformer cannot express this model's {', '.join(lacking)}: --gpt-fast runs "
                        f"Llama-shaped models")
    return gf.model.ModelArgs(**shape)


def interleaved(w: Tensor, n_heads: int) -> Tensor:
    """q's or k's rows (n_heads * head_dim, dim) from HF's order, which RoPE rotates by halves (each head's first
    halves, then its second halves), to the interleaved pairs gpt-fast rotates (Meta's order): row 2i + j of a
    head is row j * head_dim / 2 + i of ours."""
    return w.view(n_heads, 2, -1, w.shape[-1]).transpose(1, 2).reshape(w.shape)


@torch.no_grad()
def gpt_fast_model(gf: GptFast, ours: Transformer, max_seq_length: int | None = None):
    """gpt-fast's Transformer of ours' shape, holding ours' weight tensors themselves where the layouts agree
    (no copy of an 8B's 16 GB): all but wqkv, whose q and k rows are reordered for its RoPE (a new tensor). With
    max_seq_length, its caches are set up (for batch size 1, as its generate() sets them up)."""
    c = ours.config
    with torch.device("meta"):  # no weights of its own: ours are put in
        model = gf.model.Transformer(gpt_fast_args(gf, c))
    state = ours.state_dict()  # named as gpt-fast names them, but for the two fused weights below
    kv_dim = c.n_local_heads * c.head_dim
    for i in range(c.n_layer):
        p = f"layers.{i}."
        # our w13's rows: gate, then up; gpt-fast's w1 and w3 are those two halves (views, not copies)
        state[p + "feed_forward.w1.weight"], state[p + "feed_forward.w3.weight"] = state.pop(
            p + "feed_forward.w13.weight").chunk(2)
        q, k, v = state[p + "attention.wqkv.weight"].split([c.n_head * c.head_dim, kv_dim, kv_dim])
        state[p + "attention.wqkv.weight"] = torch.cat([interleaved(q, c.n_head), interleaved(k, c.n_local_heads), v])
    model.load_state_dict(state, assign=True)
    return with_caches(model.eval(), max_seq_length)


def with_caches(model, max_seq_length: int | None):
    """The model, its caches set up on its device and in its dtype (as its generate() does it)."""
    if max_seq_length is not None:
        with torch.device(model.tok_embeddings.weight.device):
            model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)
    return model


def check_int4(device: str):
    if not device.startswith("cuda"):
        raise UserError("gpt-fast's int4 runs tinygemm (torch.ops.aten._weight_int4pack_mm), a CUDA kernel: on "
                        "CPU, --gpt-fast measures bf16 and int8 (drop int4 from --quantized, or --gpt-fast)")


@torch.no_grad()
def gpt_fast_quantized(gf: GptFast, ours: Transformer, mode: str, groupsize: int, max_seq_length: int | None = None):
    """gpt-fast's model of ours' weights, quantized by its own handlers as its quantize.py does: "int8", weight-only
    per output channel (WeightOnlyInt8QuantHandler), or "int4", groups of `groupsize` packed for tinygemm
    (WeightOnlyInt4QuantHandler; CUDA only)."""
    device = ours.tok_embeddings.weight.device
    if mode == "int4":
        check_int4(device.type)
    model = gpt_fast_model(gf, ours)
    q = gf.quantize
    handler = q.WeightOnlyInt8QuantHandler(model) if mode == "int8" else q.WeightOnlyInt4QuantHandler(model, groupsize)
    with top_level({"model": gf.model}):  # its int4 code imports find_multiple from `model` as it runs
        state = handler.create_quantized_state_dict()
        with torch.device("meta"):  # its quantized linears are made empty, to be filled with the state
            handler.convert_for_runtime()
    model.load_state_dict(state, assign=True)
    return with_caches(model.to(device), max_seq_length)  # its int4 handler hands its weights back on the host


def int4_packed(quantize: ModuleType, weight: Tensor, groupsize: int, inner_k_tiles: int) -> tuple[Tensor, Tensor]:
    """gpt-fast's prepare_int4_weight_and_scales_and_zeros for PyTorch >= 2.5 (CHANGES): its own quantization,
    then the levels two per byte, even columns in the high nibble, as the op now takes them."""
    levels, scales_and_zeros = quantize.group_quantize_tensor(weight, n_bit=4, groupsize=groupsize)
    packed = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles), scales_and_zeros


def runner(gf: GptFast, model, prompt: Tensor, compiled: bool = True) -> Callable[[int], Tensor]:
    """run(n): n new tokens (1, n) greedily after `prompt` (1-D) with gpt-fast's own prefill and decode_n_tokens,
    the steps of its generate(), which cannot make one token alone (it concatenates the decoded ones, none
    then), as the ladder's time to the first token needs. Compiled as its main() compiles: the one-token step
    with mode="reduce-overhead", fullgraph=True, rebound in its module, where decode_n_tokens finds it; prefill
    not (its --compile_prefill does that; the ladder compiles only our decode step too). compiled=False runs its
    step eagerly. The model's caches must hold the prompt and n tokens (gpt_fast_model's max_seq_length)."""
    g = gf.generate
    step = gf.decode_one_token
    g.decode_one_token = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compiled else step
    T, device = len(prompt), prompt.device

    def run(n: int) -> Tensor:
        with torch.no_grad(), gf.settings():
            token = g.prefill(model, prompt.view(1, -1), torch.arange(T, device=device), **GREEDY).clone()
            input_pos = torch.tensor([T], device=device, dtype=torch.int)  # as its generate() makes it
            tokens, _ = g.decode_n_tokens(model, token.view(1, -1), input_pos, n - 1, **GREEDY)
            return torch.cat([token, *tokens], dim=-1)

    return run


def weight_bytes_per_token(model) -> int:
    """Weight bytes a decode step of gpt-fast's model reads, counted as ours are (generate.weight_bytes_per_token):
    every weight but the embedding table, of which a step reads one row; not its KV caches (in its state dict)."""
    return sum(t.nbytes for name, t in model.state_dict().items()
               if not name.startswith("tok_embeddings.") and ".kv_cache." not in name)
