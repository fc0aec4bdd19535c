"""The products on CPU: the few rows of compiled decode and verify steps as multiply-and-sum
expressions, and the many rows of prefill in fp32 where the CPU has no native bf16 matmul.

Inductor fuses such an expression into one vectorized loop over the weight (or the cache), which on
CPU reads it faster than the BLAS call aten.mm makes at a few rows, converts int8 in registers, and
fuses attention's softmax between its two products (scripts/benchmark.py measures the matmul side;
benchmarks/RESULTS.md has the figures). A speculative verify step's k + 1 rows (up to FEW_ROWS) go through one
such loop too, each weight element read once for all of them, and so do the query heads that share a
key/value head in a decode step's attention, each key and value read once for all of them (in a
verify step's, for each of its positions, up to ATTENTION_ROWS rows in all, where the fused attention
kernel cost more). Eager calls and calls of many rows keep PyTorch's kernels.

Without AVX-512, oneDNN has no bf16 matmul of its own speed: a bf16 product of many rows runs several
times slower than converting the weight and multiplying in fp32 (benchmarks/RESULTS.md, "CPUs
without AVX-512"). There a bf16 model's products of MANY_ROWS or more (prefill, scoring) run in fp32
and round their output back to bf16 (matmul_dtype); fewer rows keep bf16, which is faster at one row.

    cpu_decode.apply(model)   # once, at load (generate.load_model); a no-op for a model on another device

`pack(model)` gives each bf16 linear a second copy of its weight in a kernel's layout, for the callers
whose products have several rows: speculative_generate for its target's verify steps, serve.py for its
batched steps and its prompts. Where the CPU has AVX-512 BF16 the copy is in tiles for a kernel of our own,
cpu_linear.cpp, whose products of up to TILE_ROWS rows read it faster than oneDNN's kernel reads its own
layout, and than the loop above at one row (benchmarks/RESULTS.md, "Bf16 products of our own on CPU").
Where that kernel is not built (no compiler, FASTLLAMA_BF16_KERNEL=0) but oneDNN has bf16 kernels, the
copy is in oneDNN's layout ("Packed weights for verify steps"), and one or two rows keep the loop.
eval.py's scoring forwards, of many rows, read oneDNN's copy (`pack(model, many_rows=True)`), faster
there than F.linear's ("Scoring through oneDNN's packed weights").

Only the products change: the attention math around them (scale, mask, softmax, any variant) is
model.py's own, so compiled decoding computes what eager decoding computes. One exception, tested
against that math: on CPUs with AVX-512 or AVX2, the attention of a decode or verify step (up to ATTENTION_ROWS
rows a key/value head) runs in a kernel of our own, cpu_attention.cpp, built at first use; it reads the
cache as stored (an int8 cache's scales applied to finished dot products), skips the slots no row sees,
and splits a head's positions between the threads, where the compiled form read the cache at about half
the speed (benchmarks/RESULTS.md, "A decode attention kernel of our own"). Where it cannot be built, and
for what it does not take (soft-capped scores, head_dim not a multiple of 16), the compiled form serves.
int8 and int4 weights have kernels of their own in cpu_linear.cpp too (int8_kernel() and int4_kernel() below),
which quantize.py chooses at load.
"""

import functools
import hashlib
import os
import sys
import types
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .model import Attention, Transformer
from .moe import ExpertLinears

# ---------------------------------------------------------------------------------------------
# How many rows (or keys) make a CPU product or attention take which form: every such count, here

