"""A GPU's kernels, in Triton: weight-only int8 products of a few rows, and decode attention (below).

A decode step multiplies one row (a verify step k + 1 rows, a batch its rows) by every weight: the time
is reading the weight. This kernel reads each int8 weight element once for all the rows (up to ROWS),
turns it into a float in registers and scales after the sum, so that a step costs what its bytes cost
and a verify step of 6 rows not much more than a plain one. The form it replaces did neither: inductor's
multiply-and-sum computes a norm or SiLU·mul feeding the product inside the product's own loop, and at
6 rows the dequantized matmul writes a bf16 copy of the weight for cuBLAS (benchmarks/RESULTS.md, "A
fifth GPU session"). As a custom op it is opaque to inductor, so its input arrives computed once, and
CUDA graphs record it like any kernel.

Two forms, chosen per shape by timing them once (triton.autotune, at the first call): for one row,
fp32 multiply-adds, the integer made a float exactly by its bits (exact_float) rather than through the
conversion instruction, which runs at a quarter of the FMA rate; for more rows, tensor-core products
(tf32) of the rows padded to 16, the padding's work wasted while the bytes set the time
(benchmarks/RESULTS.md, "A sixth GPU session").

    y = kernels.int8_rows(x, weight, scales)   # x (m, k), m <= ROWS; weight (n, k) int8; scales (n,)
    kernels.apply(model)                       # a CUDA model's attention through decode_attention

With TRITON_INTERPRET=1 set before this module is imported, the kernels run on CPU tensors (slowly):
the tests check them there.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .cpu_decode import USE_ATTENTION_KERNEL
from .model import Attention, Transformer

# the most rows the kernel takes: a verify step of up to 7 drafts, or a batch of 8 rows
ROWS = 8
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def configs(block_m: int) -> list[triton.Config]:
    """The tiles to try for block_m rows: BLOCK_N outputs by BLOCK_K inputs a program. With DOT off the
    sums are fp32 multiply-adds, their block_m x BLOCK_N x BLOCK_K partial sums kept in registers (about 64
    a thread) and summed over K once, at the end; with DOT on, tensor-core products (tf32) of the rows
    padded to 16. Those kept won on some shape (benchmarks/RESULTS.md, "A sixth GPU session": its raw
    record has every tile's time). The tensor-core tiles 16 outputs wide are not yet timed: at 32, a weight
    of 4,096 outputs gives 128 programs, fewer than an H100's or H200's 132 multiprocessors, and int8's
    verify step is still short of its goal ("A ninth GPU session")."""
    fma = {1: [(16, 512), (8, 1024)], 2: [(16, 256), (8, 512)], 4: [(8, 256), (16, 128)], 8: [(8, 128)]}[block_m]
    return ([triton.Config({"BLOCK_N": n, "BLOCK_K": k, "DOT": False}, num_warps=4, num_stages=1) for n, k in fma]
            + [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "DOT": True}, num_warps=4, num_stages=s)
               for n, k, s in ((32, 128, 4), (32, 256, 3), (16, 256, 3), (16, 512, 3))])


@triton.jit
def exact_float(q):
    """Integers 0 <= q < 2**23 (int32) as fp32, exactly: q's bits in the mantissa of 2**23, less 2**23."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def int8_rows_kernel(x, w, scales, y, M, N, K, stride_x, stride_w, stride_y,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """y[m, n] = scales[n] * sum_k x[m, k] * w[n, k], for the BLOCK_N outputs of this program."""
    BM: tl.constexpr = BLOCK_M + DOT * (16 - BLOCK_M)  # tensor cores take 16 rows at least
    rows = tl.arange(0, BM)[:, None]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    if DOT:
        acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        q = tl.load(w + cols[:, None] * stride_w + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K), other=0)
        xs = tl.load(x + rows * stride_x + k[None, :], mask=(rows < M) & (k[None, :] < K), other=0.0)
        wf = exact_float(q.to(tl.int32) + 128) - 128.0  # -128..127 shifted to 0..255 for the conversion
        if DOT:
            acc += tl.dot(xs.to(tl.float32), tl.trans(wf))
        else:
            acc += wf[None, :, :] * xs.to(tl.float32)[:, None, :]
    if not DOT:
        acc = tl.sum(acc, axis=2)
    out = acc * tl.load(scales + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rows * stride_y + cols[None, :], out.to(y.dtype.element_ty), mask=(rows < M) & (cols[None, :] < N))


def block_rows(m: int) -> int:
    """The kernel's row block for m rows: 1, 2, 4 or 8."""
    assert 1 <= m <= ROWS, f"{m} rows: the kernel takes 1 to {ROWS}"
    return triton.next_power_of_2(m)


def fits(configs: list[triton.Config], named_args: dict, **_) -> list[triton.Config]:
    """With fp32 rows, the configurations without tensor cores, which would round them to tf32."""
    x = named_args.get("x")
    return [c for c in configs if not (c.kwargs["DOT"] and x is not None and x.dtype == torch.float32)]


