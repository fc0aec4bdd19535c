"""kernels.py's Triton int8 product, every tile configuration the autotuner may pick, against the
dequantized weight in fp64; on CPU through Triton's interpreter (conftest sets TRITON_INTERPRET where there
is no GPU), skipped where Triton is not installed."""

import pytest
import torch

from fastllama import quantize

kernels = pytest.importorskip("fastllama.kernels", reason="Triton is not installed (pip install triton)")

# N and K that no tile divides, so that every mask is exercised
N, K = 40, 448


def relative_error(y, exact):
    return ((y.double() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8])
def test_int8_every_tile_matches_the_dequantized_weight(rows):
    torch.manual_seed(rows)
    q, s = quantize.quantize_int8(torch.randn(N, K) * 0.02)
    x = torch.randn(rows, K)
    exact = x.double() @ (q.double() * s.double()[:, None]).T
    tiles = kernels.fits(kernels.configs(kernels.block_rows(rows)), {"x": x})
    assert not any(c.kwargs["DOT"] for c in tiles)  # fp32 rows never go through tf32 tensor cores
    for config in tiles:
        assert relative_error(kernels.launch(x, q, s, config), exact) < 1e-6, config
    x = x.bfloat16()
    exact = x.double() @ (q.double() * s.double()[:, None]).T
    for config in kernels.configs(kernels.block_rows(rows)):  # tensor cores too
        y = kernels.launch(x, q, s, config)
        assert y.dtype == torch.bfloat16 and relative_error(y, exact) < 1e-2, config


def test_int8_linear_on_the_triton_kernel_computes_what_dequantizing_does(monkeypatch):
    """An Int8Linear packed for the Triton kernel gives the dequantized form's outputs, for a few rows (the
    kernel, eager and compiled, where inductor sees only the op's fake) and for more than kernels.ROWS
    (the dequantized matmul)."""
    launched, launch = [], kernels.launch
    monkeypatch.setattr(kernels, "launch", lambda x, *args: launched.append(len(x)) or launch(x, *args))
    torch.manual_seed(0)
    q, s = quantize.quantize_int8(torch.randn(N, K) * 0.02)
    ours, ref = (quantize.Int8Linear(K, N, dtype=torch.float32) for _ in range(2))
    for m in (ours, ref):
        m.weight.copy_(q), m.scales.copy_(s)
    ours.pack("triton"), ref.pack("dequantize")
    compiled = torch.compile(ours, fullgraph=True)
    for rows in (1, 5, kernels.ROWS + 3):
        x = torch.randn(1, rows, K)
        expected = ref(x).double()
        assert relative_error(ours(x), expected) < 1e-5, rows
        if rows <= kernels.ROWS:
            assert relative_error(compiled(x), expected) < 1e-5, rows
    assert launched == [1, 1, 5, 5]  # eager and compiled, a few rows only
