"""A Llama-family transformer with a static KV cache, readable in one sitting.

Weights use Hugging Face's layout (q/k rows as HF stores them, RoPE by rotate-half), with q/k/v
fused into one matmul and gate/up into another: at batch size 1 decoding is bound by reading
weights, and a few large matmuls read them faster than many small ones.
"""

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from errors import UserError


@dataclass
class ModelArgs:
    block_size: int = 2048  # the model's context length
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int | None = None
    n_local_heads: int = -1  # key/value heads (GQA); -1 means n_head
    head_dim: int | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    rope_scaling: dict | None = None  # Llama-3.1 style: factor, low/high_freq_factor, original_max_position_embeddings
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.intermediate_size is None:  # Llama's rule: 2/3 of 4*dim, rounded up to a multiple of 256
            hidden = int(2 * 4 * self.dim / 3)
            self.intermediate_size = 256 * math.ceil(hidden / 256)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        """From our own `model_config.json` (which may hold other keys, e.g. the source)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """Well-known shapes, for benchmarks with random weights."""
        if name not in transformer_configs:
            raise UserError(f"unknown model name {name!r}; known: {', '.join(transformer_configs)}")
        return cls(**transformer_configs[name])


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype, device=None):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # input_pos: (B, T); k, v: (B, T, n_kv, hd). Each row writes at its own positions; what lies
        # beyond a row's position is stale but masked, and gets overwritten before it becomes visible.
        rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)  # (B, 1)
        self.k_cache[rows, :, input_pos] = k
        self.v_cache[rows, :, input_pos] = v
        return self.k_cache, self.v_cache


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        """Allocate the static KV cache and the RoPE table for at least max_seq_length positions
        (a larger cache from before is kept: a new shape would cost compiled code a recompile)."""
        if max_seq_length > self.config.block_size:
            raise UserError(f"{max_seq_length} positions exceed the model's context length "
                            f"{self.config.block_size}: shorten the prompt or max_new_tokens")
        if max_batch_size == self.max_batch_size and max_seq_length <= self.max_seq_length:
            return  # big enough; stale entries are masked by position, so the cache needs no clearing
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        c = self.config
        weight = self.output.weight
        dtype = weight.dtype if weight.is_floating_point() else self.tok_embeddings.weight.dtype
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_length, c.n_local_heads, c.head_dim,
                                               dtype, weight.device)
        self.register_buffer("rope_cache", rope_cache(max_seq_length, c.head_dim, c.rope_base, c.rope_scaling,
                                                      device=weight.device).to(dtype), persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        """idx: (B, T) token ids; input_pos: (T,) positions shared by the batch, or (B, T) per row.
        Returns logits (B, T, vocab_size)."""
        assert self.max_seq_length > 0, "call setup_caches first"
        B, T = idx.shape
        input_pos = input_pos.expand(B, T)
        mask = causal_mask(input_pos, self.max_seq_length)
        rope = self.rope_cache[input_pos]  # (B, T, 2 * hd): cos, then sin
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, rope, mask)
        return self.output(self.norm(x))


def causal_mask(input_pos: Tensor, max_seq_length: int) -> Tensor:
    """(B, 1, T, S): a query at position p sees the cache slots 0..p. That is causal within the new
    tokens, and it hides whatever a longer earlier sequence left behind in the cache."""
    slots = torch.arange(max_seq_length, device=input_pos.device)
    return (slots <= input_pos.unsqueeze(-1)).unsqueeze(1)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, rope: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), input_pos, rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Attention(nn.Module):
    # The two products of decode attention. cpu_decode.py swaps in a form that compiled code fuses
    # into one pass over the cache; everything around the products (scale, mask, softmax) stays here.
    matmul = staticmethod(torch.matmul)

    def __init__(self, config: ModelArgs):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        qkv_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_dim, bias=False)  # rows: q, then k, then v
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, input_pos: Tensor, rope: Tensor, mask: Tensor) -> Tensor:
        B, T, _ = x.shape
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(q.view(B, T, self.n_head, self.head_dim), rope)  # (B, T, nh, hd)
        k = apply_rope(k.view(B, T, self.n_local_heads, self.head_dim), rope)  # (B, T, n_kv, hd)
        v = v.view(B, T, self.n_local_heads, self.head_dim)
        k, v = self.kv_cache.update(input_pos, k, v)  # (B, n_kv, S, hd)
        y = self.attend(q.transpose(1, 2), k, v, mask)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, q_dim))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """softmax(q k^T * scale, where mask) v. q: (B, nh, T, hd); k, v: (B, n_kv, S, hd), each
        key/value head shared by nh / n_kv query heads; mask: (B, 1, T, S), True where a query may look."""
        B, nh, T, hd = q.shape
        if T > 1:  # prefill and verify: PyTorch's fused kernel
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=nh != self.n_local_heads)
        # one query a row (decoding), written out: each k/v head's group of query heads as rows
        q = q.view(B, self.n_local_heads, nh // self.n_local_heads, hd)  # (B, n_kv, group, hd)
        scores = self.matmul(q, k.transpose(-1, -2)).float() * self.scale  # (B, n_kv, group, S)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
        return self.matmul(probs, v).to(q.dtype).view(B, nh, 1, hd)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.intermediate_size, bias=False)  # rows: gate, then up
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # the mean of squares needs fp32 range and precision
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def rope_cache(seq_len: int, head_dim: int, base: float, scaling: dict | None = None, device=None) -> Tensor:
    """cos and sin for every position, (seq_len, 2 * head_dim): [cos | sin], each over head_dim."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = llama3_scale_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout: the two halves share frequencies
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def llama3_scale_frequencies(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama-3.1's long-context RoPE: slow down low frequencies by `factor`, keep high ones, and blend
    smoothly in between (as Meta's reference and HF's `_compute_llama3_parameters`)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, blended, scaled)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    # x: (B, T, h, hd); rope: (B, T, 2 * hd)
    cos, sin = rope.unsqueeze(2).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ---------------------------------------------------------------------------------------------
# Well-known shapes, for benchmarks with random weights (ModelArgs.from_name)

_llama31_rope = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192, rope_type="llama3")
_llama32_rope = dict(_llama31_rope, factor=32.0)
transformer_configs = {
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
}
