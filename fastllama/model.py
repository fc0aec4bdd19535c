"""A Llama-family transformer with a static KV cache, readable in one sitting.

Weights use Hugging Face's layout (q/k rows as HF stores them, RoPE by rotate-half), with q/k/v
fused into one matmul and gate/up into another: at batch size 1 decoding is bound by reading
weights, and a few large matmuls read them faster than many small ones.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.nn.attention import SDPBackend, sdpa_kernel

from .errors import UserError
from .moe import MoEFeedForward

# The fused attention kernels this code is tested with (tests/test_cuda.py checks them against the
# math backend). Not cuDNN's, which recent PyTorch prefers on Hopper GPUs, and which has had reports of
# wrong results with few key/value heads.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# positions a forward takes at a time: prefill's chunk (decode.prefill_logits), and what a sliding-window
# layer's ring holds beyond its window (Transformer.setup_caches)
PREFILL_CHUNK = 256


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
    # RoPE scaling, by rope_type: "llama3" (factor, low/high_freq_factor, original_max_position_embeddings),
    # "linear" (factor) or "longrope" (short_factor, long_factor, original_max_position_embeddings,
    # attention_factor)
    rope_scaling: dict | None = None
    tie_embeddings: bool = False
    # The variants of the families (convert.py reads them from each config.json); the defaults are Llama.
    rope_dim: int | None = None  # rotate only the first rope_dim of each head (Phi-4-mini); None: all of it
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma stores weight - 1
    sandwich_norms: bool = False  # also normalize attention's and the MLP's outputs (Gemma 2 and 3)
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    embedding_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(dim))
    attention_scale: float | None = None  # scores' scale; None: head_dim ** -0.5
    attention_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    logit_softcap: float | None = None  # the same, on the output logits
    sliding_window: int | None = None  # a query at p sees keys at p - window + 1 .. p ...
    sliding_layers: list[int] | None = None  # ... in these layers (None: every layer)
    local_rope_base: float | None = None  # RoPE base of the sliding layers, unscaled (Gemma 3); None: rope_base
    qk_norm_per_head: bool = True  # qk_norm over each head; False: over all of q's heads, and all of k's (OLMoE)
    # Mixture of experts: a MoE layer's MLP is n_experts MLPs of moe_intermediate_size, of which a
    # router picks n_active_experts per token and sums their outputs, weighted by its probabilities
    n_experts: int = 0  # 0: every MLP is dense
    n_active_experts: int = 2
    moe_intermediate_size: int | None = None
    moe_layers: list[int] | None = None  # the layers whose MLP is routed (None: every layer)
    normalize_expert_weights: bool = True  # the chosen experts' probabilities rescaled to sum to 1 (not OLMoE's)

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.rope_dim is None:
            self.rope_dim = self.head_dim
        if self.intermediate_size is None:  # Llama's rule: 2/3 of 4*dim, rounded up to a multiple of 256
            hidden = int(2 * 4 * self.dim / 3)
            self.intermediate_size = 256 * math.ceil(hidden / 256)
        if self.sliding_window is not None and self.sliding_layers is None:
            self.sliding_layers = list(range(self.n_layer))
        if self.n_experts and self.moe_layers is None:
            self.moe_layers = list(range(self.n_layer))
        if self.n_experts and self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and layer in self.sliding_layers

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and layer in self.moe_layers


# the scaled formats of the KV cache: each key and value vector (one token's head) stored as levels of
# its own scale, the vector's largest magnitude mapped to the format's largest value
SCALED_KV_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


class KVCache(nn.Module):
    """Keys and values by position: position p lives in slot p % length. A full cache has a slot for
    every position; a sliding-window layer's is a ring of fewer slots, which keeps the last ones.

    Stored in `store_dtype`: the model's dtype, another float, or a scaled format (SCALED_KV_MAX:
    int8, rounded to integer levels, or fp8 e4m3), half the bytes of bf16; read back in the model's
    dtype (compiled decoding fuses that into attention's pass over the cache)."""

    def __init__(self, max_batch_size, length, n_heads, head_dim, dtype, device=None, store_dtype=None):
        super().__init__()
        shape = (max_batch_size, n_heads, length, head_dim)
        # no dtype kept as an attribute: dynamo's guard on one is not among those that dict tags let it skip
        # (generate.compiled_once), so the scales carry the model's dtype, and read() is told what to return
        store_dtype = store_dtype or dtype
        self.register_buffer("k_cache", torch.zeros(shape, dtype=store_dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=store_dtype, device=device), persistent=False)
        if store_dtype in SCALED_KV_MAX:  # a scale per token and head: (B, n_heads, length, 1)
            self.register_buffer("k_scales", torch.zeros(*shape[:3], 1, dtype=dtype, device=device), persistent=False)
            self.register_buffer("v_scales", torch.zeros(*shape[:3], 1, dtype=dtype, device=device), persistent=False)

    def write(self, input_pos: Tensor, k: Tensor, v: Tensor, first: int = 0):
        """Write k, v (B, T, n_kv, hd) at positions input_pos (B, T), each row at its own, into the cache's rows
        first .. first + B - 1 (a server steps only as many rows as it runs). What lies in slots a row has
        not written is masked by position (attention_mask) until it is overwritten."""
        B = k.shape[0]
        rows = first + torch.arange(B, device=k.device).unsqueeze(1)  # (B, 1)
        slots = input_pos % self.k_cache.shape[2]
        store = self.k_cache.dtype
        if store not in SCALED_KV_MAX:
            self.k_cache[rows, :, slots] = k.to(store)
            self.v_cache[rows, :, slots] = v.to(store)
            return
        for cache, scales, x in ((self.k_cache, self.k_scales, k), (self.v_cache, self.v_scales, v)):
            scale = (x.float().abs().amax(-1, keepdim=True) / SCALED_KV_MAX[store]).clamp(min=1e-8)  # (B, T, n_kv, 1)
            levels = x.float() / scale
            cache[rows, :, slots] = (levels.round() if store == torch.int8 else levels).to(store)
            scales[rows, :, slots] = scale.to(scales.dtype)

    def read(self, B: int, n_read: int, first: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The keys and values of rows first .. first + B - 1, their first n_read slots, (B, n_kv, n_read, hd),
        in dtype, the model's (compiled code fuses the conversion into the loop that reads them)."""
        rows = slice(first, first + B)
        if self.k_cache.dtype not in SCALED_KV_MAX:
            return self.k_cache[rows, :, :n_read].to(dtype), self.v_cache[rows, :, :n_read].to(dtype)
        return tuple(cache[rows, :, :n_read].to(dtype) * scales[rows, :, :n_read]
                     for cache, scales in ((self.k_cache, self.k_scales), (self.v_cache, self.v_scales)))


class Rows(NamedTuple):
    """What attention takes for a forward's B rows of T positions: they live in the cache's rows first ..
    first + B - 1, at input_pos (B, T), with RoPE's cos and sin (B, T, 2 * rope_dim) and a mask (B, 1, T, n)
    over the cache's first n slots, the only ones read (attention_mask)."""
    first: int
    input_pos: Tensor
    rope: Tensor
    mask: Tensor


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1
        self.chunk = -1
        self.kv_cache_dtype = None
        self.caches_made_for = None

    def setup_caches(self, max_batch_size: int, max_seq_length: int, chunk: int = PREFILL_CHUNK,
                     kv_cache_dtype: torch.dtype | None = None):
        """Allocate the static KV cache and the RoPE tables for at least max_seq_length positions
        (a larger cache from before is kept: a new shape would cost compiled code a recompile). The
        cache is stored in kv_cache_dtype (None: the model's dtype; a scaled format, int8 or fp8: see KVCache).

        A sliding-window layer's cache is a ring of window + chunk slots, and a forward then takes at
        most `chunk` new positions at a time (longer inputs go through in chunks): each of them may
        overwrite only positions that no query of this forward or after it can see."""
        if chunk < 1:
            raise UserError(f"the prefill chunk must be at least 1 position, got {chunk}")
        check_kv_cache_dtype(kv_cache_dtype, self.output.weight.device)
        if max_seq_length > self.config.block_size:
            raise UserError(f"{max_seq_length} positions exceed the model's context length "
                            f"{self.config.block_size}: shorten the prompt or max_new_tokens")
        c = self.config
        weight, dtype = self.output.weight, self.activation_dtype()
        settings = (max_batch_size, chunk, kv_cache_dtype)
        # what else the caches and tables were made for: the model's dtype (it may change by .to()),
        # inference tensors or not (no_grad code cannot write into those), Phi-3's RoPE factors
        caches_made_for = (dtype, torch.is_inference_mode_enabled(), long_rope_factors(c.rope_scaling, max_seq_length))
        if (settings == (self.max_batch_size, self.chunk, self.kv_cache_dtype) and caches_made_for == self.caches_made_for
                and max_seq_length <= self.max_seq_length):
            return  # big enough; stale entries are masked by position, so the cache needs no clearing
        self.max_batch_size, self.chunk, self.kv_cache_dtype = settings
        self.max_seq_length, self.caches_made_for = max_seq_length, caches_made_for
        ring = min(max_seq_length, c.sliding_window + chunk) if c.sliding_window else max_seq_length
        # A full cache has one slot more than it is asked for, never written: a read of the first n
        # slots (decode.key_positions) is then never the whole tensor, or compiled code, seeing the
        # slice become contiguous at n == length, would compile a second graph for that one depth.
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = KVCache(max_batch_size, ring if c.is_sliding(i) else max_seq_length + 1,
                                               c.n_local_heads, c.head_dim, dtype, weight.device, kv_cache_dtype)
        # the position each cache slot holds: slot s of a full cache, position s (or a stale one past
        # the row's, masked); a ring's slots are tracked as they are written, -1 while empty
        positions = torch.arange(max_seq_length + 1, device=weight.device).expand(max_batch_size, -1)
        self.register_buffer("positions", positions, persistent=False)
        if c.sliding_window:
            self.register_buffer("ring_positions", torch.full((max_batch_size, ring), -1, device=weight.device),
                                 persistent=False)
        global_rope, local_rope = rope_tables(c, max_seq_length, weight.device)
        self.register_buffer("rope_cache", global_rope.to(dtype), persistent=False)
        self.register_buffer("local_rope_cache", local_rope.to(dtype), persistent=False)
        # Gemma multiplies in the model's dtype, its sqrt(dim) rounded to it
        self.register_buffer("embedding_scale", torch.tensor(c.embedding_scale, dtype=dtype, device=weight.device),
                             persistent=False)

    def activation_dtype(self) -> torch.dtype:
        """The dtype the model computes in: its weights', its embeddings' where the linears are quantized."""
        weight = self.output.weight
        return weight.dtype if weight.is_floating_point() else self.tok_embeddings.weight.dtype

    def forward(self, idx: Tensor, input_pos: Tensor, key_positions: Tensor | None = None) -> Tensor:
        """idx: (B, T) token ids; input_pos: (T,) positions shared by the batch, or (B, T) per row.
        Returns logits (B, T, vocab_size).

        key_positions: the first n slots of self.positions (decode.key_positions), n above every
        position of input_pos: attention then reads only those n slots of each full cache, so that
        a step costs what the depth needs, not what the cache holds. None: the whole cache."""
        return self.logits(self.hidden_states(idx, input_pos.expand(idx.shape), key_positions))

    def logits(self, x: Tensor) -> Tensor:
        """The last layer's output (B, T, dim) -> logits (B, T, vocab_size)."""
        return softcap(self.output(self.norm(x)), self.config.logit_softcap)

    def hidden_states(self, idx: Tensor, input_pos: Tensor, key_positions: Tensor | None = None,
                      tree: Tensor | None = None, first: int = 0) -> Tensor:
        """The last layer's output (B, T, dim), writing the KV cache's rows first .. first + B - 1 at
        input_pos (B, T)."""
        return self.blocks(self.tok_embeddings(idx) * self.embedding_scale, input_pos, key_positions, tree, first)

    def packed_states(self, groups: list[tuple[Tensor, Tensor, Tensor, int]]) -> list[Tensor]:
        """One forward over groups of rows, each (idx (B, T), input_pos (B, T), key_positions, first: the
        cache row of its first row), their tokens one after another, so that each weight is read once for
        all of them: a server's decode rows beside a chunk of a prompt that joins them (serve.py). Each
        group attends over its own rows of the cache. Returns each group's last layer's output (B, T, dim)."""
        sizes = [idx.numel() for idx, *_ in groups]
        x = torch.cat([self.tok_embeddings(idx).view(1, n, -1) for n, (idx, *_) in zip(sizes, groups)], dim=1)
        rows = [self.attention_rows(input_pos, keys, None, first) for _, input_pos, keys, first in groups]
        x = self.through_layers(x * self.embedding_scale, rows)
        return [states.view(*idx.shape, -1) for states, (idx, *_) in zip(x.split(sizes, dim=1), groups)]

    def blocks(self, x: Tensor, input_pos: Tensor, key_positions: Tensor | None = None,
               tree: Tensor | None = None, first: int = 0) -> Tensor:
        """x (B, T, dim) through every layer, writing the KV cache's rows first .. first + B - 1 at input_pos (B, T).

        tree (T, T), or one a row (B, T, T), for tokens that branch: speculative decoding's drafts as a
        tree, eval.py's choices after their question. tree[..., i, j] when token j is token i's ancestor
        or i itself, the root first. The T tokens then lie in consecutive slots from input_pos[:, 0],
        each at the position of its depth in the tree (RoPE), and each sees the cache before the root
        and, of the tree, only its ancestors and itself. With sliding-window layers, a tree must lie,
        with all it sees, within the window, and take one forward (T <= chunk): a ring then masks as
        the tree does (eval.py's rows; speculative decoding refuses trees for such models)."""
        T = x.shape[1]
        if self.config.sliding_window and T > self.chunk:  # a ring takes at most `chunk` new positions a forward
            assert tree is None, "a tree goes through a sliding-window ring in one forward"
            return torch.cat([self.blocks(x[:, i: i + self.chunk], input_pos[:, i: i + self.chunk], key_positions,
                                          first=first) for i in range(0, T, self.chunk)], dim=1)
        return self.through_layers(x, [self.attention_rows(input_pos, key_positions, tree, first)])

    def attention_rows(self, input_pos: Tensor, key_positions: Tensor | None, tree: Tensor | None, first: int
                       ) -> tuple[Rows, Rows | None]:
        """What attention takes for the rows first .. first + B - 1 at input_pos (B, T) (see blocks): in a
        layer of a full cache, and in a sliding-window layer, whose rings learn the positions written here."""
        assert self.max_seq_length > 0, "call setup_caches first"
        c, B = self.config, input_pos.shape[0]
        key_positions = self.positions[first: first + B] if key_positions is None else key_positions  # (B, n)
        if tree is None:
            rope_pos, full_mask = input_pos, attention_mask(input_pos, key_positions)
        else:
            rope_pos = input_pos[:, :1] + tree.sum(-1) - 1  # (B, T): the positions of the tokens' depths
            full_mask = tree_attention_mask(input_pos, key_positions, tree)
        full = Rows(first, input_pos, self.rope_cache[rope_pos], full_mask)
        if not c.sliding_window:
            return full, None
        rows, ring = torch.arange(B, device=input_pos.device).unsqueeze(1), self.ring_positions[first: first + B]
        ring[rows, input_pos % ring.shape[1]] = input_pos
        ring_mask = (attention_mask(input_pos, ring, c.sliding_window) if tree is None
                     else tree_attention_mask(input_pos, ring, tree))
        return full, Rows(first, input_pos, self.local_rope_cache[rope_pos], ring_mask)

    def through_layers(self, x: Tensor, groups: list[tuple[Rows, Rows | None]]) -> Tensor:
        """x through every layer, each group of rows' attention taking its Rows for the layer's kind of cache."""
        for i, layer in enumerate(self.layers):
            x = layer(x, [sliding if self.config.is_sliding(i) else full for full, sliding in groups])
        return x


def check_kv_cache_dtype(dtype: torch.dtype | None, device: torch.device):
    """fp32, fp16, bf16 or a scaled format (SCALED_KV_MAX); fp8 needs a GPU that has it."""
    if dtype not in (None, torch.float32, torch.float16, torch.bfloat16, *SCALED_KV_MAX):
        raise UserError(f"a KV cache of {dtype} is not supported: use torch.bfloat16, torch.float16, torch.float32, "
                        "torch.int8 or torch.float8_e4m3fn")
    has_fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if dtype == torch.float8_e4m3fn and not has_fp8:
        raise UserError("an fp8 KV cache needs a GPU with fp8 (compute capability 8.9 or newer: Ada, Hopper, "
                        "Blackwell): use --kv_cache_dtype int8 (torch.int8) here")


def rows_at(x: Tensor, index: Tensor) -> Tensor:
    """x (B, T, ...) at each row's own indices into T, index (B,) or (B, n) -> (B, 1 or n, ...)."""
    return x[torch.arange(x.shape[0], device=x.device).unsqueeze(1), index.view(x.shape[0], -1)]


def attention_mask(query_pos: Tensor, key_pos: Tensor, window: int | None = None) -> Tensor:
    """(B, 1, T, S): a query at position p sees the keys at positions 0..p (within the window, if any).
    query_pos: (B, T); key_pos: (B, S) the position held in each cache slot, -1 for none. Being
    causal by position, the mask also hides whatever a longer earlier sequence left in the cache."""
    q, k = query_pos.unsqueeze(-1), key_pos.unsqueeze(1)  # (B, T, 1), (B, 1, S)
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible &= k > q - window
    return visible.unsqueeze(1)


def tree_attention_mask(input_pos: Tensor, key_pos: Tensor, tree: Tensor) -> Tensor:
    """(B, 1, T, S): the T tokens of a tree (T, T) or of a tree a row (B, T, T), in consecutive slots
    from input_pos[:, 0] (B, T), see the keys before the first of them and, of their own, the ones the
    tree marks. key_pos: (B, S)."""
    (B, S), T = key_pos.shape, tree.shape[-1]
    node = key_pos - input_pos[:, :1]  # (B, S): the token of the tree a slot holds, when in 0..T-1
    in_tree = (node >= 0) & (node < T)
    sees = tree.expand(B, T, T).gather(2, node.clamp(0, T - 1).unsqueeze(1).expand(B, T, S))  # (B, T, S)
    before = ((key_pos >= 0) & (node < 0)).unsqueeze(1)  # (B, 1, S)
    return torch.where(in_tree.unsqueeze(1), sees, before).unsqueeze(1)


def softcap(x: Tensor, cap: float | None) -> Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs, layer: int):
        super().__init__()
        self.attention = Attention(config)
        activation = ACTIVATIONS[config.activation]
        self.feed_forward = (MoEFeedForward(config, activation) if config.is_moe(layer)
                             else FeedForward(config, activation))
        norm = lambda: RMSNorm(config.dim, config.norm_eps, config.norm_offset)  # noqa: E731
        self.attention_norm, self.ffn_norm = norm(), norm()
        self.post_attention_norm = norm() if config.sandwich_norms else nn.Identity()
        self.post_ffn_norm = norm() if config.sandwich_norms else nn.Identity()

    def forward(self, x: Tensor, groups: list[Rows]) -> Tensor:
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), groups))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Attention(nn.Module):
    # The two products of written-out attention. On CPU, cpu_decode.py swaps in a form that compiled code
    # fuses into one pass over the cache; everything around the products (scale, mask, softmax) stays here.
    product = staticmethod(torch.matmul)
    # The device's decode attention kernel (attend_cache) and the most query rows a key/value head it takes
    decode_kernel, decode_rows = None, 0

    def __init__(self, config: ModelArgs):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        self.scale = config.attention_scale or config.head_dim ** -0.5
        self.softcap = config.attention_softcap
        self.qk_norm_per_head = config.qk_norm_per_head
        qkv_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_dim, bias=config.qkv_bias)  # rows: q, then k, then v
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        if config.qk_norm:
            q_size, k_size = (1, 1) if config.qk_norm_per_head else (config.n_head, config.n_local_heads)
            self.q_norm = RMSNorm(q_size * config.head_dim, config.norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(k_size * config.head_dim, config.norm_eps, config.norm_offset)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, groups: list[Rows]) -> Tensor:
        """x (B, T, dim), the rows of groups[0]; or (1, N, dim), several groups' tokens one after another
        (Transformer.packed_states), which share the products and attend each over its own rows."""
        qkv = self.wqkv(x)
        parts = [qkv] if len(groups) == 1 else qkv.split([g.input_pos.numel() for g in groups], dim=1)
        # every group's keys and values go into the cache before any group reads it: compiled code then
        # writes the cache in place (a read between two writes had it copy each layer's whole cache)
        queries = [self.write_rows(part, rows) for part, rows in zip(parts, groups)]
        ys = [self.attend_cache(q, rows.mask, rows.first).transpose(1, 2).reshape(*part.shape[:2], -1)
              for q, part, rows in zip(queries, parts, groups)]
        return self.wo(ys[0] if len(ys) == 1 else torch.cat(ys, dim=1))

    def write_rows(self, qkv: Tensor, rows: Rows) -> Tensor:
        """The rows' products with wqkv, (B, T, ...) or their B * T tokens (1, B * T, ...): their keys and
        values written into the cache, their queries returned, (B, nh, T, hd)."""
        (B, T), q_dim, kv_dim = rows.input_pos.shape, self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = qkv.reshape(B, T, -1).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(self.normed_heads(self.q_norm, q, self.n_head), rows.rope)  # (B, T, nh, hd)
        k = apply_rope(self.normed_heads(self.k_norm, k, self.n_local_heads), rows.rope)  # (B, T, n_kv, hd)
        self.kv_cache.write(rows.input_pos, k, v.view(B, T, self.n_local_heads, self.head_dim), rows.first)
        return q.transpose(1, 2)

    def normed_heads(self, norm: nn.Module, x: Tensor, n_heads: int) -> Tensor:
        """x (B, T, n_heads * hd) -> (B, T, n_heads, hd), normalized over each head or over all of them."""
        B, T, _ = x.shape
        return norm(x.view(B, T, n_heads if self.qk_norm_per_head else 1, -1)).view(B, T, n_heads, self.head_dim)

    def path(self, T: int, S: int) -> str:
        """How attention runs for T queries over S keys: "written" out as its two products (a decode step,
        too little for a fused kernel's launch; soft-capped scores, which no fused kernel takes); "folded",
        the fused kernel given each key/value head's query heads as the rows of one head (with a mask,
        PyTorch's flash kernel takes none and its memory-efficient one no grouped heads: sdp_utils.cpp;
        grouped heads would fall to the math backend, which writes out every score); or "fused".
        cpu_decode.py gives CPU models the CPU's choice (cpu_decode.attention_path)."""
        if T == 1 or self.softcap is not None:
            return "written"
        return "folded" if self.n_head > self.n_local_heads else "fused"

    def attend_cache(self, q: Tensor, mask: Tensor, first: int = 0) -> Tensor:
        """attend() over the first mask.shape[-1] slots of the cache's rows from `first`. A decode or verify step
        (up to decode_rows query rows a key/value head) goes through the device's kernel where it has one
        (cpu_decode.py, kernels.py), which reads the cache as it is stored; soft-capped scores and longer
        forwards are read back here."""
        B, nh, T, hd = q.shape
        rows = self.n_head // self.n_local_heads * T
        # T is symbolic in prefill, compiled with dynamic shapes: no guard on it
        few = (statically_known_true(rows <= self.decode_rows) if torch.compiler.is_compiling()
               else rows <= self.decode_rows)
        if self.decode_kernel is None or self.softcap is not None or not few:
            k, v = self.kv_cache.read(B, mask.shape[-1], first, q.dtype)  # (B, n_kv, n, hd)
            return self.attend(q, k, v, mask)
        cache = self.kv_cache
        scales = (cache.k_scales[first:], cache.v_scales[first:]) if hasattr(cache, "k_scales") else (None, None)
        y = self.decode_kernel(q.reshape(B, self.n_local_heads, rows, hd), cache.k_cache[first:],
                               cache.v_cache[first:], *scales, mask, self.scale)
        return y.to(q.dtype).view(B, nh, T, hd)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """softmax(q k^T * scale, where mask) v. q: (B, nh, T, hd); k, v: (B, n_kv, S, hd), each
        key/value head shared by nh / n_kv query heads; mask: (B, 1, T, S), True where a query may look."""
        B, nh, T, hd = q.shape
        # head counts from the module, not from shapes, which compiling with dynamic=True makes symbolic
        n_kv, group, S = self.n_local_heads, self.n_head // self.n_local_heads, k.shape[2]
        path = self.path(T, S)
        if path == "fused":
            return self.fused(q, k, v, mask, grouped=group > 1)
        if path == "folded":
            mask = mask.unsqueeze(2).expand(B, 1, group, T, S).reshape(B, 1, group * T, S)
            folded = self.fused(q.reshape(B, n_kv, group * T, hd), k, v, mask, grouped=False)
            return folded.reshape(B, nh, T, hd)
        # written out: each k/v head with its group of query heads as the rows of one product, so that no
        # head's keys are repeated
        q = q.reshape(B, n_kv, group * T, hd)
        scores = softcap(self.product(q, k.transpose(-1, -2)).float() * self.scale, self.softcap)  # (B, n_kv, g*T, S)
        scores = scores.view(B, n_kv, group, T, S).masked_fill(~mask.unsqueeze(2), float("-inf"))
        probs = scores.softmax(-1).to(v.dtype).view(B, n_kv, group * T, S)
        return self.product(probs, v).to(q.dtype).view(B, nh, T, hd)

    def fused(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, grouped: bool) -> Tensor:
        """PyTorch's fused attention, one of SDPA_BACKENDS; grouped: q has more heads than k, a multiple."""
        with sdpa_kernel(SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=grouped)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs, activation):
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.intermediate_size, bias=False)  # rows: gate, then up
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(self.activation(gate) * up)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # the mean of squares needs fp32 range and precision
        normed = xf * torch.rsqrt(self.mean_square(xf) + self.eps)
        return (normed * (self.offset + self.weight.float())).type_as(x)

    def mean_square(self, xf: Tensor) -> Tensor:  # tp.ShardedRMSNorm overrides it: the vector is split across ranks
        return xf.pow(2).mean(-1, keepdim=True)


