"""Compiled decoding on CPU: the one-row products of a decode step as multiply-and-sum expressions.

Inductor fuses such an expression into one vectorized loop over the weight (or the cache), which on
CPU reads it faster than the BLAS call aten.mm makes at one row, converts int8 in registers, and
fuses attention's softmax between its two products (scripts/benchmark.py measures the matmul side;
the README has the figures). Eager calls and calls of many rows keep PyTorch's kernels.

    cpu_decode.apply(model)   # once, after loading; a no-op for a model on another device

Only the products change: the attention math around them (scale, mask, softmax, any variant) is
model.py's own, so compiled decoding computes what eager decoding computes.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import Attention, ExpertLinears, Transformer


def one_row_product(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., k) of one row times weight (n, k) transposed, accumulated in fp32; or rows (P, k), each
    times its own weight (P, n, k) (a MoE layer's experts)."""
    # as_strided (a no-op) makes inductor compute x into a buffer first. Otherwise it inlines x's
    # producer (a norm, an activation) into the loop over the weight's rows and recomputes it for
    # every one of the n outputs.
    x = x.as_strided(x.shape, x.stride())
    return (x.unsqueeze(-2).float() * weight.float()).sum(-1)


def fused_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for attention's few-row products, (..., m, k) @ (..., k, n), as a multiply-and-sum in
    fp32 when compiling."""
    if not torch.compiler.is_compiling():
        return torch.matmul(a, b)
    return (a.unsqueeze(-1).float() * b.unsqueeze(-3).float()).sum(-2)


class OneRowLinear(nn.Linear):
    """nn.Linear whose compiled one-row forward is one_row_product (same weights, another forward)."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1:
            y = one_row_product(x, self.weight)
            return (y if self.bias is None else y + self.bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def apply(model: Transformer):
    """On CPU, give the model's linears, attention products and experts' products the forms above.
    Quantized linears (quantize.py) choose their own CPU path when packed."""
    if next(model.parameters()).device.type != "cpu":
        return
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneRowLinear
        elif isinstance(module, Attention):
            module.matmul = fused_matmul
        elif isinstance(module, ExpertLinears):  # each row times its own expert's weights
            module.product = one_row_product