# on a GPU, one autotuned kernel a row block (their configurations differ), tuned for each weight shape
TUNED = {} if INTERPRETED else {
    bm: triton.autotune(configs(bm), key=["N", "K"], prune_configs_by={"early_config_prune": fits},
                        cache_results=True)(int8_rows_kernel)
    for bm in (1, 2, 4, 8)}


def launch(x: Tensor, weight: Tensor, scales: Tensor, config: triton.Config | None = None) -> Tensor:
    """y (m, n) = int8_rows_kernel for x's m rows: autotuned on a GPU, or with `config` (by default the row
    block's first that fits, as the interpreter cannot time)."""
    (m, k), n = x.shape, weight.shape[0]
    bm = block_rows(m)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    sizes = (m, n, k, x.stride(0), weight.stride(0), y.stride(0))
    if config is None and not INTERPRETED:
        TUNED[bm][lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x, weight, scales, y, *sizes, BLOCK_M=bm)
        return y
    config = config or fits(configs(bm), {"x": x})[0]
    int8_rows_kernel[(triton.cdiv(n, config.kwargs["BLOCK_N"]),)](
        x, weight, scales, y, *sizes, BLOCK_M=bm, **config.kwargs, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return y


@torch.library.custom_op("fastllama::gpu_int8_rows", mutates_args=())
def int8_rows(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x (m, k) times int8 weight (n, k) transposed, times scales (n,): (m, n) in x's dtype."""
    return launch(x.contiguous(), weight, scales)


@int8_rows.register_fake
def _(x, weight, scales):
    return x.new_empty(x.shape[0], weight.shape[0])


# Decode attention: the query rows of a decode or verify step (a key/value head's query heads times the
# step's positions, up to ATTENTION_ROWS) against the cache as it is stored. Written out as two products,
# compiled code reads a bf16 cache at a fraction of the memory's bandwidth at depth, and converts an int8 or
# fp8 cache to a bf16 copy first, which makes the smaller caches slower (benchmarks/RESULTS.md, "A fifth GPU session").
# Here each program reads one slice of one head's keys once for all its rows (split-K decoding: at depth,
# enough programs to keep every multiprocessor reading), scales int8/fp8 levels after the product (a
# score times its key's scale, a probability times its value's), and keeps an online softmax; a second
# kernel joins the slices. At depth the 8B's step reads a bf16 cache several times as fast this way; its
# tiles won or tied there (benchmarks/RESULTS.md, "An eighth GPU session", "A ninth GPU session").
ATTENTION_ROWS = 64
ATTENTION_PROGRAMS = 1024  # programs to aim for at depth: several a multiprocessor, bytes in flight


@triton.jit
def attention_slice_kernel(q, k, v, k_scales, v_scales, mask, part, stats, R, T, S, chunk, n_kv, scale,
                           stride_qb, stride_qh, stride_kb, stride_kh, stride_sb, stride_sh, stride_mb, stride_mt,
                           HD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           SCALED: tl.constexpr, FP32: tl.constexpr):
    """For the keys [chunk * slice, chunk * (slice + 1)) of one row's key/value head: each query row's
    running max m, its sum of exp(score - m) l, and sum of exp(score - m) * value (part, unnormalized).
    Products in q's dtype, or in fp32 with FP32 (an fp32 model; the interpreter, whose bf16 products are
    wrong)."""
    bh, piece = tl.program_id(0), tl.program_id(1)
    b, h = bh // n_kv, bh % n_kv
    rows, d = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
    live, dims = rows < R, d < HD
    qs = tl.load(q + b * stride_qb + h * stride_qh + rows[:, None] * HD + d[None, :],
                 mask=live[:, None] & dims[None, :], other=0.0)
    if FP32:
        qs = qs.to(tl.float32)
    keys = k + b * stride_kb + h * stride_kh
    values = v + b * stride_kb + h * stride_kh
    sees = mask + b * stride_mb + (rows % T)[:, None] * stride_mt  # row g * T + t is position t's
    m = tl.full((BLOCK_R,), -1e30, tl.float32)  # finite, so that a slice no row sees gives exp(-inf) = 0
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    start = piece * chunk
    end = tl.minimum(start + chunk, S)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inside = n < end
        seen = tl.load(sees + n[None, :], mask=live[:, None] & inside[None, :], other=0) != 0
        # no `other` for masked loads (fp8 takes none): what they give is masked below, converted first
        kb = tl.load(keys + n[:, None] * HD + d[None, :], mask=inside[:, None] & dims[None, :]).to(qs.dtype)
        if BLOCK_D != HD:
            kb = tl.where(dims[None, :], kb, 0.0)
        s = tl.dot(qs, tl.trans(kb), input_precision="ieee" if FP32 else None)
        if SCALED:
            s *= tl.load(k_scales + b * stride_sb + h * stride_sh + n, mask=inside, other=0).to(tl.float32)[None, :]
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        # a slot no row sees may hold anything (a stale or never-written value): 0 * NaN would be NaN
        vb = tl.load(values + n[:, None] * HD + d[None, :], mask=inside[:, None] & dims[None, :]).to(qs.dtype)
        vb = tl.where((tl.max(seen.to(tl.int32), 0) > 0)[:, None] & dims[None, :], vb, 0.0)
        if SCALED:
            p *= tl.load(v_scales + b * stride_sb + h * stride_sh + n, mask=inside, other=0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(qs.dtype), vb, input_precision="ieee" if FP32 else None)
        m = m_new
    out = (bh * tl.num_programs(1) + piece) * BLOCK_R + rows  # the padding rows' sums are not written
    tl.store(part + out[:, None] * BLOCK_D + d[None, :], acc, mask=live[:, None])
    tl.store(stats + out * 2, m, mask=live)
    tl.store(stats + out * 2 + 1, l, mask=live)


@triton.jit
def attention_join_kernel(part, stats, y, R, SLICES, HD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_S: tl.constexpr):
    """y for one query row of one key/value head: its slices' sums, each rescaled to the largest max."""
    bh, r = tl.program_id(0), tl.program_id(1)
    pieces, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    at = (bh * SLICES + pieces) * BLOCK_R + r
    m = tl.load(stats + at * 2, mask=pieces < SLICES, other=-1e30)
    l = tl.load(stats + at * 2 + 1, mask=pieces < SLICES, other=0.0)
    weight = tl.exp(m - tl.max(m, 0))
    acc = tl.load(part + at[:, None] * BLOCK_D + d[None, :], mask=(pieces < SLICES)[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(y + (bh * R + r) * HD + d, out.to(y.dtype.element_ty), mask=d < HD)


def attention_slices(programs: int, S: int, block_n: int) -> int:
    """How many slices of the S keys each head's programs take: enough programs in all to fill the GPU at
    depth, and each slice at least two blocks of keys (fewer would spend more on joining than reading)."""
    return max(1, min(triton.cdiv(ATTENTION_PROGRAMS, programs), triton.cdiv(S, 2 * block_n)))


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_scales: Tensor | None, v_scales: Tensor | None,
           mask: Tensor, scale: float, block_n: int = 64, slices: int | None = None,
           num_warps: int = 4, num_stages: int = 2) -> Tensor:
    """decode_attention with its tiles given: benchmarks try others."""
    B, n_kv, R, hd = q.shape
    S = mask.shape[-1]
    # the kernel steps through positions' vectors packed one after another, and a scale a position
    assert R <= ATTENTION_ROWS and k_cache.stride()[2:] == (hd, 1) and q.is_contiguous()
    assert k_scales is None or k_scales.stride(2) == 1
    block_r = max(16, triton.next_power_of_2(R))  # tensor cores take 16 rows at least
    block_d = triton.next_power_of_2(hd)
    slices = slices or attention_slices(B * n_kv, S, block_n)
    chunk = triton.cdiv(triton.cdiv(S, slices), block_n) * block_n
    slices = triton.cdiv(S, chunk)
    part = torch.empty(B * n_kv * slices * block_r, block_d, dtype=torch.float32, device=q.device)
    stats = torch.empty(B * n_kv * slices * block_r, 2, dtype=torch.float32, device=q.device)
    scaled = k_scales is not None
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    attention_slice_kernel[(B * n_kv, slices)](
        q, k_cache, v_cache, k_scales if scaled else k_cache, v_scales if scaled else v_cache, mask, part, stats,
        R, mask.shape[2], S, chunk, n_kv, scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_scales.stride(0) if scaled else 0, k_scales.stride(1) if scaled else 0, mask.stride(0), mask.stride(2),
        HD=hd, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d, SCALED=scaled,
        FP32=q.dtype == torch.float32 or INTERPRETED, num_warps=num_warps, num_stages=num_stages)
    y = torch.empty_like(q)
    attention_join_kernel[(B * n_kv, R)](part, stats, y, R, slices, HD=hd, BLOCK_R=block_r, BLOCK_D=block_d,
                                         BLOCK_S=triton.next_power_of_2(slices))
    return y


@torch.library.custom_op("fastllama::gpu_decode_attention", mutates_args=())
def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_scales: Tensor | None, v_scales: Tensor | None,
                     mask: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale, where mask) v over the cache's first mask.shape[-1] slots, as stored. q (B, n_kv,
    R, hd): row g * T + t is query head g of the key/value head at position t; caches (>= B, n_kv, length,
    hd), a scaled format's scales (>= B, n_kv, length, 1); mask (B, 1, T, S) bool. Returns (B, n_kv, R, hd)."""
    return attend(q, k_cache, v_cache, k_scales, v_scales, mask, scale)


@decode_attention.register_fake
def _(q, k_cache, v_cache, k_scales, v_scales, mask, scale):
    return torch.empty_like(q)


def apply(model: Transformer):
    """Give each attention of a model on a GPU the decode attention kernel (FASTLLAMA_ATTENTION_KERNEL=0:
    not, for comparison); a model elsewhere is left as it is."""
    if next(model.parameters()).device.type != "cuda" or not USE_ATTENTION_KERNEL:
        return
    for module in model.modules():
        if isinstance(module, Attention):
            module.decode_kernel, module.decode_rows = decode_attention, ATTENTION_ROWS