def rope_tables(config: ModelArgs, seq_len: int, device=None) -> tuple[Tensor, Tensor]:
    """RoPE's cos and sin for every position, (seq_len, 2 * rope_dim), for the global layers and for
    the sliding ones (the same table, unless they have a base of their own)."""
    full = rope_cache(seq_len, config.rope_dim, config.rope_base, config.rope_scaling, device)
    if config.local_rope_base is None:
        return full, full
    return full, rope_cache(seq_len, config.rope_dim, config.local_rope_base, None, device)


def rope_cache(seq_len: int, dim: int, base: float, scaling: dict | None = None, device=None) -> Tensor:
    """cos and sin for every position, (seq_len, 2 * dim): [cos | sin], each over dim."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32).unsqueeze(1)  # (seq_len, 1)
    rope_type, magnitude = (scaling or {}).get("rope_type", "default"), 1.0
    if rope_type == "llama3":
        inv_freq = llama3_scale_frequencies(inv_freq, scaling)
    elif rope_type == "linear":  # positions slowed down by `factor`
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "longrope":  # Phi-3: per-frequency factors, one set for the original context, one beyond
        factors = "long_factor" if long_rope_factors(scaling, seq_len) else "short_factor"
        inv_freq = inv_freq / torch.tensor(scaling[factors], device=device)
        magnitude = scaling["attention_factor"]
    angles = positions * inv_freq  # (seq_len, dim / 2)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout: the two halves share frequencies
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * magnitude


def long_rope_factors(scaling: dict | None, seq_len: int) -> bool:
    """Whether Phi-3's longrope takes its long factors, at every position: when the cache reaches past
    the original context (as llama.cpp chooses by its context; HF's forward over a text that long uses
    them at every position too). One set for the whole cache, so that keys and queries agree."""
    return (scaling or {}).get("rope_type") == "longrope" and seq_len > scaling["original_max_position_embeddings"]


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
    # x: (B, T, h, hd); rope: (B, T, 2 * rope_dim)
    rope_dim = rope.shape[-1] // 2
    if rope_dim < x.shape[-1]:  # partial rotary: the rest of each head is not rotated
        return torch.cat([apply_rope(x[..., :rope_dim], rope), x[..., rope_dim:]], dim=-1)
    cos, sin = rope.unsqueeze(2).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
