"""Weight-only quantization, written once into a checkpoint and loaded straight into quantized modules.

    python quantize.py --checkpoint_path checkpoints/X --mode int8
    python quantize.py --checkpoint_path checkpoints/X --mode int4 --groupsize 32
    python quantize.py --checkpoint_path checkpoints/X --mode int4-gptq --groupsize 64
    python quantize.py --mode int4-gguf       # the bundled model's own Q4_1 weights, copied losslessly

Modes: int8 (per output channel, symmetric), int4 (per group of `groupsize` input columns,
asymmetric, round to nearest) and int4-gptq (the same format, with GPTQ's error-compensating
rounding, calibrated layer by layer). The output head is int8 in every mode (HEAD). Embeddings stay
bf16 (a step reads one row of them).

Layouts in the file are device-neutral: int8 `weight` (n, k) with `scales` (n,); int4 `weight` uint8
(n, k/2), two 4-bit values a byte, high nibble first, with `scales` and `mins` (n, k/groupsize),
where w = q * scale + min (IQ4_LEVELS[q] * scale + min for the linears a GGUF import names in its
`iq4_layers`). `pack_for_device` chooses each module's kernel for its device once, at load, and turns
int4 into that kernel's layout. The scheme is recorded in the file's safetensors metadata, never parsed
from its name.

Each mode is one scheme object (Int8, Int4, Int4GPTQ, Int4GGUF) owning its tensors in the file, the
modules it swaps in and their kernels, what tensor parallelism needs of it and its metadata: a new
scheme is a class and an entry in SCHEMES.
"""

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

from .checkpoint import (Group, Spec, copy_companions, load_config, read_metadata, resolve_checkpoint, resolve_output,
                        single, write_safetensors)
from . import cpu_decode
from .cpu_decode import compiling_few_rows, few_rows_product, linear_for_rows
from .errors import UserError, run_cli
from .model import KVCache, ModelArgs, Rows, Transformer, TransformerBlock, attention_mask, rope_tables
from .moe import ExpertLinears
from .tokenizer import load_tokenizer

try:  # Triton's int8 products of a few rows on a GPU; PyTorch's CUDA wheels bring Triton, its CPU wheels do not
    from . import kernels
except ImportError:
    kernels = None

GROUPSIZES = (32, 64, 128, 256)


# ---------------------------------------------------------------------------------------------
# Quantizing a weight


# Each works on a weight (n, k) or on a stack of them, (..., n, k): the experts of a MoE layer.


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (n, k) -> int8 q (n, k) and bf16 scales (n,) with w ~ q * scale."""
    w = w.float()
    scales = (w.abs().amax(dim=-1).clamp(min=1e-8) / 127).bfloat16()  # rounded first: q fits the stored scale
    return torch.round(w / scales.float()[..., None]).clamp(-127, 127).to(torch.int8), scales


def int4_group_params(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor]:
    """Per-group scale and min of w (n, k): 16 levels from each group's min to its max."""
    groups = w.float().reshape(*w.shape[:-1], -1, groupsize)
    lo, hi = groups.amin(-1), groups.amax(-1)
    return ((hi - lo) / 15).clamp(min=1e-8), lo  # (n, k/groupsize) each


