"""Weight-only products of a few rows on a GPU, in Triton: int8 per channel and int4 per group.

A decode step multiplies one row (a verify step k + 1, a batch its rows) by every weight: the time
is reading the weight. These kernels read each int8 or int4 weight element once for all the rows
(up to ROWS), turn it into a float in registers and scale after the sum, so a step costs what its
bytes cost and a verify step of 6 rows about what a plain one does. The forms they replace did not:
inductor's multiply-and-sum computes a norm or SiLU·mul feeding the product inside the product's own
loop, and at 6 rows the dequantized matmul writes a bf16 copy of the weight for cuBLAS
(benchmarks/RESULTS.md, "A fifth GPU session"). As custom ops they are opaque to inductor, so their
inputs arrive computed once, and CUDA graphs record them like any kernel.

The sums are fp32 fused multiply-adds, not tensor cores: at 8 rows or fewer the work per byte is
small, and an integer becomes a float exactly by its bits (exact_float) rather than through the
conversion instruction, which runs at a quarter of the FMA rate on recent GPUs.

    y = kernels.int8_rows(x, weight, scales)                 # x (m, k), m <= ROWS; weight (n, k) int8
    y = kernels.int4_rows(x, packed, scales, mins, groupsize)  # packed: int4_layout(...) of the file's

With TRITON_INTERPRET=1 set before this module is imported, the same kernels run on CPU tensors
(slowly): the tests check every configuration there. On a GPU each shape's configuration is chosen
by timing them all once (triton.autotune), at the first call.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# the most rows the kernels take: a verify step of up to 7 drafts, or a batch of 8 rows
ROWS = 8
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def configs(block_m: int) -> list[triton.Config]:
    """The tiles to try for block_m rows: BLOCK_N outputs by BLOCK_K inputs a program. With DOT off the
    sums are fp32 multiply-adds, their block_m x BLOCK_N x BLOCK_K partial sums kept in registers (about 64
    a thread) and summed over K once, at the end; with DOT on, tensor-core products (tf32) of the rows
    padded to 16 (the work is wasted on padding; the time is the bytes)."""
    fma = {1: [(16, 512, 4), (8, 1024, 4), (32, 256, 4), (32, 512, 8)],
           2: [(16, 256, 4), (8, 512, 4), (16, 512, 8)],
           4: [(16, 128, 4), (8, 256, 4), (8, 512, 8)],
           8: [(8, 128, 4), (16, 64, 4), (8, 256, 8)]}[block_m]
    dot = [(16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3)]
    return ([triton.Config({"BLOCK_N": n, "BLOCK_K": k, "DOT": False}, num_warps=w, num_stages=1) for n, k, w in fma]
            + [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "DOT": True}, num_warps=w, num_stages=s)
               for n, k, w, s in dot])


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


@triton.jit
def int4_rows_kernel(x, w, scales, mins, y, M, N, K, stride_x, stride_w, stride_s, stride_y, GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """y[m, n] = sum_k x[m, k] * (q[n, k] * scales[n, k // GROUP] + mins[n, k // GROUP]). w in int4_layout:
    in each group, byte h holds k = h in its low nibble and k = GROUP / 2 + h in its high one, so that
    the block's bytes c = 0 .. BLOCK_K / 2 - 1 hold k = first(c) and first(c) + GROUP / 2."""
    H: tl.constexpr = GROUP // 2
    BM: tl.constexpr = BLOCK_M + DOT * (16 - BLOCK_M)
    rows = tl.arange(0, BM)[:, None]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    G: tl.constexpr = BLOCK_K // GROUP
    gs = tl.arange(0, G)
    hs = tl.arange(0, H)
    if DOT:
        acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // GROUP + gs  # the groups of this block
        g_ok = (cols[:, None] < N) & (g < K // GROUP)[None, :]  # (n, g)
        s = tl.load(scales + cols[:, None] * stride_s + g[None, :], mask=g_ok, other=0.0).to(tl.float32)[:, :, None]
        m = tl.load(mins + cols[:, None] * stride_s + g[None, :], mask=g_ok, other=0.0).to(tl.float32)[:, :, None]
        p = tl.load(w + cols[:, None, None] * stride_w + g[None, :, None] * H + hs[None, None, :],
                    mask=g_ok[:, :, None], other=0).to(tl.int32)  # (n, g, h)
        # (n, g, h) -> (n, c): byte c = g * H + h of the block
        w_lo = tl.reshape(exact_float(p & 15) * s + m, (BLOCK_N, BLOCK_K // 2))
        w_hi = tl.reshape(exact_float(p >> 4) * s + m, (BLOCK_N, BLOCK_K // 2))
        c = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        first = (c // H) * GROUP + c % H  # the k of byte c's low nibble
        x_ok = (rows < M) & (c < K // 2)[None, :]
        x_lo = tl.load(x + rows * stride_x + first[None, :], mask=x_ok, other=0.0)
        x_hi = tl.load(x + rows * stride_x + first[None, :] + H, mask=x_ok, other=0.0)
        if DOT:
            acc += tl.dot(x_lo.to(tl.float32), tl.trans(w_lo))
            acc += tl.dot(x_hi.to(tl.float32), tl.trans(w_hi))
        else:
            acc += w_lo[None, :, :] * x_lo.to(tl.float32)[:, None, :]
            acc += w_hi[None, :, :] * x_hi.to(tl.float32)[:, None, :]
    if not DOT:
        acc = tl.sum(acc, axis=2)
    tl.store(y + rows * stride_y + cols[None, :], acc.to(y.dtype.element_ty), mask=(rows < M) & (cols[None, :] < N))


def block_rows(m: int) -> int:
    """The kernels' row block for m rows: 1, 2, 4 or 8."""
    assert 1 <= m <= ROWS, f"{m} rows: the kernels take 1 to {ROWS}"
    return triton.next_power_of_2(m)


def fits(configs: list[triton.Config], named_args: dict, **constants) -> list[triton.Config]:
    """The configurations whose K block holds whole groups (all of them for int8), and with fp32 rows
    only those without tensor cores, which would round them to tf32."""
    group, x = constants.get("GROUP", 1), named_args.get("x")
    return [c for c in configs if c.kwargs["BLOCK_K"] % group == 0
            and not (c.kwargs["DOT"] and x is not None and x.dtype == torch.float32)]


# on a GPU, one autotuned kernel a row block (their configurations differ), tuned for each weight shape
TUNED = {} if INTERPRETED else {
    (kernel, bm): triton.autotune(configs(bm), key=["N", "K", "GROUP"] if kernel is int4_rows_kernel else ["N", "K"],
                                  prune_configs_by={"early_config_prune": fits}, cache_results=True)(kernel)
    for kernel in (int8_rows_kernel, int4_rows_kernel) for bm in (1, 2, 4, 8)}


def launch(kernel, x: Tensor, n: int, tensors: tuple, sizes: tuple, config: triton.Config | None = None,
           **constants) -> Tensor:
    """y (m, n) = kernel(x, *tensors, y, m, n, *sizes) for x's m rows: autotuned on a GPU, or with `config`
    (by default the row block's first that fits, as the interpreter cannot time)."""
    m, bm = x.shape[0], block_rows(x.shape[0])
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if config is None and not INTERPRETED:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        TUNED[kernel, bm][grid](x, *tensors, y, m, n, *sizes, BLOCK_M=bm, **constants)
        return y
    config = config or fits(configs(bm), {}, **constants)[0]
    kernel[(triton.cdiv(n, config.kwargs["BLOCK_N"]),)](
        x, *tensors, y, m, n, *sizes, BLOCK_M=bm, **constants, **config.kwargs,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return y


@torch.library.custom_op("fastllama::int8_rows", mutates_args=())
def int8_rows(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x (m, k) times int8 weight (n, k) transposed, times scales (n,): (m, n) in x's dtype."""
    x = x.contiguous()
    n, k = weight.shape
    return launch(int8_rows_kernel, x, n, (weight, scales), (k, x.stride(0), weight.stride(0), n))


@int8_rows.register_fake
def _(x, weight, scales):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("fastllama::int4_rows", mutates_args=())
def int4_rows(x: Tensor, weight: Tensor, scales: Tensor, mins: Tensor, groupsize: int) -> Tensor:
    """x (m, k) times the int4 weight (n, k / 2 bytes in int4_layout, scales and mins (n, k / groupsize))
    transposed: (m, n) in x's dtype."""
    x = x.contiguous()
    n, k = weight.shape[0], 2 * weight.shape[1]
    return launch(int4_rows_kernel, x, n, (weight, scales, mins),
                  (k, x.stride(0), weight.stride(0), scales.stride(0), n), GROUP=groupsize)


@int4_rows.register_fake
def _(x, weight, scales, mins, groupsize):
    return x.new_empty(x.shape[0], weight.shape[0])


def int4_layout(packed: Tensor, groupsize: int) -> Tensor:
    """The file's (n, k / 2) bytes, two levels a byte with k's even one in the high nibble, in the kernel's:
    byte h of each group holds the group's k = h (low nibble) and k = groupsize / 2 + h (high), so that a
    nibble's inputs are contiguous."""
    n = packed.shape[0]
    q = torch.stack([packed >> 4, packed & 15], dim=-1).view(n, -1, 2, groupsize // 2)  # (n, groups, half, h)
    return (q[:, :, 1] << 4 | q[:, :, 0]).view(n, -1).to(torch.uint8)


def int4_dequantize(weight: Tensor, scales: Tensor, mins: Tensor, groupsize: int) -> Tensor:
    """The weight (n, k) in scales' dtype from int4_layout's bytes: for products of more than ROWS rows."""
    n = weight.shape[0]
    weight = weight.view(n, -1, groupsize // 2)  # (n, groups, bytes)
    q = torch.stack([weight & 15, weight >> 4], dim=-2).view(n, -1, groupsize).to(scales.dtype)  # (n, groups, k)
    return (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).view(n, -1)