# A compiled linear of at most this many rows reads its weight once for all of them (few_rows_product):
# a verify step of k <= 8 drafts.
FEW_ROWS = 9
# ... of which at most this many keep that loop though oneDNN's packed copy of the weight is there (FewRowLinear):
# faster at one row, and at two, where oneDNN's product costs about what it costs at six
# (benchmarks/RESULTS.md, "Packed weights for verify steps", "The draft head on the target's own chats").
LOOP_ROWS = 2
# A bf16 product of at most this many rows reads a copy of the weight in cpu_linear.cpp's tiles, where pack()
# made one: faster than oneDNN's product there, and slower at more rows, which read the plain weight
# (benchmarks/RESULTS.md, "Bf16 products of our own on CPU", "The server's prompts through the tiles")
TILE_ROWS = 128
# From this many rows a bf16 product runs in fp32 on a CPU without native bf16 matmuls (matmul_dtype):
# where fp32 overtakes bf16 (benchmarks/RESULTS.md, "CPUs without AVX-512").
MANY_ROWS = 16
# An int8 product of at most this many rows takes PyTorch's int8 kernel where ours is not built (quantize.Int8Linear);
# more rows (prefill) a matmul of the weight converted a block at a time, where that kernel is slower
INT8_KERNEL_ROWS = 16
# A compiled attention product of at most this many rows a key/value head (its query heads, times a
# verify step's positions) is written out, reading each key once for all of them (attention_path).
ATTENTION_ROWS = 16
# An eager forward over at most this many keys writes its attention out: there the fused kernel's cost is
# mostly its fixed cost a call (benchmarks/RESULTS.md, "Scoring: short attention written out"): eval.py's
# scoring of short rows. A generation reads whole blocks of decode.KV_BLOCK keys.
SHORT_ATTENTION_KEYS = 128
# Forwards of at most this many positions, known when compiling (verify steps, draft trees, short eager
# prompts), give the fused kernel each key/value head's query heads as one head's rows (Attention.path);
# longer ones (prefill's chunks) gained nothing so (benchmarks/RESULTS.md, "Verify steps: a key/value
# head's query heads as one head's rows"), and a guard on compiled prefill's symbolic length would split
# its one graph.
FOLDED_ATTENTION_POSITIONS = 16
# A compiled weighted sum of values (attention's second product, values_product) adds up this many
# positions' value rows at a time, and then those partial sums: one running sum over all the positions
# strides down the cache's rows and reads it at about half the speed (benchmarks/RESULTS.md, "Decode
# attention at depth").
VALUE_BLOCK = 8


