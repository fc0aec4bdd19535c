"""Well-known model shapes, for benchmarks and tests with random weights: `shape("Llama-3.1-8B")` is that
model's ModelArgs (its config.json read by convert.py gives the same)."""

from fastllama.errors import UserError
from fastllama.model import ModelArgs


_llama31_rope = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192, rope_type="llama3")
_llama32_rope = dict(_llama31_rope, factor=32.0)


def _gemma(n_layer: int, dim: int, local_every: int, **kw) -> dict:
    """Gemma's shared settings; every local_every-th layer global, the others sliding."""
    return dict(kw, n_layer=n_layer, dim=dim, head_dim=256, norm_eps=1e-6, norm_offset=1.0, sandwich_norms=True,
                activation="gelu_tanh", embedding_scale=dim ** 0.5, attention_scale=256 ** -0.5, tie_embeddings=True,
                sliding_layers=[i for i in range(n_layer) if (i + 1) % local_every])


_qwen = dict(rope_base=1e6, norm_eps=1e-6)
SHAPES = {
    "Llama-2-7B": dict(block_size=4096, n_layer=32, n_head=32, dim=4096),
    "Llama-2-13B": dict(block_size=4096, n_layer=40, n_head=40, dim=5120),
    "Llama-2-70B": dict(block_size=4096, n_layer=80, n_head=64, dim=8192, n_local_heads=8, intermediate_size=28672),
    "CodeLlama-7B": dict(block_size=16384, vocab_size=32016, n_layer=32, n_head=32, dim=4096, rope_base=1e6),
    "CodeLlama-34B": dict(block_size=16384, n_layer=48, n_head=64, dim=8192, n_local_heads=8,
                          intermediate_size=22016, rope_base=1e6),
    "Mistral-7B": dict(block_size=32768, n_layer=32, n_head=32, dim=4096, n_local_heads=8,
                       intermediate_size=14336, rope_base=1e6),
    "TinyLlama-1.1B": dict(n_layer=22, n_head=32, dim=2048, n_local_heads=4, intermediate_size=5632),
    "Llama-3-8B": dict(block_size=8192, vocab_size=128256, n_layer=32, n_head=32, dim=4096, n_local_heads=8,
                       intermediate_size=14336, rope_base=500000.0),
    "Llama-3-70B": dict(block_size=8192, vocab_size=128256, n_layer=80, n_head=64, dim=8192, n_local_heads=8,
                        intermediate_size=28672, rope_base=500000.0),
    "Llama-3.1-8B": dict(block_size=131072, vocab_size=128256, n_layer=32, n_head=32, dim=4096, n_local_heads=8,
                         intermediate_size=14336, rope_base=500000.0, rope_scaling=_llama31_rope),
    "Llama-3.1-70B": dict(block_size=131072, vocab_size=128256, n_layer=80, n_head=64, dim=8192, n_local_heads=8,
                          intermediate_size=28672, rope_base=500000.0, rope_scaling=_llama31_rope),
    "Llama-3.2-1B": dict(block_size=131072, vocab_size=128256, n_layer=16, n_head=32, dim=2048, n_local_heads=8,
                         intermediate_size=8192, head_dim=64, rope_base=500000.0, rope_scaling=_llama32_rope,
                         tie_embeddings=True),
    "Llama-3.2-3B": dict(block_size=131072, vocab_size=128256, n_layer=28, n_head=24, dim=3072, n_local_heads=8,
                         intermediate_size=8192, head_dim=128, rope_base=500000.0, rope_scaling=_llama32_rope,
                         tie_embeddings=True),
    "SmolLM2-135M": dict(block_size=8192, vocab_size=49152, n_layer=30, n_head=9, dim=576, n_local_heads=3,
                         intermediate_size=1536, rope_base=100000.0, tie_embeddings=True),
    "SmolLM2-360M": dict(block_size=8192, vocab_size=49152, n_layer=32, n_head=15, dim=960, n_local_heads=5,
                         intermediate_size=2560, rope_base=100000.0, tie_embeddings=True),
    "SmolLM2-1.7B": dict(block_size=8192, vocab_size=49152, n_layer=24, n_head=32, dim=2048, n_local_heads=32,
                         intermediate_size=8192, rope_base=130000.0, tie_embeddings=True),
    "Qwen2.5-0.5B": dict(_qwen, block_size=32768, vocab_size=151936, n_layer=24, n_head=14, dim=896, n_local_heads=2,
                         intermediate_size=4864, qkv_bias=True, tie_embeddings=True),
    "Qwen2.5-7B": dict(_qwen, block_size=32768, vocab_size=152064, n_layer=28, n_head=28, dim=3584, n_local_heads=4,
                       intermediate_size=18944, qkv_bias=True),
    "Qwen3-0.6B": dict(_qwen, block_size=40960, vocab_size=151936, n_layer=28, n_head=16, dim=1024, n_local_heads=8,
                       head_dim=128, intermediate_size=3072, qk_norm=True, tie_embeddings=True),
    "Qwen3-8B": dict(_qwen, block_size=40960, vocab_size=151936, n_layer=36, n_head=32, dim=4096, n_local_heads=8,
                     head_dim=128, intermediate_size=12288, qk_norm=True),
    "Mistral-7B-v0.1": dict(block_size=32768, n_layer=32, n_head=32, dim=4096, n_local_heads=8,
                            intermediate_size=14336, sliding_window=4096),
    "Mistral-Nemo-12B": dict(block_size=1024000, vocab_size=131072, n_layer=40, n_head=32, dim=5120, n_local_heads=8,
                             head_dim=128, intermediate_size=14336, rope_base=1e6),
    "Gemma-2-2B": _gemma(26, 2304, 2, block_size=8192, vocab_size=256000, n_head=8, n_local_heads=4,
                         intermediate_size=9216, sliding_window=4096, attention_softcap=50.0, logit_softcap=30.0),
    "Gemma-2-9B": _gemma(42, 3584, 2, block_size=8192, vocab_size=256000, n_head=16, n_local_heads=8,
                         intermediate_size=14336, sliding_window=4096, attention_softcap=50.0, logit_softcap=30.0),
    "Gemma-3-1B": _gemma(26, 1152, 6, block_size=32768, vocab_size=262144, n_head=4, n_local_heads=1,
                         intermediate_size=6912, sliding_window=512, qk_norm=True, rope_base=1e6,
                         local_rope_base=10000.0),
    "Gemma-3-12B": _gemma(48, 3840, 6, block_size=131072, vocab_size=262208, n_head=16, n_local_heads=8,
                          intermediate_size=15360, sliding_window=1024, qk_norm=True, rope_base=1e6,
                          local_rope_base=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0)),
    # mixtures of experts; the last, a small one for benchmarks on a CPU (its dense twin: scripts/benchmark.py)
    "Mixtral-8x7B": dict(block_size=32768, n_layer=32, n_head=32, dim=4096, n_local_heads=8, rope_base=1e6,
                         n_experts=8, n_active_experts=2, moe_intermediate_size=14336),
    "Qwen3-30B-A3B": dict(_qwen, block_size=40960, vocab_size=151936, n_layer=48, n_head=32, dim=2048, n_local_heads=4,
                          head_dim=128, qk_norm=True, n_experts=128, n_active_experts=8, moe_intermediate_size=768),
    "OLMoE-1B-7B": dict(block_size=4096, vocab_size=50304, n_layer=16, n_head=16, dim=2048, qk_norm=True,
                        qk_norm_per_head=False, n_experts=64, n_active_experts=8, moe_intermediate_size=1024,
                        normalize_expert_weights=False),
    "MoE-1.3B-A0.4B": dict(block_size=4096, n_layer=24, n_head=16, dim=1024, n_local_heads=4, n_experts=8,
                           n_active_experts=2, moe_intermediate_size=2048),
    "Phi-3-mini": dict(block_size=4096, vocab_size=32064, n_layer=32, n_head=32, dim=3072, intermediate_size=8192,
                       sliding_window=2047),
}


def shape(name: str) -> ModelArgs:
    if name not in SHAPES:
        raise UserError(f"unknown model name {name!r}; known: {', '.join(SHAPES)}")
    return ModelArgs(**SHAPES[name])