def quantize_int4(w: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """w (n, k) -> levels 0..15 (n, k) as uint8, for per-group scales and mins (n, k/groupsize)."""
    groupsize = w.shape[-1] // scales.shape[-1]
    scales, mins = scales.repeat_interleave(groupsize, -1), mins.repeat_interleave(groupsize, -1)
    return torch.round((w.float() - mins) / scales).clamp(0, 15).to(torch.uint8)


def pack_int4(q: Tensor) -> Tensor:
    """(n, k) levels 0..15 -> (n, k/2) uint8, high nibble first (CUDA's int4pack input layout)."""
    return (q[..., ::2] << 4 | q[..., 1::2]).to(torch.uint8)


def unpack_int4(packed: Tensor) -> Tensor:
    """(n, k/2) uint8 -> (n, k) levels 0..15 as uint8."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(*packed.shape[:-1], -1)


def whole_groups(k: int, groupsize: int) -> int:
    """k input columns padded with zeros to whole groups: what an int4 weight stores (x is padded to match)."""
    return -(-k // groupsize) * groupsize


def dequantize_int4(packed: Tensor, scales: Tensor, mins: Tensor, dtype=torch.float32,
                    levels: Tensor | None = None) -> Tensor:
    """(n, k/2) packed levels, (n, k/groupsize) scales and mins -> w (n, k) in dtype; with `levels`, the 16
    numbers the 4 bits stand for (IQ4_LEVELS), w = levels[q] * scale + min."""
    q = unpack_int4(packed)
    q = (q if levels is None else levels.to(q.device)[q.long()]).to(dtype).view(*scales.shape, -1)  # (n, groups, gs)
    return (q * scales.to(dtype).unsqueeze(-1) + mins.to(dtype).unsqueeze(-1)).flatten(-2)


ROUNDING_ROWS = 256  # rtn_int4's rows at a time: whole matrices' temporaries made it several times slower


def rtn_int4(w: Tensor, groupsize: int, fits: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """w (n, k) -> packed levels (n, k/2), bf16 scales and mins (n, k/groupsize), rounded to nearest. With
    fits, each group's scale and min are then fitted to its levels by least squares and the levels rounded
    again, that many times, a group keeping the fit only where it lowers the group's squared error: Int4GGUF
    does so for the weights a GGUF file holds on another grid (Q3_K's, Q2_K's; IQ4's for a kernel without
    its levels), whose values lie between min-to-max levels, and it takes them about a fifth nearer to the
    file (benchmarks/RESULTS.md, "IQ4 and Q3_K weights fitted"). Rows go ROUNDING_ROWS at a time, whose
    temporaries stay in the caches."""
    if w.dim() > 2 or w.shape[0] > ROUNDING_ROWS:
        parts = [rtn_int4(rows, groupsize, fits) for rows in w.reshape(-1, w.shape[-1]).split(ROUNDING_ROWS)]
        return tuple(torch.cat(part).reshape(*w.shape[:-1], -1) for part in zip(*parts))
    groups = w.float().reshape(*w.shape[:-1], -1, groupsize)
    # the parameters rounded to their stored dtype at once, so the levels fit what dequantization sees
    scales, mins = (p[..., None].bfloat16().float() for p in int4_group_params(w, groupsize))

    def levels_and_error(scales: Tensor, mins: Tensor) -> tuple[Tensor, Tensor]:
        levels = ((groups - mins) / scales).round().clamp(0, 15)
        return levels, (levels * scales + mins - groups).square().sum(-1, keepdim=True)

    levels, error = levels_and_error(scales, mins)
    for _ in range(fits):
        centred = levels - levels.mean(-1, keepdim=True)
        spread = centred.square().sum(-1, keepdim=True)  # 0 where a group is one level: it keeps what it has
        fitted = torch.where(spread > 0, (centred * groups).sum(-1, keepdim=True) / spread.clamp(min=1e-12), scales)
        fitted = fitted.clamp(min=1e-8).bfloat16().float()
        moved = (groups.mean(-1, keepdim=True) - fitted * levels.mean(-1, keepdim=True)).bfloat16().float()
        fitted_levels, fitted_error = levels_and_error(fitted, moved)
        better = fitted_error < error
        scales, mins = torch.where(better, fitted, scales), torch.where(better, moved, mins)
        levels, error = torch.where(better, fitted_levels, levels), torch.where(better, fitted_error, error)
    return pack_int4(levels.reshape(w.shape).to(torch.uint8)), scales[..., 0].bfloat16(), mins[..., 0].bfloat16()


# ---------------------------------------------------------------------------------------------
# Quantized modules: the model does not know it is quantized


class Int8Linear(nn.Module):
    """Per-channel int8. Its kernel is chosen for its device once, by `pack` (int8_kernel): on CPU with
    AVX-512 BF16 or AVX2, cpu_linear.cpp's for any number of rows, over the weight laid out for it in place
    (int8_rows_layout), x rounded to int8 a block of 32 inputs at a time ("cpu-tiles"); on other CPUs
    PyTorch's int8 kernel for a few rows, or with "cpu-fused" a multiply-and-sum that compiled code fuses
    (cpu_decode.py), and for many rows (prefill), where those are slower, a matmul of the weight converted a
    block at a time (to bf16, or to fp32 where bf16 is slow: cpu_decode.linear_for_rows); on a GPU with Triton,
    kernels.py's for a few rows; elsewhere, and for many rows, the dequantized matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)
        self.kernel = None  # "cpu-tiles", "cpu", "cpu-fused", "triton" or "dequantize" once packed

    def pack(self, kernel: str):
        if kernel == "cpu-tiles":
            self.weight = int8_rows_layout(self.weight)
        self.kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        assert self.kernel is not None, "call quantize.pack_for_device(model) after loading"
        rows = x.shape[:-1].numel()
        if self.kernel == "cpu-tiles":
            y = torch.ops.fastllama.int8_rows(x.reshape(-1, self.in_features), self.weight)
            y = y.view(*x.shape[:-1], self.out_features) * self.scales
        elif self.kernel == "cpu-fused" and compiling_few_rows(x):
            y = few_rows_product(x, self.weight) * self.scales  # int8 converted in registers
        elif self.kernel in ("cpu", "cpu-fused"):  # PyTorch's int8 kernel, or for many rows a matmul
            return linear_for_rows(x, self.weight, self.bias, self.scales)
        elif self.kernel == "triton" and rows <= kernels.ROWS:
            y = kernels.int8_rows(x.reshape(rows, self.in_features), self.weight, self.scales)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:  # "dequantize", or "triton" for many rows
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales
        return (y if self.bias is None else y + self.bias).to(x.dtype)


# IQ4_NL's (and IQ4_XS's) 16 levels, llama.cpp's: a GGUF file's 4 bits stand for these, times a scale
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class Int4Linear(nn.Module):
    """Groupwise int4. Holds the neutral layout until `pack(kernel)`, then the kernel's layout. With iq4, the
    4 bits stand for IQ4_LEVELS rather than 0 .. 15 (a GGUF file's IQ4 weights, copied): cpu_linear.cpp's
    kernel looks them up; for the others, the weight is rounded to plain int4 as it is packed."""
    repacked = ("scales", "mins")  # replaced by new tensors in packing; CPU kernels rewrite the weight in place

    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False,
                 dtype=torch.bfloat16, device=None, iq4: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.padded_in = whole_groups(in_features, groupsize)
        groups = self.padded_in // groupsize
        self.register_buffer("weight", torch.empty(out_features, self.padded_in // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("mins", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)
        self.iq4 = iq4  # not in the file: the scheme's metadata says
        self.register_buffer("levels", None, persistent=False)  # IQ4_LEVELS, for cpu-tiles once packed
        self.kernel = None  # "cuda", "cpu-tiles", "cpu" or "dequantize" once packed

    def pack(self, kernel: str):
        """Turn the neutral layout into `kernel`'s: tinygemm's packed weight and scales_and_zeros, or
        for "dequantize" the bf16 weight."""
        levels = torch.tensor(IQ4_LEVELS, dtype=torch.int8, device=self.weight.device) if self.iq4 else None
        if kernel == "dequantize":
            self.register_buffer("weight_bf16", dequantize_int4(self.weight, self.scales, self.mins,
                                                                levels=levels).bfloat16())
            del self.weight
        else:
            if levels is not None and kernel != "cpu-tiles":  # a kernel of levels 0 .. 15 only
                w = dequantize_int4(self.weight, self.scales, self.mins, levels=levels)
                self.weight, self.scales, self.mins = rtn_int4(w, self.groupsize, Int4GGUF.fits)
            self.levels = levels if kernel == "cpu-tiles" else None
            self.weight, scales_and_zeros = int4_kernel_layout(kernel, self.weight, self.scales, self.mins)
            self.register_buffer("scales_and_zeros", scales_and_zeros)
        del self.scales, self.mins
        self.kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        assert self.kernel is not None, "call quantize.pack_for_device(model) after loading"
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if self.kernel == "dequantize":
            y = F.linear(x.bfloat16(), self.weight_bf16)
        else:
            y = int4_matmul(self.kernel, x, self.weight, self.groupsize, self.scales_and_zeros, self.levels)
        y = y if self.bias is None else y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def int4_kernel_layout(kernel: str, weight: Tensor, scales: Tensor, mins: Tensor) -> tuple[Tensor, Tensor]:
    """The neutral layout, (n, k/2) packed levels and (n, k/groupsize) scales and mins, in `kernel`'s:
    tinygemm's packed weight and scales_and_zeros (k/groupsize, n, 2), or cpu_linear.cpp's (below)."""
    if kernel == "cpu-tiles":
        return int4_rows_layout(weight, scales, mins)
    # tinygemm dequantizes (q - 8) * scale + zero, so zero = min + 8 * scale
    zeros = mins.float() + 8 * scales.float()
    scales_and_zeros = torch.stack([scales.float(), zeros], -1).transpose(0, 1).contiguous().bfloat16()
    if kernel == "cuda":
        inner_k_tiles = next(t for t in (8, 4, 2) if 2 * weight.shape[1] % (t * 16) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(weight, inner_k_tiles), scales_and_zeros
    # the CPU kernel takes (n, k) int32 levels and packs them to (n, k/2) uint8, in blocks of 64 rows:
    # convert in place a block at a time, so that packing needs no memory to speak of
    for r in range(0, weight.shape[0], 64):
        weight[r: r + 64] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(weight[r: r + 64]).int(), 1)
    return weight, scales_and_zeros


def int8_rows_layout(weight: Tensor) -> Tensor:
    """cpu_linear.cpp's int8 layout, the int4 one's with a byte a level (int4_rows_layout): tiles of 16 outputs in
    groups of 4, each group one stream, for each block of 32 inputs, for each of its tiles, 512 bytes, 8 pieces of
    64, piece c holding output i's levels for inputs 4c .. 4c + 3 of the block in bytes 4i .. 4i + 3."""
    n, k = weight.shape
    # a group's levels take the bytes its 64 rows took: rewritten in place (no memory to speak of)
    for r in range(0, n, 64):
        rows = weight[r: r + 64]
        q = rows.view(-1, 16, k // 32, 8, 4).permute(2, 0, 3, 1, 4)  # input 32 b + 4 c + j of output i of tile t
        rows.copy_(q.reshape(rows.shape))  # (b, t, c, i, j): block by block
    return weight.view(n // 16, k // 32, 512)


def int4_rows_layout(weight: Tensor, scales: Tensor, mins: Tensor) -> tuple[Tensor, Tensor]:
    """cpu_linear.cpp's layout. Outputs in tiles of 16, and tiles in groups of 4 (the last may have fewer),
    each group one stream of bytes: for each block of 32 inputs, for each of its tiles, 256 bytes, 4 pieces
    of 64, piece c holding output i's levels in bytes 4i .. 4i + 3: byte j's low nibble at input 4c + j of
    the block, its high nibble at input 16 + 4c + j (as vpdpbusd takes 4 bytes of each of 16 outputs).
    Scales and mins likewise, a tile's 16 scales then its 16 mins for each block (a group of more inputs
    repeats its own), in their own dtype (bf16, or a GGUF's fp16; others in bf16)."""
    n, k = weight.shape[0], weight.shape[1] * 2
    # a group's levels take the bytes its 64 rows took: rewritten in place (no memory to speak of)
    for r in range(0, n, 64):
        rows = weight[r: r + 64]
        # input 32 b + 16 h + 4 c + j of output i of tile t, as (t, b, c, i, j, h)
        q = unpack_int4(rows).view(-1, 16, k // 32, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        levels = (q[..., 0] | q[..., 1] << 4).reshape(-1, k // 32, 256)  # (tiles, blocks, 256)
        rows.copy_(levels.transpose(0, 1).reshape(rows.shape))  # block by block

    def blocks(a: Tensor) -> Tensor:  # (n, groups) -> (n/16 tiles, k/32 blocks, 16)
        a = a if a.dtype in (torch.float16, torch.bfloat16) else a.bfloat16()  # as PyTorch's int4 kernels round them
        return a.repeat_interleave(k // a.shape[1] // 32, dim=1).view(n // 16, 16, k // 32).transpose(1, 2)

    sm = torch.stack([blocks(scales), blocks(mins)], dim=2)  # (tiles, blocks, 2, 16)
    sm = torch.cat([sm[t: t + 4].transpose(0, 1).reshape(-1) for t in range(0, n // 16, 4)])  # block by block
    # shaped as the kernel checks them; the bytes in the order above
    return weight.view(n // 16, k // 32, 256), sm.view(n // 16, k // 32, 2, 16)


def int4_matmul(kernel: str, x: Tensor, weight: Tensor, groupsize: int, scales_and_zeros: Tensor,
                levels: Tensor | None = None) -> Tensor:
    """x (m, k) times a weight packed for `kernel`: bf16 (cpu-tiles: fp32; it alone takes `levels`)."""
    if kernel == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x.bfloat16(), weight, groupsize, scales_and_zeros)
    if kernel == "cpu-tiles":
        return torch.ops.fastllama.int4_rows(x.bfloat16(), weight, scales_and_zeros, levels)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), weight, groupsize, scales_and_zeros)


class Int8ExpertLinears(ExpertLinears):
    """A MoE layer's stacked experts in int8: weight (n_experts, n, k), scales (n_experts, n). Dequantized
    as read: in compiled decoding that fuses into the one pass over the selected experts' bytes."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, dtype=torch.bfloat16, device=None):
        nn.Module.__init__(self)
        shape = (n_experts, out_features, in_features)
        self.register_buffer("weight", torch.empty(shape, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(n_experts, out_features, dtype=dtype, device=device))

    def expert_weights(self, experts: Tensor | None, dtype: torch.dtype) -> Tensor:
        e = slice(None) if experts is None else experts
        return self.weight[e].to(dtype) * self.scales[e].to(dtype).unsqueeze(-1)


class Int4ExpertLinears(ExpertLinears):
    """A MoE layer's stacked experts in int4: weight (n_experts, n, k/2), scales and mins (n_experts, n,
    k/groupsize) as in the file (k padded to whole groups), then each expert packed for the device's
    int4 kernel. A few rows (decoding) each take their expert's packed bytes; rows sorted by expert go
    through each expert's kernel once."""
    repacked = ("weight", "scales", "mins")  # replaced by new tensors in packing

    def __init__(self, n_experts: int, in_features: int, out_features: int, groupsize: int, dtype=torch.bfloat16,
                 device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.padded_in = whole_groups(in_features, groupsize)
        shape = (n_experts, out_features)
        self.register_buffer("weight", torch.empty(*shape, self.padded_in // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(*shape, self.padded_in // groupsize, dtype=dtype, device=device))
        self.register_buffer("mins", torch.empty(*shape, self.padded_in // groupsize, dtype=dtype, device=device))
        self.kernel = None  # as Int4Linear's

    def pack(self, kernel: str):
        if kernel == "dequantize":  # bf16 experts, computed as ExpertLinears computes them
            self.weight = dequantize_int4(self.weight, self.scales, self.mins, torch.bfloat16)[..., : self.in_features]
        else:
            packed = [int4_kernel_layout(kernel, *expert) for expert in zip(self.weight, self.scales, self.mins)]
            self.weight = torch.stack([weight for weight, _ in packed])
            self.register_buffer("scales_and_zeros", torch.stack([sz for _, sz in packed]))
        del self.scales, self.mins
        self.kernel = kernel

    def forward(self, x: Tensor, experts: Tensor, ends: Tensor | None = None) -> Tensor:
        assert self.kernel is not None, "call quantize.pack_for_device(model) after loading"
        if self.kernel == "dequantize":
            return super().forward(x, experts, ends)
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if ends is None:  # a few rows, each through its own expert's packed weights (gathered by index)
            return torch.cat([self.expert_matmul(x[p: p + 1], experts[p: p + 1]) for p in range(x.shape[0])])
        if not torch.compiler.is_compiling():  # rows sorted by expert: each expert's rows in one product
            bounds = [0, *ends.tolist()]
            return torch.cat([self.expert_matmul(x[a:b], e)
                              for e, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a])
        # compiled code cannot slice by the data: every expert over all the rows, each row keeping its own
        y = x.new_zeros(x.shape[0], self.out_features)
        for e in range(self.weight.shape[0]):
            y = torch.where((experts == e).unsqueeze(1), self.expert_matmul(x, e), y)
        return y

    def expert_matmul(self, x: Tensor, expert: int | Tensor) -> Tensor:
        """x (m, k) through one expert: an index, or a 1-element tensor of one (no host sync)."""
        weight, scales_and_zeros = self.weight[expert], self.scales_and_zeros[expert]
        if isinstance(expert, Tensor):
            weight, scales_and_zeros = weight[0], scales_and_zeros[0]
        return int4_matmul(self.kernel, x, weight, self.groupsize, scales_and_zeros).to(x.dtype)


def int8_kernel(device: torch.device, out_features: int, in_features: int, dtype: torch.dtype) -> str:
    """How int8 runs here. On CPUs with AVX-512 BF16 or AVX2, cpu_linear.cpp's kernel for a bf16 model's shapes
    it takes, whole blocks of 32 inputs, for any count of rows (benchmarks/RESULTS.md, "Int8 products in integers",
    "Int8 and int4 products in integers on the AVX2 machine"). Otherwise on CPU, compiled code's fused
    multiply-and-sum pays only with AVX-512, whose masked loads take the int8 weight a part-vector at a time;
    with AVX2 inductor copies each 8 bytes through memory first, and PyTorch's int8 kernel is faster
    (benchmarks/RESULTS.md, "CPUs without AVX-512"). On a GPU, kernels.py's, where Triton is."""
    if device.type == "cuda" and kernels:
        return "triton"
    if device.type != "cpu":
        return "dequantize"
    tiles = out_features % 16 == 0 and in_features % 32 == 0 and dtype == torch.bfloat16
    if tiles and cpu_decode.int8_kernel() is not None:
        return "cpu-tiles"
    return "cpu-fused" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "cpu"


def int4_kernel(device: torch.device, out_features: int) -> str:
    """Which int4 kernel this device and shape can use; "dequantize" where none can. On CPUs with AVX-512
    BF16 or AVX2, cpu_linear.cpp's: with AVX-512 BF16 faster than PyTorch's at many rows (prefill) and at a
    few, as fast at one (benchmarks/RESULTS.md, "Int4 products of our own on CPU"); with AVX2 faster at every
    count ("Products of our own on AVX2")."""
    if device.type == "cuda":
        ok = torch.cuda.get_device_capability(device) >= (8, 0) and out_features % 8 == 0
        return "cuda" if ok else "dequantize"
    if device.type == "cpu" and out_features % 16 == 0 and cpu_decode.int4_kernel() is not None:
        return "cpu-tiles"
    if device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "cpu" if out_features % 16 == 0 else "dequantize"
    return "dequantize"


# ---------------------------------------------------------------------------------------------
# Schemes


class Scheme:
    """What every scheme has: its names in the file's metadata, how it is made from quantize.py's
    options and read back from the metadata, and how it gets ready to quantize a checkpoint. Each
    scheme adds
      group(name, read, shape) -> Group: the tensors in the file replacing linear weight `name` of
        `shape` ((n, k), or (n_experts, n, k): a MoE layer's experts), made from read() when written;
      module(old, name) -> nn.Module: what takes the place of `old`, the model's layer `name` (an
        nn.Linear or ExpertLinears), on its device, empty until loading fills it;
      kernel(module) -> str, where its modules have a `kernel` (None until packed): the one `pack`
        takes on the module's device.
    Tensor parallelism reads a rank's slice of each tensor by its dimensions (tp.shard_selector): a
    linear's rows first (after a MoE layer's experts), its input columns last, a rank's share of them
    holding whole groups of `groupsize`."""

    method: str  # how the weights were made: the metadata's "method"
    layout: str  # how they lie in the file: the metadata's "mode", which int4's methods share
    groupsize: int | None = None
    fallback: str | None = None  # the kernel of a device that has none of the scheme's own: noted at load
    made_in_memory = True  # False where making it takes more than the weights (a calibration text, a GGUF)
    int8_layers: frozenset = frozenset()  # linears kept in int8 besides the head (Int4GGUF's)
    iq4_layers: frozenset = frozenset()  # int4 linears whose levels are IQ4_LEVELS (Int4GGUF's)

    @classmethod
    def from_options(cls, groupsize: int, **calibration) -> "Scheme":
        """The scheme quantize.py's options ask for; a UserError for options it cannot take."""
        return cls()

    @classmethod
    def from_metadata(cls, entry: dict) -> "Scheme":
        return cls()

    def metadata(self) -> dict:
        """The file's "quantization" entry, which read_scheme reads back."""
        return {"mode": self.layout, "method": self.method, "head": HEAD.method}

    def prepare(self, checkpoint_path: Path, source, config: ModelArgs) -> str:
        """Get ready to make the tensors of the checkpoint at checkpoint_path (`source`: it opened by
        safetensors); returns the file they are made from, for the metadata's "source"."""
        return str(checkpoint_path)


class Int8(Scheme):
    """Per output channel, symmetric: weight int8 (n, k), scales bf16 (n,), w ~ weight * scale."""

    method = layout = "int8"

    def group(self, name: str, read, shape: tuple) -> Group:
        base = name.removesuffix(".weight")
        specs = [(f"{base}.weight", torch.int8, shape), (f"{base}.scales", torch.bfloat16, shape[:-1])]
        return specs, lambda: quantize_int8(read())

    def module(self, old: nn.Linear | ExpertLinears, name: str) -> nn.Module:
        device = old.weight.device
        if isinstance(old, ExpertLinears):
            n_experts, out_features, in_features = old.weight.shape
            return Int8ExpertLinears(n_experts, in_features, out_features, device=device)
        return Int8Linear(old.in_features, old.out_features, old.bias is not None, device=device)

    def kernel(self, module: Int8Linear) -> str:
        return int8_kernel(module.weight.device, module.out_features, module.in_features, module.scales.dtype)


class Int4(Scheme):
    """Per group of `groupsize` input columns, asymmetric, rounded to nearest: weight uint8 (n, k/2),
    scales and mins bf16 (n, k/groupsize), k zero-padded to whole groups (x is padded to match)."""

    method = layout = "int4"
    fallback = "dequantize"
    fits = 0  # rtn_int4's least-squares fits of each group's scale and min

    def __init__(self, groupsize: int):
        if groupsize not in GROUPSIZES:
            raise UserError(f"groupsize {groupsize} is not one the int4 kernels take: choose one of {GROUPSIZES}")
        self.groupsize = groupsize

    @classmethod
    def from_options(cls, groupsize: int, **calibration) -> "Int4":
        return cls(groupsize)

    @classmethod
    def from_metadata(cls, entry: dict) -> "Int4":
        return cls(entry["groupsize"])

    def metadata(self) -> dict:
        return {"mode": self.layout, "groupsize": self.groupsize, "method": self.method, "head": HEAD.method}

    def specs(self, name: str, shape: tuple, dtype: torch.dtype = torch.bfloat16) -> list[Spec]:
        base, (*rows, k) = name.removesuffix(".weight"), shape
        groups = whole_groups(k, self.groupsize) // self.groupsize
        return [(f"{base}.weight", torch.uint8, (*rows, whole_groups(k, self.groupsize) // 2)),
                (f"{base}.scales", dtype, (*rows, groups)), (f"{base}.mins", dtype, (*rows, groups))]

    def group(self, name: str, read, shape: tuple) -> Group:
        pad = whole_groups(shape[-1], self.groupsize) - shape[-1]
        return self.specs(name, shape), lambda: rtn_int4(F.pad(read().float(), (0, pad)), self.groupsize, self.fits)

    def module(self, old: nn.Linear | ExpertLinears, name: str) -> nn.Module:
        device = old.weight.device
        if isinstance(old, ExpertLinears):
            n_experts, out_features, in_features = old.weight.shape
            return Int4ExpertLinears(n_experts, in_features, out_features, self.groupsize, device=device)
        return Int4Linear(old.in_features, old.out_features, self.groupsize, old.bias is not None, device=device,
                          iq4=name in self.iq4_layers)

    def kernel(self, module: Int4Linear | Int4ExpertLinears) -> str:
        return int4_kernel(module.weight.device, module.out_features)


class Int4GPTQ(Int4):
    """int4's layout, rounded GPTQ's way (GPTQ, below), calibrated on text layer by layer."""

    method = "int4-gptq"
    made_in_memory = False

    def __init__(self, groupsize: int, calibration_file: Path | None = None, calibration_samples: int = 32,
                 calibration_seq_len: int = 512):
        super().__init__(groupsize)
        self.calibration = calibration_file, calibration_samples, calibration_seq_len
        self.gptq = None  # the checkpoint's, once prepared

    @classmethod
    def from_options(cls, groupsize: int, calibration_file: Path | None = None, calibration_samples: int = 32,
                     calibration_seq_len: int = 512) -> "Int4GPTQ":
        if min(calibration_samples, calibration_seq_len) < 1:
            raise UserError("GPTQ needs at least one calibration sample of at least one token")
        return cls(groupsize, calibration_file, calibration_samples, calibration_seq_len)

    def prepare(self, checkpoint_path: Path, source, config: ModelArgs) -> str:
        if config.n_experts:
            raise UserError("GPTQ is not implemented for mixture-of-experts models: use --mode int4 (round to nearest)")
        self.gptq = GPTQ(source, checkpoint_path.parent, config, self.groupsize, *self.calibration)
        return super().prepare(checkpoint_path, source, config)

    def group(self, name: str, read, shape: tuple) -> Group:
        return self.specs(name, shape), lambda: self.gptq.quantize(name.removesuffix(".weight"))


class Int4GGUF(Int4):
    """For a checkpoint imported from a GGUF file: llama.cpp's Q4_0, Q4_1 and Q4_K (convert.q4_levels) are int4's
    layout at groupsize 32, so those linears are copied from the GGUF, not re-quantized (rounding a
    dequantized Q4_K weight to nearest again would move it off the file's grid): the file's levels as they
    are, and its scales and mins in fp16 (Q4_0's and Q4_1's exactly, Q4_K's d sc and dmin mn to fp16's
    precision; at run time the int4 kernels take scales and zeros in bf16, to which these round: about 2^-9
    of each, relative). A linear of ours that the GGUF holds in part in more bits a weight than int4 holds
    (convert.gguf_int8_types: Q5_0, Q5_K, Q6_K, Q8_0, ...; in a Q4_K_M file, the Q6_K of some layers' attn_v
    and ffn_down, beside Q4_K q and k in our wqkv) is int8 (int8_layers), rounded per output channel from the
    import's dequantized weight: int4 would take those parts several times as far from the file, and its
    logits from llama.cpp's (benchmarks/RESULTS.md, "A K-quant file's weights as the file holds them"). A
    linear held wholly in IQ4_NL or IQ4_XS (blocks of 32 with a scale each, its 4 bits standing for IQ4_LEVELS)
    is copied too, its levels looked up by the CPU kernel (iq4_layers; "IQ4 weights as the file holds them").
    The others are int4: rounded to it from the dequantized weight (Q3_K, Q2_K, an IQ4 part beside a Q4 one),
    each group's scale and min fitted to its levels, but for their Q4 parts, copied. Its method keeps the name
    it was first written with, for the bundled model's Q4_1."""

    method = "gguf-q4_1"
    made_in_memory = False
    fits = 4  # the rounded types' levels fitted (rtn_int4): more fits take them no nearer

    def __init__(self, groupsize: int = 32, int8_layers=(), iq4_layers=()):
        super().__init__(groupsize)
        self.int8_layers, self.iq4_layers = frozenset(int8_layers), frozenset(iq4_layers)
        # the GGUF's tensors by name, those it holds in a type copied, and those of each of ours, once prepared
        self.tensors, self.copied, self.parts = {}, set(), {}

    @classmethod
    def from_options(cls, groupsize: int, **calibration) -> "Int4GGUF":
        if groupsize != 32:
            raise UserError("int4-gguf keeps the GGUF's Q4 and IQ4 groups of 32: leave out --groupsize")
        return cls()

    @classmethod
    def from_metadata(cls, entry: dict) -> "Int4GGUF":
        return cls(int8_layers=entry.get("int8_layers", ()), iq4_layers=entry.get("iq4_layers", ()))

    def metadata(self) -> dict:
        layers = {"int8_layers": sorted(self.int8_layers), "iq4_layers": sorted(self.iq4_layers)}
        return {**super().metadata(), **{key: names for key, names in layers.items() if names}}

    def prepare(self, checkpoint_path: Path, source, config: ModelArgs) -> str:
        import gguf

        from .convert import GGUF_IQ4, GGUF_LOSSLESS_INT4, gguf_int8_types, gguf_layer_weights, gguf_names

        gguf_path = read_metadata(checkpoint_path).get("source", "")
        if not gguf_path.endswith(".gguf") or not Path(gguf_path).is_file():
            raise UserError(f"{checkpoint_path} was not imported from a GGUF file that is still there")
        self.tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
        self.copied = {name for name, t in self.tensors.items() if t.tensor_type.name in GGUF_LOSSLESS_INT4}
        self.parts = gguf_names(config)
        eight = gguf_int8_types(gguf_layer_weights(self.tensors))
        with torch.device("meta"):
            linears = set(linear_names(Transformer(config))) - {"output"}
        ours = {base: parts for name, parts in self.parts.items() if (base := name.removesuffix(".weight")) in linears}
        kinds = {base: {self.tensors[part].tensor_type.name for part, _ in parts} for base, parts in ours.items()}
        self.int8_layers = frozenset(base for base, held in kinds.items() if held & eight)
        self.iq4_layers = frozenset(base for base, held in kinds.items() if held <= set(GGUF_IQ4))
        self.copied |= {part for base in self.iq4_layers for part, _ in ours[base]}
        rounded = {kind for base, held in kinds.items() if base not in self.int8_layers | self.iq4_layers
                   for kind in held & set(GGUF_IQ4)}
        if rounded:  # beside a Q4 type in one linear: one table of levels a linear
            print(f"note: {Path(gguf_path).name}: its {', '.join(sorted(rounded))} weights that a linear of ours "
                  f"joins to Q4 ones are dequantized and quantized again as int4 (groups of 32)", file=sys.stderr)
        return gguf_path

    def group(self, name: str, read, shape: tuple) -> Group:
        parts = self.parts[name]
        if not any(part in self.copied for part, _ in parts):
            return super().group(name, read, shape)

        from .convert import q4_levels

        def make():  # each part's tensors, concatenated along rows: copied, or rounded from the weight's rows
            w = None if all(part in self.copied for part, _ in parts) else read().float()
            made, row = [], 0
            for part, heads in parts:
                rows = self.tensors[part].data.shape[0]
                if part in self.copied:
                    levels, scales, mins = q4_levels(self.tensors[part], heads)
                    made.append([pack_int4(levels), scales, mins])
                else:
                    levels, scales, mins = rtn_int4(w[row:row + rows], self.groupsize, self.fits)
                    made.append([levels, scales.half(), mins.half()])
                row += rows
            return [torch.cat(p) for p in zip(*made)]

        return self.specs(name, shape, torch.float16), make


SCHEMES = {"int8": Int8, "int4": Int4, "int4-gptq": Int4GPTQ, "int4-gguf": Int4GGUF}  # by quantize.py's --mode
# The output head's scheme in every mode: it is the largest single matrix of small models, and int4
# costs it the most accuracy
HEAD = Int8()


def layer_scheme(name: str, scheme: Scheme) -> Scheme:
    """The scheme of the linear layer `name` in a model quantized with `scheme`."""
    return HEAD if name == "output" or name in scheme.int8_layers else scheme


def read_scheme(metadata: dict[str, str]) -> Scheme | None:
    """The scheme recorded in a checkpoint's metadata, or None for an unquantized checkpoint."""
    entry = metadata.get("quantization")
    if not entry:
        return None
    entry = json.loads(entry)
    known = [scheme for scheme in SCHEMES.values() if scheme.method == entry.get("method")]
    if not known:
        raise UserError(f"this checkpoint is quantized by a method this version does not know ({entry}): quantize "
                        f"its unquantized checkpoint again")
    return known[0].from_metadata(entry)


# ---------------------------------------------------------------------------------------------
# Quantizing a model


def linear_names(model: Transformer) -> list[str]:
    """The layers that quantization replaces: every linear, the output head included, and every MoE
    layer's stacked experts; not a MoE router, whose few weights pick the experts."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, ExpertLinears)) and not name.endswith(".router")]


def quantized_groups(model: Transformer, read, scheme: Scheme, dtype: torch.dtype | None = None) -> list[Group]:
    """The tensors of `model`'s state dict as `scheme` stores them, a group of them an entry, made when
    written from read(name), the entry's unquantized tensor: each linear's weight quantized (by
    layer_scheme's scheme), the rest (embeddings, norms, biases, routers) in dtype (None: as `model`
    holds them)."""
    linears = set(linear_names(model))
    groups = []
    for name, tensor in model.state_dict().items():
        base, shape, read_one = name.removesuffix(".weight"), tuple(tensor.shape), functools.partial(read, name)
        if base in linears:
            groups.append(layer_scheme(base, scheme).group(name, read_one, shape))
        else:
            stored = dtype or tensor.dtype
            groups.append(single(name, stored, shape, lambda read_one=read_one, stored=stored: read_one().to(stored)))
    return groups


def quantized_state_dict(model: Transformer, scheme: Scheme) -> dict[str, Tensor]:
    """`model`'s state dict quantized in memory as `scheme` writes it; the tensors it does not quantize
    are model's own, not copies."""
    state = model.state_dict()
    return {spec[0]: t for specs, make in quantized_groups(model, state.__getitem__, scheme)
            for spec, t in zip(specs, make(), strict=True)}


def swap_linears(model: Transformer, scheme: Scheme):
    """Replace the layers of linear_names (nn.Linear, and MoE experts' stacked linears) by the modules of
    their scheme (layer_scheme), empty until loading fills them."""
    for name in linear_names(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, layer_scheme(name, scheme).module(getattr(parent, child), name))


def repacked_names(model: nn.Module) -> set[str]:
    """The names of the checkpoint tensors that packing replaces by new tensors (the others it keeps,
    or rewrites in place)."""
    return {f"{name}.{buffer}" for name, m in model.named_modules() for buffer in getattr(m, "repacked", ())}


def pack_for_device(model: nn.Module, scheme: Scheme | None):
    """Choose, once, the kernel of each quantized module with one to choose (its `kernel` still None)
    for its device, as its scheme says, and give its weights that kernel's layout (int4's takes a
    while); say once if some layers have only their scheme's fallback here."""
    from tqdm import tqdm

    waiting = [(name, m) for name, m in model.named_modules()
               if isinstance(m, (Int8Linear, Int4Linear, Int4ExpertLinears)) and m.kernel is None]
    fallbacks = []
    for name, m in tqdm(waiting, desc="packing quantized weights", unit="layer", leave=False, disable=not waiting):
        layer = layer_scheme(name, scheme)
        kernel = layer.kernel(m)
        m.pack(kernel)
        if kernel == layer.fallback:
            fallbacks.append(name)
    if fallbacks:
        print(f"note: no {scheme.layout} kernel here for {len(fallbacks)} layers (e.g. {fallbacks[0]}): they run "
              f"as bf16 matmuls of dequantized weights, correct but not faster", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Writing a quantized checkpoint, one tensor at a time


def output_path(checkpoint_path: Path, mode: str, groupsize: int) -> Path:
    suffix = "int8" if mode == "int8" else f"{mode}.g{groupsize}"
    return checkpoint_path.with_name(f"{checkpoint_path.stem}_{suffix}.safetensors")


def output_file(output: Path | None, checkpoint_path: Path, mode: str, groupsize: int) -> Path:
    """Where a quantized copy goes: --output (a folder: output_path's name in it), else beside the
    checkpoint; never over the checkpoint itself, nor into a folder that is not there."""
    default = output_path(checkpoint_path, mode, groupsize)
    if output is None:
        return default
    output = resolve_output(output, default.name)
    if output.resolve() == checkpoint_path.resolve():
        raise UserError(f"--output {output} is the checkpoint being quantized: name another file")
    return output


def quantize(checkpoint_path: Path, mode: str, groupsize: int = 32, output: Path | None = None,
             calibration_file: Path | None = None, calibration_samples: int = 32, calibration_seq_len: int = 512
             ) -> Path:
    """Write a quantized copy of a checkpoint beside it (or at output, with copies of the files read
    beside the weights), tensor by tensor."""
    checkpoint_path = resolve_checkpoint(checkpoint_path)
    if mode not in SCHEMES:
        raise UserError(f"unknown mode {mode!r}: choose one of {', '.join(SCHEMES)}")
    existing = read_scheme(read_metadata(checkpoint_path))
    if existing:
        raise UserError(f"{checkpoint_path} is already quantized ({json.dumps(existing.metadata())}): quantize the "
                        f"unquantized checkpoint it came from")
    scheme = SCHEMES[mode].from_options(groupsize, calibration_file=calibration_file,
                                        calibration_samples=calibration_samples,
                                        calibration_seq_len=calibration_seq_len)
    output = output_file(output, checkpoint_path, mode, groupsize)
    config = load_config(checkpoint_path)
    source = safe_open(str(checkpoint_path), framework="pt")
    with torch.device("meta"):
        model = Transformer(config)
    read = checkpoint_reader(checkpoint_path, source, model)
    made_from = scheme.prepare(checkpoint_path, source, config)
    write_safetensors(output, quantized_groups(model, read, scheme, torch.bfloat16),
                      {"quantization": json.dumps(scheme.metadata()), "source": made_from},
                      desc=f"quantizing to {mode}")
    copy_companions(checkpoint_path, output.parent)
    return output


def checkpoint_reader(checkpoint_path: Path, source, model: Transformer):
    """read(name) of each of the (meta) model's state dict entries from the checkpoint (`source`: it
    opened by safetensors), once all are checked to be there in the model's shapes."""
    tied = model.config.tie_embeddings

    def stored(name: str) -> str:  # a tied head is quantized from the embedding table, which itself stays bf16
        return "tok_embeddings.weight" if name == "output.weight" and tied else name

    for name, tensor in model.state_dict().items():
        name = stored(name)
        if name not in source.keys() or tuple(source.get_slice(name).get_shape()) != tuple(tensor.shape):
            raise UserError(f"{checkpoint_path} does not fit its model_config.json at {name}: convert it again")
    return lambda name: source.get_tensor(stored(name))


# ---------------------------------------------------------------------------------------------
# GPTQ (Frantar et al., 2022): round each column to int4, then spread its rounding error over the
# columns not yet rounded, weighted by the inverse Hessian of the layer's inputs, so the layer's
# output moves as little as possible on the calibration data.


class GPTQ:
    """Quantizes a checkpoint's linears layer by layer: a layer's Hessians come from the calibration
    activations entering it, and its quantized output feeds the next. Only one layer's weights and
    the activations are in memory at a time."""

    def __init__(self, source, checkpoint_dir: Path, config: ModelArgs, groupsize: int,
                 calibration_file: Path | None = None, n_samples: int = 32, seq_len: int = 512):
        self.source, self.config, self.groupsize = source, config, groupsize
        tokens = calibration_tokens(checkpoint_dir, calibration_file, n_samples * seq_len)
        embeddings = source.get_tensor("tok_embeddings.weight").float()
        # (n_samples, T, dim), scaled as the model scales its embeddings (Gemma)
        self.hidden = F.embedding(tokens.view(n_samples, seq_len), embeddings) * config.embedding_scale
        self.global_rope, self.local_rope = rope_tables(config, seq_len)
        self.results, self.layer = {}, -1

    def quantize(self, name: str) -> tuple[Tensor, Tensor, Tensor]:
        """Packed levels, scales and mins of linear `name` (e.g. layers.3.attention.wqkv)."""
        layer = int(name.split(".")[1])
        if layer != self.layer:  # the writer asks for layers in order
            self.quantize_layer(layer)
        return self.results.pop(name)

    @torch.no_grad()
    def quantize_layer(self, i: int):
        prefix = f"layers.{i}."
        block = TransformerBlock(self.config, i)
        block.load_state_dict({k: self.source.get_tensor(prefix + k).float() for k in block.state_dict()})
        linears = {prefix + n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        hessians = {name: torch.zeros(m.in_features, m.in_features) for name, m in linears.items()}

        def accumulate(name):
            def hook(module, args):
                x = args[0].reshape(-1, module.in_features).float()
                hessians[name].addmm_(x.T, x)  # sum of x x^T; its scale does not matter to GPTQ
            return hook

        hooks = [m.register_forward_pre_hook(accumulate(name)) for name, m in linears.items()]
        self.run(block, i)
        for h in hooks:
            h.remove()
        for name, m in linears.items():
            w = m.weight.float()
            padded = whole_groups(w.shape[1], self.groupsize)
            packed, scales, mins = gptq_int4(F.pad(w, (0, padded - w.shape[1])),
                                             F.pad(hessians[name], (0, padded - w.shape[1]) * 2), self.groupsize)
            self.results[name] = packed, scales, mins
            m.weight.copy_(dequantize_int4(packed, scales, mins)[:, : w.shape[1]])
        self.hidden = self.run(block, i)  # the next layer sees this layer's quantized output
        self.layer = i

    def run(self, block: TransformerBlock, layer: int) -> Tensor:
        """The block's output for the calibration samples, 8 at a time."""
        n, T, _ = self.hidden.shape
        c = self.config
        sliding = c.is_sliding(layer)
        rope, window = (self.local_rope, c.sliding_window) if sliding else (self.global_rope, None)
        outputs = []
        for x in self.hidden.split(8):
            # a cache of the rows at hand: the last part of the samples may be fewer than 8
            block.attention.kv_cache = KVCache(x.shape[0], T, c.n_local_heads, c.head_dim, torch.float32)
            input_pos = torch.arange(T).expand(x.shape[0], T)  # also the position in each cache slot
            rows = Rows(0, input_pos, rope[input_pos], attention_mask(input_pos, input_pos, window))
            outputs.append(block(x, [rows]))
        return torch.cat(outputs)


def gptq_int4(w: Tensor, hessian: Tensor, groupsize: int, blocksize: int = 128, damping: float = 0.01
              ) -> tuple[Tensor, Tensor, Tensor]:
    """w (n, k) -> packed levels, scales and mins as rtn_int4 gives, rounded GPTQ's way."""
    n, k = w.shape
    # w's columns, rounded one at a time, as the rows of a transposed copy: each one contiguous, not k
    # numbers apart (benchmarks/RESULTS.md, "GPTQ's columns as rows")
    wt, H = w.T.float().clone(memory_format=torch.contiguous_format), hessian.clone().double()
    dead = H.diagonal() == 0  # inputs that were always zero (padding, say): their weights do not matter
    H[dead, dead] = 1
    wt[dead] = 0
    H.diagonal().add_(damping * H.diagonal().mean())  # keeps H invertible and the updates tame
    # the upper Cholesky factor of H^-1 gives each column's update row in order
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    levels = torch.zeros(k, n, dtype=torch.uint8)
    scales = torch.zeros(k // groupsize, n, dtype=torch.bfloat16)
    mins = torch.zeros_like(scales)
    blocksize = max(blocksize, groupsize)  # a group's parameters are set from columns of one block
    for b0 in range(0, k, blocksize):
        b1 = min(b0 + blocksize, k)
        wb, hb = wt[b0:b1], h_inv[b0:b1, b0:b1]  # wb is a view: updates land in wt
        errors = torch.zeros(b1 - b0, n)
        for j in range(b1 - b0):
            col = b0 + j
            if col % groupsize == 0:  # parameters from the group's columns as already updated
                s, m = int4_group_params(wb[j: j + groupsize].T, groupsize)
                scales[col // groupsize], mins[col // groupsize] = s[:, 0].bfloat16(), m[:, 0].bfloat16()
            s, m = scales[col // groupsize].float(), mins[col // groupsize].float()
            q = torch.round((wb[j] - m) / s).clamp(0, 15)
            levels[col] = q.to(torch.uint8)
            errors[j] = (wb[j] - (q * s + m)) / hb[j, j]
            wb[j:].addr_(hb[j, j:], errors[j], alpha=-1)
        wt[b1:] -= h_inv[b0:b1, b1:].T @ errors
    return pack_int4(levels.T.contiguous()), scales.T.contiguous(), mins.T.contiguous()


def calibration_tokens(checkpoint_dir: Path, calibration_file: Path | None, n_tokens: int) -> Tensor:
    """n_tokens of calibration text: the user's file, or Python's own documentation."""
    if calibration_file is not None:
        if not Path(calibration_file).is_file():
            raise UserError(f"calibration file {calibration_file} does not exist")
        text = Path(calibration_file).read_text(errors="replace")
    else:
        text = python_docs_text("calibration")
    tokens = load_tokenizer(checkpoint_dir).encode(text)
    if len(tokens) < n_tokens:
        raise UserError(f"the calibration text has {len(tokens)} tokens; GPTQ needs {n_tokens} "
                        f"(n_samples x seq_len): give a longer --calibration_file")
    return torch.tensor(tokens[:n_tokens])


def python_docs_text(part: str) -> str:
    """English text every CPython ships (pydoc's topic help): its first half for calibration, the
    second held out for evaluation, so that a scheme is never scored on the text it was fitted to."""
    from pydoc_data.topics import topics

    names, halves = sorted(topics), ("calibration", "held-out")
    assert part in halves, part
    half = names[: len(names) // 2] if part == "calibration" else names[len(names) // 2:]
    return "\n\n".join(topics[name] for name in half)


def main(args):
    checkpoint_path = args.checkpoint_path
    if checkpoint_path is None:
        from .convert import bundled_checkpoint

        checkpoint_path = bundled_checkpoint()
    path = quantize(checkpoint_path, args.mode, args.groupsize, args.output, args.calibration_file,
                    args.calibration_samples, args.calibration_seq_len)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); run: python generate.py --checkpoint_path {path}")


def cli():
    """python quantize.py's command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--checkpoint_path", type=Path, default=None, help="default: the bundled model")
    p.add_argument("--mode", required=True,
                   help=f"one of {', '.join(SCHEMES)} (int4-gguf: copy a GGUF import's Q4 and IQ4 weights losslessly)")
    p.add_argument("--groupsize", type=int, default=32, help=f"int4 group size, one of {GROUPSIZES}")
    p.add_argument("--calibration_file", type=Path, default=None,
                   help="text to calibrate GPTQ on (default: the documentation text that ships with Python)")
    p.add_argument("--calibration_samples", type=int, default=32, help="GPTQ: sequences of calibration text")
    p.add_argument("--calibration_seq_len", type=int, default=512, help="GPTQ: tokens per sequence")
    p.add_argument("--output", type=Path, default=None,
                   help="the file to write, or a folder for it (default: beside the checkpoint)")
    run_cli(main, p.parse_args())


if __name__ == "__main__":
    cli()