def one_row_product(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., k) of one row times weight (n, k) transposed, accumulated in fp32; or rows (P, k), each
    times its own weight (P, n, k) (a MoE layer's experts)."""
    return (in_fp32_buffer(x).unsqueeze(-2) * weight.float()).sum(-1)


def in_fp32_buffer(x: Tensor) -> Tensor:
    """x in fp32, which compiled code computes into a buffer of its own before a product reads it. The
    no-op as_strided keeps inductor from inlining x's producer (a norm, an activation) into the loop
    over the weight's rows, where it would be recomputed for every one of the n outputs. fp32 rather
    than bf16: with a bf16 input the loop goes 32 elements at a time and loads an int8 weight in
    partial vectors, several times slower (benchmarks/RESULTS.md, "Speculation on the newer machine")."""
    x = x.float()
    return x.as_strided(x.shape, x.stride())




def rows_product(a: Tensor, b: Tensor) -> Tensor:
    """a (..., m, k) @ b (..., k, n) in fp32, for a few rows (m an int): a reduction per row of a over
    the same b, which inductor fuses into one loop that loads each element of b once and multiplies it
    into every row's sum (the product as one expression over (m, k, n) would read b once per row)."""
    a = in_fp32_buffer(a)
    return torch.stack([(a[..., i, :, None] * b.float()).sum(-2) for i in range(a.shape[-2])], dim=-2)


def few_rows_product(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., k) of at most FEW_ROWS rows times weight (n, k) transposed, accumulated in fp32."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        return one_row_product(x, weight)
    return rows_product(rows, weight.t()).view(*x.shape[:-1], -1)


def attention_path(attention: Attention, T: int, S: int) -> str:
    """Attention.path on CPU: also written out for an eager forward over few keys and a compiled one of
    few rows, and folded only for a few positions (the counts above say why)."""
    group = attention.n_head // attention.n_local_heads
    compiling = torch.compiler.is_compiling()
    few_keys = not compiling and S <= SHORT_ATTENTION_KEYS
    few_rows = compiling and known_count(group * T, ATTENTION_ROWS)
    if T == 1 or attention.softcap is not None or few_keys or few_rows:
        return "written"
    return "folded" if group > 1 and statically_known_true(T <= FOLDED_ATTENTION_POSITIONS) else "fused"


# Decode attention's own kernel (cpu_attention.cpp), on CPUs with AVX-512 or AVX2, for the models apply() is given:
# FASTLLAMA_ATTENTION_KERNEL=0 in the environment (or this set False) leaves the compiled form alone, to compare
# (kernels.apply reads it too, for the GPU's kernel)
USE_ATTENTION_KERNEL = os.environ.get("FASTLLAMA_ATTENTION_KERNEL", "1") != "0"
# ... and products' (cpu_linear.cpp), on CPUs with AVX-512 BF16 or AVX2: FASTLLAMA_INT4_KERNEL=0 leaves int4's to
# PyTorch's kernel, FASTLLAMA_INT8_KERNEL=0 int8's to quantize.int8_kernel's other forms, FASTLLAMA_BF16_KERNEL=0 a
# packed bf16 copy to oneDNN's
USE_INT4_KERNEL = os.environ.get("FASTLLAMA_INT4_KERNEL", "1") != "0"
USE_INT8_KERNEL = os.environ.get("FASTLLAMA_INT8_KERNEL", "1") != "0"
USE_BF16_KERNEL = os.environ.get("FASTLLAMA_BF16_KERNEL", "1") != "0"


@functools.cache
def built(name: str, what: str) -> bool:
    """Whether the kernels of fastllama/{name}.cpp are built and registered (torch.ops.fastllama): at first
    use (PyTorch keeps the build, in ~/.cache/torch_extensions, for the processes after), on CPUs with AVX2 or
    AVX-512. Where one cannot be built (another CPU, no C++ compiler or ninja), PyTorch's own form of `what`
    serves, said in one line."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AMX"):
        return False
    try:
        from torch.utils import cpp_extension
        source = Path(__file__).with_name(f"{name}.cpp")
        cpp_extension.load(extension_name(source), [str(source)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           is_python_module=False)
    except Exception as e:  # noqa: BLE001 (any failure to build leaves the compiled form, which is correct)
        said = (str(e).splitlines() or [type(e).__name__])[0]
        print(f"note: the CPU kernel for {what} could not be built ({said}); PyTorch's own form runs instead",
              file=sys.stderr)
        return False
    return True


def extension_name(source: Path) -> str:
    """A kernel's build name, with the digest of its source and the header it includes: PyTorch keeps one build a
    name, so a fork and the installed library, or two checkouts, each keep their own rather than rebuild in turn."""
    digest = hashlib.sha256(source.read_bytes() + source.with_name("cpu_vectors.h").read_bytes()).hexdigest()[:12]
    return f"fastllama_{source.stem}_{digest}"


@functools.cache
def attention_kernel():
    """torch.ops.fastllama.decode_attention from cpu_attention.cpp, or None where it cannot be built."""
    if not built("cpu_attention", "decode attention"):
        return None
    torch.library.register_fake("fastllama::decode_attention")(
        lambda q, k, v, k_scales, v_scales, mask, scale: q.new_empty(q.shape, dtype=torch.float32))
    return torch.ops.fastllama.decode_attention


def decode_attention(q, k, v, k_scales, v_scales, mask, scale):
    """attention_kernel()'s op with the mask given as bytes: compiled code writes the mask out for each
    layer's call, and it writes bools one at a time where it writes bytes a vector at a time (benchmarks/
    RESULTS.md, "An int8 cache's products in integers")."""
    return torch.ops.fastllama.decode_attention(q, k, v, k_scales, v_scales, mask.to(torch.uint8), scale)


@functools.cache
def linear_kernels() -> bool:
    """Whether cpu_linear.cpp's products are built (CPUs with AVX-512 BF16, or AVX2 with FMA and F16C):
    torch.ops.fastllama.bf16_rows, int8_rows and int4_rows."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2" and not torch.cpu._is_avx512_bf16_supported():
        return False  # AVX-512 without BF16: its vdpbf16ps is what the kernel's AVX-512 form is built on
    if not built("cpu_linear", "bf16, int8 and int4 products"):
        return False
    torch.library.register_fake("fastllama::bf16_rows")(
        lambda x, w: x.new_empty(x.shape[0], w.shape[0] * 16, dtype=torch.float32))
    torch.library.register_fake("fastllama::bf16_linear")(
        lambda x, w, tiles, bias, max_rows: x.new_empty(x.shape[0], w.shape[0]))
    torch.library.register_fake("fastllama::int4_rows")(
        lambda x, w, sm, levels=None: x.new_empty(x.shape[0], w.shape[0] * 16, dtype=torch.float32))
    torch.library.register_fake("fastllama::int8_rows")(
        lambda x, w: x.new_empty(x.shape[0], w.shape[0] * 16, dtype=torch.float32))
    return True


