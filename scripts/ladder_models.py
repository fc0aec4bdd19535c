"""The models the benchmarks measure: ours of a known shape with random weights made on the device, or
loaded from a checkpoint; their int8 / int4 copies quantized in memory; and HF transformers' model holding
the same weights, to compare against."""

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, installed or not

from fastllama import generate as gen, quantize  # noqa: E402
from fastllama.checkpoint import load_config, read_metadata  # noqa: E402
from fastllama.convert import hf_names  # noqa: E402
from fastllama.model import ModelArgs, Transformer  # noqa: E402
from shapes import shape  # noqa: E402


def hf_family(c: ModelArgs) -> tuple[str, dict]:
    """The HF architecture computing what `c` does, and its config's settings beyond the shape. (Phi-3-mini's
    4k shape, without partial rotary or longrope, computes what Mistral does: HF's Mistral stands for it.)"""
    layer_types = [("sliding_attention" if c.is_sliding(i) else "full_attention") for i in range(c.n_layer)]
    if c.n_experts:
        moe = dict(num_local_experts=c.n_experts, num_experts=c.n_experts, num_experts_per_tok=c.n_active_experts,
                   norm_topk_prob=c.normalize_expert_weights)
        if not c.qk_norm:
            return "MixtralForCausalLM", dict(moe, intermediate_size=c.moe_intermediate_size,
                                              sliding_window=c.sliding_window)
        if not c.qk_norm_per_head:
            return "OlmoeForCausalLM", dict(moe, intermediate_size=c.moe_intermediate_size)
        return "Qwen3MoeForCausalLM", dict(moe, moe_intermediate_size=c.moe_intermediate_size,
                                           mlp_only_layers=[i for i in range(c.n_layer) if not c.is_moe(i)])
    if c.sandwich_norms:  # Gemma
        gemma = dict(query_pre_attn_scalar=round(c.attention_scale ** -2), sliding_window=c.sliding_window,
                     layer_types=layer_types, hidden_activation="gelu_pytorch_tanh")
        if c.qk_norm:
            return "Gemma3ForCausalLM", dict(gemma, rope_local_base_freq=c.local_rope_base, rope_scaling=c.rope_scaling)
        return "Gemma2ForCausalLM", dict(gemma, attn_logit_softcapping=c.attention_softcap,
                                         final_logit_softcapping=c.logit_softcap)
    if c.qk_norm or c.qkv_bias:
        return ("Qwen3ForCausalLM" if c.qk_norm else "Qwen2ForCausalLM"), dict(
            use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window, layer_types=layer_types)
    if c.rope_dim != c.head_dim or (c.rope_scaling or {}).get("rope_type") == "longrope":
        return "Phi3ForCausalLM", dict(partial_rotary_factor=c.rope_dim / c.head_dim, sliding_window=c.sliding_window,
                                       rope_scaling=c.rope_scaling)
    if c.sliding_window:
        return "MistralForCausalLM", dict(sliding_window=c.sliding_window)
    return "LlamaForCausalLM", dict(rope_scaling=c.rope_scaling)


def hf_model_from(model: Transformer):
    """HF transformers' model of the same family holding the same weights (split back into q/k/v,
    gate/up where HF keeps them apart)."""
    import transformers

    c = model.config
    architecture, settings = hf_family(c)
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "TextConfig" if "Gemma3" in architecture
                                                              else "Config"))
    hf_config = config_class(**{
        **dict(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.intermediate_size,
               num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_local_heads,
               head_dim=c.head_dim, max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
               rope_theta=c.rope_base, tie_word_embeddings=c.tie_embeddings), **settings})
    weight = model.output.weight
    with torch.device("meta"):
        hf = getattr(transformers, architecture)(hf_config)
    # the inverse of our conversion: each of our tensors split into the HF tensors it was made of
    state, ours, hf_shapes = {"lm_head.weight": model.output.weight}, model.state_dict(), hf.state_dict()
    for name, parts in hf_names(c, hf_shapes).items():
        rows = [hf_shapes[p].shape[0] for p in parts]
        state.update(zip(parts, ours[name].reshape(sum(rows), *hf_shapes[parts[0]].shape[1:]).split(rows)))
    hf.load_state_dict({k: v.contiguous() for k, v in state.items()}, assign=True, strict=False)
    with torch.device(weight.device):  # its buffers were made on meta
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)
        if hasattr(hf.model.embed_tokens, "embed_scale"):  # Gemma's
            hf.model.embed_tokens.embed_scale = torch.tensor(c.embedding_scale)
    return hf.to(weight.dtype).eval()


