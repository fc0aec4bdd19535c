"""Weight-only int8 products of a few rows on a GPU, in Triton.

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

With TRITON_INTERPRET=1 set before this module is imported, the kernel runs on CPU tensors (slowly):
the tests check every configuration there.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# the most rows the kernel takes: a verify step of up to 7 drafts, or a batch of 8 rows
ROWS = 8
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def configs(block_m: int) -> list[triton.Config]:
    """The tiles to try for block_m rows: BLOCK_N outputs by BLOCK_K inputs a program. With DOT off the
    sums are fp32 multiply-adds, their block_m x BLOCK_N x BLOCK_K partial sums kept in registers (about 64
    a thread) and summed over K once, at the end; with DOT on, tensor-core products (tf32) of the rows
    padded to 16. Those kept won on some shape (benchmarks/RESULTS.md, "A sixth GPU session": its raw
    record has every tile's time)."""
    fma = {1: [(16, 512), (8, 1024)], 2: [(16, 256), (8, 512)], 4: [(8, 256), (16, 128)], 8: [(8, 128)]}[block_m]
    return ([triton.Config({"BLOCK_N": n, "BLOCK_K": k, "DOT": False}, num_warps=4, num_stages=1) for n, k in fma]
            + [triton.Config({"BLOCK_N": 32, "BLOCK_K": k, "DOT": True}, num_warps=4, num_stages=s)
               for k, s in ((128, 4), (256, 3))])


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


@torch.library.custom_op("fastllama::int8_rows", mutates_args=())
def int8_rows(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x (m, k) times int8 weight (n, k) transposed, times scales (n,): (m, n) in x's dtype."""
    return launch(x.contiguous(), weight, scales)


@int8_rows.register_fake
def _(x, weight, scales):
    return x.new_empty(x.shape[0], weight.shape[0])