def int4_kernel():
    """torch.ops.fastllama.int4_rows, or None where it is not built (quantize.int4_kernel then chooses
    PyTorch's)."""
    return torch.ops.fastllama.int4_rows if USE_INT4_KERNEL and linear_kernels() else None


def rounds_activations(bits: int) -> bool:
    """Whether int4_kernel()'s (bits 4) or int8_kernel()'s (bits 8) products take x rounded to int8 a block of 32
    inputs at a time, as llama.cpp's products with a Q4 or Q8_0 weight do: wherever the kernel is built, since its
    products in integers take less time than the exact forms, which were bound by their arithmetic (benchmarks/
    RESULTS.md, "Int4 products in integers on AVX2", "Int4 products in integers on AVX-512", "Int8 products in
    integers"). PyTorch's kernels take x exact."""
    return (int4_kernel() if bits == 4 else int8_kernel()) is not None


def int8_kernel():
    """torch.ops.fastllama.int8_rows, or None where it is not built (quantize.int8_kernel then chooses another)."""
    return torch.ops.fastllama.int8_rows if USE_INT8_KERNEL and linear_kernels() else None


def bf16_kernel():
    """torch.ops.fastllama.bf16_rows, or None where it is not built (pack() then makes oneDNN's copies), and on
    CPUs without AVX-512 BF16: there bf16_linear's products of many rows would run in bf16, where fp32 is several
    times faster (matmul_dtype)."""
    ok = USE_BF16_KERNEL and torch.cpu._is_avx512_bf16_supported() and linear_kernels()
    return torch.ops.fastllama.bf16_rows if ok else None


