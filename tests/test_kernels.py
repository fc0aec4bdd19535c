"""kernels.py's Triton products, every tile configuration the autotuner may pick, against the dequantized
weight in fp64; on CPU through Triton's interpreter (conftest sets TRITON_INTERPRET where there is no
GPU), skipped where Triton is not installed."""

import pytest
import torch

import quantize

kernels = pytest.importorskip("kernels", reason="Triton is not installed (pip install triton)")

# N and K that no tile divides, so that every mask is exercised; K holds whole groups of 64 and 32
N, K = 40, 448


def int4_weight(w, groupsize):
    scales, mins = quantize.int4_group_params(w, groupsize)
    packed = quantize.pack_int4(quantize.quantize_int4(w, scales, mins))
    scales, mins = scales.bfloat16(), mins.bfloat16()
    return packed, scales, mins, quantize.dequantize_int4(packed, scales, mins, torch.float64)


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
        y = kernels.launch(kernels.int8_rows_kernel, x, N, (q, s), (K, x.stride(0), q.stride(0), N), config=config)
        assert relative_error(y, exact) < 1e-6, config
    x = x.bfloat16()
    for config in kernels.configs(kernels.block_rows(rows)):  # tensor cores too
        y = kernels.launch(kernels.int8_rows_kernel, x, N, (q, s), (K, x.stride(0), q.stride(0), N), config=config)
        assert y.dtype == torch.bfloat16 and relative_error(y, x.double() @ (q.double() * s.double()[:, None]).T) < 1e-2


@pytest.mark.parametrize("groupsize", [32, 64])
@pytest.mark.parametrize("rows", [1, 6])
def test_int4_every_tile_matches_the_dequantized_weight(rows, groupsize):
    torch.manual_seed(rows)
    packed, scales, mins, w = int4_weight(torch.randn(N, K) * 0.02, groupsize)
    layout = kernels.int4_layout(packed, groupsize)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, K).to(dtype)
        exact = x.double() @ w.T
        tiles = kernels.fits(kernels.configs(kernels.block_rows(rows)), {"x": x}, GROUP=groupsize)
        assert tiles and all(c.kwargs["BLOCK_K"] % groupsize == 0 for c in tiles)
        for config in tiles:
            y = kernels.launch(kernels.int4_rows_kernel, x, N, (layout, scales, mins),
                               (K, x.stride(0), layout.stride(0), scales.stride(0), N), config=config, GROUP=groupsize)
            assert relative_error(y, exact) < (1e-6 if dtype == torch.float32 else 1e-2), (dtype, config)


def test_int4_layout_round_trips():
    packed, scales, mins, w = int4_weight(torch.randn(N, K), 64)
    assert torch.equal(kernels.int4_dequantize(kernels.int4_layout(packed, 64), scales.double(), mins.double(), 64), w)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_linears_on_the_triton_kernels_compute_what_dequantizing_does(mode):
    """A quantized linear packed for the Triton kernels gives the dequantized form's outputs, for a few rows
    (the kernels, eager and compiled, where inductor sees only the op's fake) and for more than kernels.ROWS
    (prefill's dequantized matmul)."""
    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.02
    if mode == "int8":
        q, s = quantize.quantize_int8(w)
        ours, ref = (quantize.Int8Linear(K, N, dtype=torch.float32) for _ in range(2))
        for m in (ours, ref):
            m.weight.copy_(q), m.scales.copy_(s)
    else:
        packed, scales, mins, _ = int4_weight(w, 32)
        ours, ref = (quantize.Int4Linear(K, N, 32) for _ in range(2))
        for m in (ours, ref):
            m.weight.copy_(packed), m.scales.copy_(scales), m.mins.copy_(mins)
    ours.pack("triton"), ref.pack("dequantize")
    compiled = torch.compile(ours, fullgraph=True)
    tolerance = 1e-5 if mode == "int8" else 1e-2  # the int4 reference multiplies in bf16
    for rows in (1, 5, kernels.ROWS + 3):
        x = torch.randn(1, rows, K)
        expected = ref(x).double()
        assert relative_error(ours(x), expected) < tolerance, rows
        if rows <= kernels.ROWS:
            assert relative_error(compiled(x), expected) < tolerance, rows