def full_config(args) -> ModelArgs:
    """The whole model's shape (a rank's model holds only its slice)."""
    return shape(args.model) if args.model else load_config(gen.find_checkpoint(args.checkpoint_path))


def load(args, rank: int = 0, world: int = 1) -> Transformer:
    if not args.model:
        return gen.load_model(args.checkpoint_path, args.device, args.precision, rank, world)
    return random_model(full_config(args), args, rank, world)


def random_model(config: ModelArgs, args, rank: int = 0, world: int = 1) -> Transformer:
    """config's model (rank's slice) with random weights made where they run, in their dtype: no host
    or fp32 copy of a 70B."""
    model, _ = gen.empty_model(config, None, rank, world)
    model = model.to(gen.PRECISIONS[args.precision]).to_empty(device=args.device)
    if model.config.tie_embeddings:  # to_empty gave the tied table two tensors
        model.output.weight = model.tok_embeddings.weight
    return randomized(model)


@torch.no_grad()
def randomized(model: Transformer) -> Transformer:
    for weight in model.parameters():
        weight.normal_(0, 0.02)
    gen.device_forms(model)  # as load_model does
    return model.eval()


def dense_twin(c: ModelArgs, args) -> Transformer:
    """The dense model with a MoE model's active size: each routed MLP replaced by one MLP as wide as
    the experts a token goes through, random weights."""
    config = dataclasses.replace(c, n_experts=0, moe_layers=None,
                                 intermediate_size=c.n_active_experts * c.moe_intermediate_size)
    return random_model(config, args)


def resident_bytes(model: Transformer) -> int:
    """What the model holds: weights, KV cache and RoPE tables, each tensor once (not activations)."""
    return sum({t.data_ptr(): t.nbytes for t in [*model.parameters(), *model.buffers()]}.values())


def quantized_copy(model: Transformer, config: ModelArgs, mode: str, groupsize: int, rank: int = 0,
                   world: int = 1) -> Transformer:
    """The model (rank's slice of `config`) with its linears quantized in memory, as quantize.py's --mode
    `mode` writes them (int4 rounded to nearest): random weights have no checkpoint to quantize.
    Embeddings and norms are shared, not copied. Under TP it is sharded as the model is, all-reduces
    included."""
    scheme = quantize.SCHEMES[mode].from_options(groupsize)
    dtype = model.activation_dtype()  # as load_model reads a checkpoint's floats: in the model's precision
    state = {name: t.to(dtype) if t.is_floating_point() else t
             for name, t in quantize.quantized_state_dict(model, scheme).items()}
    quantized, _ = gen.empty_model(config, scheme, rank, world)
    gen.fill(quantized, state)
    quantize.pack_for_device(quantized, scheme)
    gen.device_forms(quantized)  # as load_model does
    return quantized.eval()


def in_memory(quantized: str) -> bool:
    """Whether one of --quantized is a mode to quantize in memory (int8, int4), not a checkpoint."""
    return quantized in quantize.SCHEMES and quantize.SCHEMES[quantized].made_in_memory


def quantized_models(args, model: Transformer | None, rank: int = 0, world: int = 1,
                     config: ModelArgs | None = None) -> dict[str, Callable[[], Transformer]]:
    """name -> make() for each of --quantized: a checkpoint, or int8 / int4 quantized from model in memory."""
    makers = {}
    for q in args.quantized:
        if in_memory(q):
            groupsize = scheme_of(args, q).groupsize
            makers[f"{q}{f' g{groupsize}' if groupsize else ''} (in memory)"] = lambda q=q: quantized_copy(
                model, config or full_config(args), q, args.groupsize, rank, world)
        else:
            makers[Path(q).stem.removeprefix("fastllama_")] = lambda q=q: gen.load_model(
                q, args.device, args.precision, rank, world)
    return makers


def scheme_of(args, quantized: str) -> quantize.Scheme | None:
    """The scheme of one of --quantized: a mode's, with --groupsize, or a checkpoint's (None: unquantized)."""
    if in_memory(quantized):
        return quantize.SCHEMES[quantized].from_options(args.groupsize)
    return quantize.read_scheme(read_metadata(quantized))