def attention_product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for attention's products, (..., m, k) @ (..., k, n), in fp32 when compiling. A decode or
    verify step's m <= ATTENTION_ROWS rows (the query heads that share a key/value head, times the
    positions) go through rows_product, or values_product for the values: each key and value read once
    for all of them."""
    if not torch.compiler.is_compiling():
        return torch.matmul(a, b)
    m, k = a.shape[-2:]
    if known_count(m, ATTENTION_ROWS):
        # the values lie in memory as rows of head_dim, the keys come transposed. A read of a number of
        # slots that is not whole blocks (a cache cut at the context's end) gets a graph of its own.
        if b.stride(-1) == 1 and k % VALUE_BLOCK == 0:
            return values_product(a, b)
        return rows_product(a, b)
    return (a.unsqueeze(-1).float() * b.unsqueeze(-3).float()).sum(-2)


def values_product(probs: Tensor, values: Tensor) -> Tensor:
    """probs (..., m, S) @ values (..., S, hd), m an int and S a multiple of VALUE_BLOCK, in fp32: the
    sum over positions taken VALUE_BLOCK value rows at a time, then over those blocks' sums, each block
    read once for all m rows."""
    *lead, m, S = probs.shape
    blocks = values.float().reshape(*lead, S // VALUE_BLOCK, VALUE_BLOCK, values.shape[-1])
    probs = in_fp32_buffer(probs).reshape(*lead, m, S // VALUE_BLOCK, VALUE_BLOCK, 1)
    return torch.stack([(probs[..., i, :, :, :] * blocks).sum(-2).sum(-2) for i in range(m)], dim=-2)


# oneDNN's own test for a bf16 path (AVX-512 or newer on x86): without it, bf16 matmuls crawl
SLOW_BF16_MATMUL = torch.backends.mkldnn.is_available() and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
# a weight of another dtype is converted for a product at most this many elements at a time (16 MB of fp32)
CONVERTED_ELEMENTS = 1 << 22


def matmul_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype in which x (..., k) is multiplied by a weight: fp32 for MANY_ROWS or more bf16 rows on a CPU
    without native bf16 matmuls, x's own otherwise. None where that turns on a count compiled code has symbolic
    (prefill's, compiled for any length and number of prompts), which is not asked (known_count says why)."""
    if not (SLOW_BF16_MATMUL and x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return x.dtype
    rows = x.shape[:-1].numel()
    if statically_known_true(rows >= MANY_ROWS):
        return torch.float32
    return x.dtype if statically_known_true(rows < MANY_ROWS) else None


def product_form(x: Tensor, weight: Tensor) -> str | torch.dtype | None:
    """How linear_for_rows multiplies x (..., k) by weight: "int8" (PyTorch's int8 kernel, for up to
    INT8_KERNEL_ROWS rows of an int8 weight), or a matmul's dtype (matmul_dtype). None where that turns on a
    count compiled code has symbolic (prefill's), which is not asked (known_count says why)."""
    rows = x.shape[:-1].numel()
    if weight.dtype == torch.int8 and not statically_known_true(rows > INT8_KERNEL_ROWS):
        return "int8" if statically_known_true(rows <= INT8_KERNEL_ROWS) else None
    return matmul_dtype(x)


def linear_for_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None, scales: Tensor | None = None) -> Tensor:
    """F.linear(x, weight) (times per-output scales, plus bias) in x's dtype, in the form its count of rows asks
    (product_form). Where compiled code cannot know the form, through an op that chooses when it runs: so a short
    prompt keeps its speed, and prefill one graph for every length."""
    form = product_form(x, weight)
    if form is None:
        return chosen_when_run(x, weight, bias, scales)
    if form == "int8":
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), weight, scales)
        y = y.view(*x.shape[:-1], weight.shape[0])
    elif scales is None:
        return linear_in(form, x, weight, bias).to(x.dtype)
    else:
        y = linear_in(form, x, weight) * scales
    return (y if bias is None else y + bias).to(x.dtype)


@torch.library.custom_op("fastllama::linear_for_rows", mutates_args=())
def chosen_when_run(x: Tensor, weight: Tensor, bias: Tensor | None, scales: Tensor | None) -> Tensor:
    """linear_for_rows as an op, opaque to compiled code: it runs with the count known."""
    return linear_for_rows(x, weight, bias, scales)


@chosen_when_run.register_fake
def _(x, weight, bias, scales):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear_in(dtype: torch.dtype, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) computed in dtype. A weight of another dtype is converted a block of
    CONVERTED_ELEMENTS at a time, never whole: a Llama-3 8B head would be a 2 GB fp32 copy."""
    if weight.dtype == dtype:
        return F.linear(x.to(dtype), weight, bias)
    x, rows = x.to(dtype), max(1, CONVERTED_ELEMENTS // weight.shape[1])
    blocks = weight.split(rows)
    biases = [None] * len(blocks) if bias is None else bias.to(dtype).split(rows)
    return torch.cat([F.linear(x, w.to(dtype), b) for w, b in zip(blocks, biases)], dim=-1)


def known_count(n, limit: int) -> bool:
    """Whether the count n (an int, or one of a compiled forward's sizes) is known when compiling, and at
    most limit. A symbolic count (prefill compiled for any length and number of prompts) is not, even where
    the shapes bound it (a batch of prompts by the cache's rows), and is never asked: a guard on it would give
    each count a graph of its own (dynamo takes a symbolic count for an int)."""
    return statically_known_true(n <= limit) and any([statically_known_true(n == i) for i in range(limit + 1)])


def compiling_few_rows(x: Tensor) -> bool:
    """Whether x (..., k) is a few rows in compiled code, a count known there (known_count)."""
    return torch.compiler.is_compiling() and known_count(x.shape[:-1].numel(), FEW_ROWS)


# oneDNN's bf16 kernels, which read a weight packed in their own layout (mkldnn._reorder_linear_weight)
# near the memory's speed at a few rows, faster there than the loop of rows_product and than F.linear
PACKABLE = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()

if PACKABLE:
    # PyTorch's op for a packed product is lowered by inductor only for weights it packed itself
    # (frozen constants); wrapped as an op of ours, compiled code calls it as it is
    _ops = torch.library.Library("fastllama", "DEF")
    _ops.define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")

    def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    for key in ("CPU", "MkldnnCPU"):  # the packed weight is a tensor of oneDNN's own kind
        _ops.impl("packed_linear", _packed_linear, key)
    _ops.impl("packed_linear", lambda x, packed, bias: x.new_empty(*x.shape[:-1], packed.shape[0]), "Meta")


class FewRowLinear(nn.Linear):
    """nn.Linear whose compiled forward of a few rows is few_rows_product, and whose product of many
    rows runs in matmul_dtype (linear_for_rows; same weights, another forward). Once pack() has made a
    copy of the weight for a kernel, a bf16 product reads it: in tiles, one of at most TILE_ROWS rows; in
    oneDNN's layout, every one but a compiled one of at most LOOP_ROWS rows."""

    packed: Tensor | None = None  # the weight again: in cpu_linear.cpp's tiles or in oneDNN's layout (pack())
    packed_from: tuple | None = None  # the weight it was made from: (storage address, version)

    @property
    def tiled(self) -> bool:
        """Whether the copy is in tiles: (n / 16, k / 2, 32), where oneDNN's keeps the weight's (n, k)."""
        return self.packed is not None and self.packed.dim() == 3

    def forward(self, x: Tensor) -> Tensor:
        few = compiling_few_rows(x)
        if self.packed_is_current() and x.dtype == torch.bfloat16:
            # a symbolic row count (prefill's, or a batch of prompts' last positions, compiled for any count) is
            # not asked: a guard on it would give each count a graph of its own. bf16_linear asks when it runs.
            rows, flat = x.shape[:-1].numel(), x.reshape(-1, x.shape[-1])
            if self.tiled and statically_known_true(rows <= TILE_ROWS):
                y = torch.ops.fastllama.bf16_rows(flat, self.packed).view(*x.shape[:-1], -1)
                return (y if self.bias is None else y + self.bias).to(x.dtype)
            if self.tiled and not statically_known_true(rows > TILE_ROWS):
                y = torch.ops.fastllama.bf16_linear(flat, self.weight, self.packed, self.bias, TILE_ROWS)
                return y.view(*x.shape[:-1], -1)
            loop = few and statically_known_true(rows <= LOOP_ROWS)
            if not self.tiled and not loop:
                return torch.ops.fastllama.packed_linear(x, self.packed, self.bias)
        if few:
            y = few_rows_product(x, self.weight)
            return (y if self.bias is None else y + self.bias).to(x.dtype)
        return linear_for_rows(x, self.weight, self.bias)

    def packed_is_current(self) -> bool:
        """Whether there is a packed copy, made from the weight as it is now (one replaced or written in
        place since is not: its products go through the plain weight). Compiled code takes the copy as
        it finds it: the callers that compile products over it (speculative_generate, eval.py, serve.py)
        pack() before each use."""
        if self.packed is None or torch.compiler.is_compiling():
            return self.packed is not None
        return self.packed_from == (self.weight.data_ptr(), self.weight._version)


def tiles_layout(weight: Tensor) -> Tensor:
    """A copy of a bf16 weight (n, k) in cpu_linear.cpp's tiles, shaped (n / 16, k / 2, 32) as it checks them:
    outputs in tiles of 16, tiles in groups of 4 (the last may have fewer), each group one stream of bytes: for
    each input pair, for each of the group's tiles, its 16 outputs' two weights (output i's at 2i, 2i + 1).
    A group takes the bytes its 64 rows took."""
    n, k = weight.shape
    out = torch.empty_like(weight)
    for r in range(0, n, 64):
        rows = weight[r: r + 64]
        group = rows.view(-1, 16, k // 2, 2).permute(2, 0, 1, 3)  # (pairs, tiles, 16, 2)
        out[r: r + 64].copy_(group.reshape(rows.shape))
    return out.view(n // 16, k // 2, 32)


def pack(model: Transformer, many_rows: bool = False):
    """Give each bf16 linear of a CPU model (after apply()) a copy of its weight that a kernel reads faster
    than the plain one: a second copy of the weights in memory. For products of a few rows (a speculative
    verify step's, the server's steps and short prompts), cpu_linear.cpp's tiles where it is built; for products
    of many rows (`many_rows`: eval.py's scoring forwards), and where the tiles kernel is not built, oneDNN's
    layout, where oneDNN has bf16 kernels. A copy made from a weight that has changed since (replaced or written
    in place) is made anew: speculative_generate calls it before its first round."""
    tiles = not many_rows and bf16_kernel() is not None
    if not tiles and not PACKABLE:
        return
    linears = [m for m in model.modules() if type(m) is FewRowLinear and m.weight.dtype == torch.bfloat16
               and m.weight.device.type == "cpu"]
    for linear in linears:
        tiled = tiles and linear.out_features % 16 == 0 and linear.in_features % 2 == 0
        source = (linear.weight.data_ptr(), linear.weight._version)
        if (linear.packed_from, linear.tiled) != (source, tiled) and (tiled or PACKABLE):
            weight = linear.weight.detach()
            linear.packed = tiles_layout(weight) if tiled else torch.ops.mkldnn._reorder_linear_weight(weight, FEW_ROWS)
            linear.packed_from = source
            # static in compiled code, as a parameter is: prefill compiled for any length would take its sizes
            # as symbols, and guard that one equals a prompt's length where they happen to be equal
            torch._dynamo.mark_static(linear.packed)


def apply(model: Transformer):
    """On CPU, give the model's linears, attention products and experts' products the forms above
    (once: a second call changes nothing). Quantized linears choose their own CPU path in
    quantize.pack_for_device."""
    if next(model.parameters()).device.type != "cpu":
        return
    kernel = attention_kernel() if USE_ATTENTION_KERNEL else None  # built here, not while compiled code is traced
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FewRowLinear
        elif isinstance(module, Attention):
            module.product, module.path = attention_product, types.MethodType(attention_path, module)
            if kernel and module.head_dim % 16 == 0:  # the kernel's loads take 16 elements at a time
                module.decode_kernel, module.decode_rows = decode_attention, ATTENTION_ROWS
        elif isinstance(module, ExpertLinears):  # each row times its own expert's weights
            module.product = one_row_product
