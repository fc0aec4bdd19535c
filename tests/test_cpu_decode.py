"""Compiled CPU decoding computes what eager decoding computes, for every attention variant the model
has: cpu_decode.py changes the products only, never the attention math around them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

from fastllama import cpu_decode, quantize
from fastllama.model import Attention, KVCache, ModelArgs, Transformer, attention_mask

# Each variant changes what a decode step computes. Add a row with every new one: compiled decoding
# must follow it without a change of its own. The windows of 6 live in rings of 6 + CHUNK slots,
# which the 22 positions below wrap.
CHUNK = 4
GQA = dict(n_head=4, n_local_heads=2, head_dim=16)  # a multiple of 16, which the attention kernel takes
VARIANTS = {
    "multi-head": dict(n_head=4, n_local_heads=4, head_dim=16),
    "grouped-query, head_dim != dim / n_head": dict(GQA, head_dim=24),
    "Qwen2: q/k/v biases, one sliding layer": dict(GQA, qkv_bias=True, sliding_window=6, sliding_layers=[1]),
    "Qwen3: q/k norms": dict(GQA, head_dim=24, qk_norm=True),
    "Mistral: every layer sliding": dict(GQA, sliding_window=6),
    "Gemma 2: soft-caps, sandwich norms, GeGLU, scales": dict(
        GQA, norm_offset=1.0, sandwich_norms=True, activation="gelu_tanh", embedding_scale=48 ** 0.5,
        attention_scale=0.2, attention_softcap=5.0, logit_softcap=3.0, sliding_window=6, sliding_layers=[0]),
    "Gemma 3: q/k norms, local RoPE base, linear scaling": dict(
        GQA, norm_offset=1.0, sandwich_norms=True, qk_norm=True, sliding_window=6, sliding_layers=[0],
        local_rope_base=100.0, rope_scaling=dict(rope_type="linear", factor=4.0)),
    "Phi-3: partial rotary, longrope": dict(
        GQA, rope_dim=8, sliding_window=6, rope_scaling=dict(
            rope_type="longrope", short_factor=[1.0, 1.5, 2.0, 2.5], long_factor=[3.0, 4.0, 5.0, 6.0],
            original_max_position_embeddings=20, attention_factor=1.1)),
    # decoding 2 rows, 2 * top-k (token, expert) pairs: at most n_experts, each reads its expert's weights
    "Mixtral: 4 experts, top 2": dict(GQA, n_experts=4, n_active_experts=2, moe_intermediate_size=32),
    "Qwen3-MoE: a dense layer among routed ones": dict(GQA, qk_norm=True, n_experts=4, moe_layers=[1],
                                                       moe_intermediate_size=32),
    "an int8 KV cache": dict(GQA, kv_cache_dtype=torch.int8),
    "OLMoE: q/k norms over all heads, top 3 of 8 not renormalized": dict(
        GQA, qk_norm=True, qk_norm_per_head=False, n_experts=8, n_active_experts=3, normalize_expert_weights=False),
}


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


needs_kernel = pytest.mark.skipif(cpu_decode.attention_kernel() is None,
                                  reason="decode attention's kernel needs AVX2 or AVX-512 and a C++ compiler")


def test_the_kernels_build_where_the_cpu_and_a_compiler_allow():
    """A kernel that cannot be built leaves PyTorch's own form (one line says so), and its tests skip: where the CPU
    has AVX2 or AVX-512 and a C++ compiler and ninja are here, a failed build is a bug that those skips would hide.
    The products need AVX-512 BF16 where the CPU has AVX-512, and their bf16 tiles are used only there."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AMX"):
        pytest.skip("the kernels are for CPUs with AVX2 or AVX-512")
    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja to build them")
    assert cpu_decode.attention_kernel() is not None
    bf16 = torch.cpu._is_avx512_bf16_supported()  # the products' AVX-512 form is built on its vdpbf16ps
    assert cpu_decode.linear_kernels() == (bf16 or torch.backends.cpu.get_cpu_capability() == "AVX2")
    assert (cpu_decode.bf16_kernel() is not None) == bf16


def test_a_kernels_build_name_follows_its_source_and_header(tmp_path):
    """Two versions of a kernel (a fork beside the installed library) are built under names of their own, so that
    neither rebuilds over the other; one source keeps its name (PyTorch then reuses its build)."""
    source, header = tmp_path / "cpu_linear.cpp", tmp_path / "cpu_vectors.h"
    source.write_text("// a kernel\n")
    header.write_text("// its vectors\n")
    first = cpu_decode.extension_name(source)
    assert first.startswith("fastllama_cpu_linear_") and cpu_decode.extension_name(source) == first
    header.write_text("// its vectors, changed\n")
    second = cpu_decode.extension_name(source)
    source.write_text("// a kernel, changed\n")
    assert len({first, second, cpu_decode.extension_name(source)}) == 3


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False])
@pytest.mark.parametrize("slots", [64, None])
@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_compiled_cpu_decode_equals_a_full_forward(variant, slots, kernel, monkeypatch):
    """slots: the full caches' slots a step reads, whole blocks of VALUE_BLOCK (as decode.key_positions
    reads them: values_product), or None, all 65 (the values through rows_product). kernel: attention
    through cpu_attention.cpp's kernel where it takes the shape, or the compiled form alone."""
    monkeypatch.setattr(cpu_decode, "USE_ATTENTION_KERNEL", kernel)
    torch.manual_seed(0)
    args = dict(VARIANTS[variant])
    kv_cache_dtype = args.pop("kv_cache_dtype", None)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=48, block_size=128, **args)).eval()
    ids = torch.randint(0, 64, (2, 24))
    model.setup_caches(2, 64, chunk=CHUNK, kv_cache_dtype=kv_cache_dtype)
    reference = model(ids, torch.arange(24))  # one eager forward over every position, CHUNK at a time

    cpu_decode.apply(model)
    torch._dynamo.reset()  # each variant compiles the same lambda anew: past the recompile limit otherwise
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    keys = None if slots is None else model.positions[:, :slots]
    step = torch.compile(lambda x, pos: model(x, pos, keys), backend=inductor, fullgraph=True, dynamic=False)
    # rows at different depths: row 0 has 16 tokens of prompt, row 1 has 12
    depth = torch.tensor([16, 12])
    model(ids[:, :16], torch.arange(16))
    for _ in range(6):
        x = ids[torch.arange(2), depth][:, None]
        logits = step(x, depth[:, None])[:, 0]  # (B, V)
        assert relative_error(logits, reference[torch.arange(2), depth]) <= 1e-4
        eager = model(x, depth[:, None])[:, 0]
        assert relative_error(logits, eager) <= 1e-4
        depth = depth + 1
    # the compiled step took the fused attention products, not PyTorch's kernels (its linears keep
    # F.linear: the fused one-row form is for one row, and these are two)
    assert len(graphs) == 1
    assert not any(op in graphs[0].code for op in ("matmul", "bmm", "scaled_dot_product")), graphs[0].code
    takes = model.config.head_dim % 16 == 0 and model.config.attention_softcap is None
    assert ("decode_attention" in graphs[0].code) == (kernel and takes)


@pytest.mark.parametrize("slow_bf16", [True, False])
@pytest.mark.parametrize("rows", [1, cpu_decode.MANY_ROWS - 1, cpu_decode.MANY_ROWS, 40])
@torch.no_grad()
def test_many_bf16_rows_multiply_in_fp32_where_bf16_is_slow(monkeypatch, slow_bf16, rows):
    """On a CPU without native bf16 matmuls, a bf16 linear of MANY_ROWS or more rows multiplies in fp32
    and rounds its output to bf16; fewer rows, or a CPU with them, keep PyTorch's bf16 matmul."""
    monkeypatch.setattr(cpu_decode, "SLOW_BF16_MATMUL", slow_bf16)
    linear = torch.nn.Linear(64, 48, bias=True).bfloat16()
    x = torch.randn(1, rows, 64).bfloat16()
    expected = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()).bfloat16()
    cpu_decode.apply(linear)
    assert type(linear) is cpu_decode.FewRowLinear
    dtypes, linear_op = [], torch.nn.functional.linear  # the dtype each product ran in
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *w: dtypes.append(x.dtype) or linear_op(x, *w))
    y = linear(x)
    fp32 = slow_bf16 and rows >= cpu_decode.MANY_ROWS
    assert dtypes == [torch.float32 if fp32 else torch.bfloat16] and y.dtype == torch.bfloat16
    assert (y.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()


@pytest.mark.parametrize("weights", ["bf16", "int8"])
@torch.no_grad()
def test_compiled_for_any_count_of_rows_a_product_chooses_its_form_when_it_runs(monkeypatch, weights):
    """Compiled for any length (prefill), a linear whose form turns on its count of rows (bf16 where bf16 is
    slow: fp32 for many rows; int8 without our kernel: PyTorch's int8 kernel for a few) takes the form each
    call's count asks, in one graph: the count is not asked while compiling (a guard would split the graph,
    and bound the count), nor taken for many (a short prompt would lose the few rows' speed)."""
    monkeypatch.setattr(cpu_decode, "SLOW_BF16_MATMUL", True)
    torch._dynamo.reset()
    if weights == "bf16":
        linear = torch.nn.Linear(64, 48, bias=True).bfloat16()
        cpu_decode.apply(linear)
        weight = linear.weight.float()
    else:
        linear = quantize.Int8Linear(64, 48, bias=True)
        linear.weight, linear.scales = quantize.quantize_int8(torch.randn(48, 64))
        linear.bias.normal_()
        linear.pack("cpu")
        weight = linear.weight.float() * linear.scales.float()[:, None]
    dtypes, linear_op = [], torch.nn.functional.linear  # the dtype each matmul ran in
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *w: dtypes.append(x.dtype) or linear_op(x, *w))
    step = torch.compile(linear, dynamic=True, fullgraph=True)
    for rows in (20, 3, 40):
        x = torch.randn(1, rows, 64).bfloat16()
        with torch._dynamo.config.patch(error_on_recompile=rows != 20):
            y = step(x)
        expected = linear_op(x.float(), weight, linear.bias.float())
        assert (y.float() - expected).abs().max() <= 1e-2 * expected.abs().max()
    # an int8 weight's 3 rows went through the int8 kernel, and no matmul
    assert dtypes == ([torch.float32, torch.bfloat16, torch.float32] if weights == "bf16" else [torch.float32] * 2)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_in_converts_the_weight_in_blocks(monkeypatch, bias):
    """linear_in gives F.linear's result when it converts a weight block by block (blocks of 3 rows
    of 10 here, the last one short)."""
    monkeypatch.setattr(cpu_decode, "CONVERTED_ELEMENTS", 3 * 16)
    weight, x = torch.randn(10, 16).bfloat16(), torch.randn(2, 5, 16)
    b = torch.randn(10).bfloat16() if bias else None
    expected = torch.nn.functional.linear(x, weight.float(), None if b is None else b.float())
    torch.testing.assert_close(cpu_decode.linear_in(torch.float32, x, weight, b), expected)


def recording_inductor():
    """A fresh dynamo, and inductor as a torch.compile backend that keeps each graph it is given, in order."""
    torch._dynamo.reset()
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    return graphs, inductor


@pytest.mark.skipif(not cpu_decode.PACKABLE, reason="oneDNN has no bf16 kernels on this CPU")
@torch.no_grad()
def test_products_read_the_packed_weight_but_compiled_ones_of_one_or_two_rows():
    """After pack(many_rows=True), a compiled bf16 product of 3 to FEW_ROWS rows is oneDNN's over its packed
    copy of the weight (F.linear's result, bias included) and one or two rows (LOOP_ROWS) keep the fused
    loop; so is an eager product of any rows (eval.py's scoring); pack() keeps a current copy and makes a
    new one for a weight written in place, and until it does, eager products read the weight as it is."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True).bfloat16()
    cpu_decode.apply(linear)
    cpu_decode.pack(linear, many_rows=True)
    first = linear.packed
    cpu_decode.pack(linear, many_rows=True)
    assert linear.packed is first and not linear.tiled
    graphs, inductor = recording_inductor()
    step = torch.compile(lambda x: linear(x), backend=inductor, fullgraph=True, dynamic=False)
    for rows in (1, 2, 3, 6):
        x = torch.randn(1, rows, 64).bfloat16()
        torch.testing.assert_close(step(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert ["packed_linear" in graph.code for graph in graphs] == [False, False, True, True]
    for rows in (1, 40):
        x = torch.randn(2, rows, 64).bfloat16()
        with torch.profiler.profile() as profile:
            y = linear(x)
        assert "fastllama::packed_linear" in [event.key for event in profile.key_averages()]
        torch.testing.assert_close(y, torch.nn.functional.linear(x, linear.weight, linear.bias))
    linear.weight.mul_(-1)
    x = torch.randn(2, 20, 64).bfloat16()
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    cpu_decode.pack(linear, many_rows=True)
    assert linear.packed is not first
    x = torch.randn(1, cpu_decode.FEW_ROWS, 64).bfloat16()
    torch.testing.assert_close(step(x), torch.nn.functional.linear(x, linear.weight, linear.bias))


needs_bf16_kernel = pytest.mark.skipif(cpu_decode.bf16_kernel() is None,
                                       reason="bf16 tiles are used on CPUs with AVX-512 BF16, where a compiler builds them")


# cpu_linear.cpp built for AVX2 only, in a process of its own (its ops have the names of the native build's):
# each product of the inputs in argv[2], saved to argv[3]
AVX2_PRODUCTS = """
import sys, torch
from torch.utils import cpp_extension
cpp_extension.load("fastllama_cpu_linear_avx2_form", [sys.argv[1]], extra_cflags=["-O3", "-march=x86-64-v3", "-fopenmp"],
                   is_python_module=False)
products = {name: getattr(torch.ops.fastllama, op)(*args) for name, (op, args) in torch.load(sys.argv[2]).items()}
torch.save(products, sys.argv[3])
"""


@pytest.mark.skipif(cpu_decode.bf16_kernel() is None, reason="against the AVX-512 form: a CPU with AVX-512 BF16")
@torch.no_grad()
def test_the_products_avx2_form_gives_the_avx512_forms_numbers(tmp_path):
    """cpu_linear.cpp's AVX2 form, built apart (x86-64-v3) and run in a process of its own, gives the AVX-512 form's
    numbers for each product to fp32's rounding (their integer sums are the same): a machine with AVX-512 tests what
    AVX2 machines run. int4, int4 with IQ4's levels looked up, int8 and bf16 tiles; 6 rows, passes of 4 and 2."""
    n, k = 64, 256
    x = torch.randn(6, k).bfloat16()
    scales, mins = (torch.rand(n, k // 32) / 100).half(), (torch.randn(n, k // 32) / 100).half()
    w4, sm = quantize.int4_rows_layout(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), scales, mins)
    iq4 = torch.tensor(quantize.IQ4_LEVELS, dtype=torch.int8)
    w8 = quantize.int8_rows_layout(torch.randint(-127, 128, (n, k), dtype=torch.int8))
    tiles = cpu_decode.tiles_layout(torch.randn(n, k).bfloat16())
    inputs = {"int4": ("int4_rows", (x, w4, sm, None)), "iq4": ("int4_rows", (x, w4, sm, iq4)),
              "int8": ("int8_rows", (x, w8)), "bf16": ("bf16_rows", (x, tiles))}
    torch.save(inputs, tmp_path / "inputs.pt")
    source = Path(cpu_decode.__file__).with_name("cpu_linear.cpp")
    run = subprocess.run([sys.executable, "-c", AVX2_PRODUCTS, str(source), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "avx2.pt")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    avx2 = torch.load(tmp_path / "avx2.pt")
    for name, (op, args) in inputs.items():
        assert relative_error(avx2[name], getattr(torch.ops.fastllama, op)(*args)) < 1e-5, name


@pytest.mark.skipif(not cpu_decode.linear_kernels(), reason="cpu_linear.cpp needs AVX2 or AVX-512 and a C++ compiler")
@pytest.mark.parametrize("n, k", [(48, 64), (112, 576), (16, 2)])  # groups of 3 tiles; 4 and 3; one tile
@torch.no_grad()
def test_the_bf16_tiles_kernel_computes_the_product_and_a_row_alone_as_in_a_batch(n, k):
    """cpu_linear.cpp's bf16_rows over a weight in tiles (tiles_layout's): x w^T to fp32's rounding of the same
    numbers, for 1 to 20 rows (passes of 8, 8 and 4 over each group of tiles) and 150, and each row's numbers the
    same bits alone as in a batch (a request's tokens in the server do not depend on who shares its steps).
    int8_rows: test_quantize.py."""
    weight = torch.randn(n, k).bfloat16()
    tiles = cpu_decode.tiles_layout(weight)
    kernel = torch.ops.fastllama.bf16_rows
    x = torch.randn(20, k).bfloat16()
    y = kernel(x, tiles)
    assert y.dtype == torch.float32 and y.shape == (20, n)
    largest = weight.abs().max().item()
    torch.testing.assert_close(y, x.double() @ weight.double().t(), rtol=1e-5, atol=1e-5 * largest, check_dtype=False)
    for rows in (1, 3, 8, 9, 17):
        assert torch.equal(kernel(x[:rows], tiles), y[:rows])
    assert torch.equal(kernel(x[5:6], tiles), y[5:6])
    many = torch.randn(150, k).bfloat16()
    torch.testing.assert_close(kernel(many, tiles), many.double() @ weight.double().t(), rtol=1e-5,
                               atol=1e-5 * largest, check_dtype=False)


@needs_bf16_kernel
@torch.no_grad()
def test_after_pack_products_of_a_few_rows_read_the_tiles():
    """pack() gives a bf16 linear a copy in cpu_linear.cpp's tiles: compiled and eager products of at most
    TILE_ROWS rows read it (F.linear's result, bias included), one row too, and more rows take the plain weight;
    compiled prefill's symbolic count chooses when it runs. A linear whose outputs are not whole tiles keeps
    oneDNN's copy."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True).bfloat16()
    odd = torch.nn.Linear(64, 40).bfloat16()
    cpu_decode.apply(linear), cpu_decode.apply(odd)
    cpu_decode.pack(linear), cpu_decode.pack(odd)
    assert linear.tiled and linear.packed.shape == (3, 32, 32) and not odd.tiled
    graphs, inductor = recording_inductor()
    step = torch.compile(lambda x: linear(x), backend=inductor, fullgraph=True, dynamic=False)
    for rows in (1, 2, 6, cpu_decode.TILE_ROWS, cpu_decode.TILE_ROWS + 1):
        x = torch.randn(1, rows, 64).bfloat16()
        torch.testing.assert_close(step(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert ["bf16_rows" in graph.code for graph in graphs] == [True, True, True, True, False]
    prefill = torch.compile(lambda x: linear(x), backend=inductor, fullgraph=True, dynamic=True)
    for rows, read in ((5, True), (7, True), (cpu_decode.TILE_ROWS + 3, False)):
        x = torch.randn(1, rows, 64).bfloat16()
        with torch.profiler.profile() as profile:
            y = prefill(x)
        assert ("aten::linear" in [event.key for event in profile.key_averages()]) != read  # the plain weight's
        torch.testing.assert_close(y, torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert "bf16_linear" in graphs[-1].code and len(graphs) == 6  # one graph for every prefill
    for rows, read in ((3, True), (cpu_decode.TILE_ROWS + 1, False)):
        x = torch.randn(1, rows, 64).bfloat16()
        with torch.profiler.profile() as profile:
            y = linear(x)
        assert ("fastllama::bf16_rows" in [event.key for event in profile.key_averages()]) == read
        torch.testing.assert_close(y, torch.nn.functional.linear(x, linear.weight, linear.bias))


def decode_attention_kernel(name: str) -> tuple:
    """A decode attention kernel and the most rows it takes: cpu_attention.cpp's, or kernels.py's Triton
    kernel (interpreted on CPU: conftest sets TRITON_INTERPRET where there is no GPU)."""
    if name == "cpu":
        return cpu_decode.attention_kernel(), cpu_decode.ATTENTION_ROWS
    kernels = pytest.importorskip("fastllama.kernels", reason="Triton is not installed (pip install triton)")
    return kernels.decode_attention, kernels.ATTENTION_ROWS


@needs_kernel
@pytest.mark.parametrize("store", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("scales", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_the_cpu_kernel_reads_a_scaled_caches_scales_in_the_models_dtype(store, scales):
    """A bf16 or fp16 model's cache keeps its scales in that dtype, which the CPU kernel reads where they lie:
    the same result as from the same scales in fp32 (exactly: each converts to fp32 without loss), or lying
    apart in memory."""
    torch.manual_seed(0)
    B, n_kv, group, hd, length, S = 2, 3, 3, 64, 300, 280
    cache = KVCache(B, length, n_kv, hd, scales, store_dtype=store)
    positions = torch.arange(length).expand(B, -1)
    cache.write(positions, *(torch.randn(B, length, n_kv, hd, dtype=scales) for _ in "kv"))
    mask = attention_mask(torch.tensor([[270], [40]]), positions[:, :S])
    q = torch.randn(B, n_kv, group, hd)
    kernel = cpu_decode.attention_kernel()
    ours = kernel(q, cache.k_cache, cache.v_cache, cache.k_scales, cache.v_scales, mask, 0.125)
    fp32 = kernel(q, cache.k_cache, cache.v_cache, cache.k_scales.float(), cache.v_scales.float(), mask, 0.125)
    assert torch.equal(ours, fp32)
    strided = [torch.cat([x, x], -1)[..., :1] for x in (cache.k_scales, cache.v_scales)]  # a position's 2 elements apart
    assert torch.equal(kernel(q, cache.k_cache, cache.v_cache, *strided, mask, 0.125), ours)
    assert relative_error(ours, kernel(q, cache.k_cache, cache.v_cache, cache.k_scales.float() * 1.01,
                                       cache.v_scales.float(), mask, 0.125)) > 1e-4  # the scales are read


@needs_kernel
@torch.no_grad()
def test_the_cpu_kernel_takes_a_bf16_q_as_its_fp32_numbers():
    """A bf16 model's q, converted by the kernel itself (contiguous) or by ATen (strided): exactly the result
    of the same numbers given in fp32."""
    torch.manual_seed(0)
    B, n_kv, group, hd, length = 2, 3, 3, 64, 200
    cache = KVCache(B, length, n_kv, hd, torch.bfloat16)
    positions = torch.arange(length).expand(B, -1)
    cache.write(positions, *(torch.randn(B, length, n_kv, hd, dtype=torch.bfloat16) for _ in "kv"))
    mask = attention_mask(torch.tensor([[150], [40]]), positions)
    kernel = cpu_decode.attention_kernel()
    strided = torch.randn(B, n_kv, hd, group, dtype=torch.bfloat16).transpose(2, 3)
    for q in (torch.randn(B, n_kv, group, hd, dtype=torch.bfloat16), strided):
        assert torch.equal(*(kernel(x, cache.k_cache, cache.v_cache, None, None, mask, 0.125) for x in (q, q.float())))


@pytest.mark.parametrize("kernel", [pytest.param("cpu", marks=needs_kernel), "triton"])
@pytest.mark.parametrize("store", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("B, n_kv, group, T, hd", [(1, 3, 3, 1, 64), (3, 2, 1, 1, 128), (2, 1, 4, 3, 80),
                                                   (2, 2, 8, 2, 16)])
@torch.no_grad()
def test_the_attention_kernels_compute_the_written_out_form(kernel, store, B, n_kv, group, T, hd):
    """Each decode attention kernel against model.py's own attention over the same cache (fp32 model, a cache
    of each format), for rows at their own depths under a sliding window, T positions a row, group query
    heads a key/value head; and slots that no row sees are never read into the result (stale or NaN)."""
    torch.manual_seed(0)
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    # S slots read; where the kernel cuts them (chunk_for), the first row sees across a cut; the last chunk's last
    # 16 slots end past S
    length, S = 900, 808
    attention = Attention(ModelArgs(n_head=n_kv * group, n_local_heads=n_kv, head_dim=hd, dim=64))
    attention.kv_cache = KVCache(B + 1, length, n_kv, hd, torch.float32, device, store_dtype=store)
    positions = torch.arange(length, device=device).expand(B, -1)
    k, v = (torch.randn(B, length, n_kv, hd, device=device) for _ in "kv")
    attention.kv_cache.write(positions, k, v)
    depth = torch.tensor([599, 300, 17], device=device)[:B, None] - torch.arange(T, device=device).flip(0)
    mask = attention_mask(depth, positions[:, :S], window=250)  # each row at its own depth, T positions
    q = torch.randn(B, n_kv * group, T, hd, device=device)
    expected = attention.attend_cache(q, mask)
    attention.decode_kernel, attention.decode_rows = decode_attention_kernel(kernel)
    ours = attention.attend_cache(q, mask)
    bound = 1e-5
    if kernel == "cpu" and store == torch.int8:
        # the CPU kernel multiplies an int8 cache's levels in 16-bit integers, the rows and the weights rounded
        # to a part in 65,534 of their largest: a change far below the cache's own rounding (a part in 254)
        unrounded = attention.attend(q, *(x[:, :S].transpose(1, 2) for x in (k, v)), mask)
        bound = relative_error(expected, unrounded) / 20  # (12-bit levels fail it)
    assert relative_error(ours, expected) <= bound
    if kernel == "cpu":  # the mask as bytes (cpu_decode.decode_attention), and with its positions strided
        for other in (mask.to(torch.uint8), mask.transpose(2, 3).contiguous().transpose(2, 3)):
            assert torch.equal(attention.attend_cache(q, other), ours)
        threads = torch.get_num_threads()
        try:  # the kernel cuts a head's positions into as many chunks as make its tasks a multiple of the threads
            for n in (1, 2, 4, 8):  # (chunk_for): one at 1 thread; more, merged, at some of 2, 4 and 8 for each shape
                torch.set_num_threads(n)
                assert relative_error(attention.attend_cache(q, mask), expected) <= bound
        finally:
            torch.set_num_threads(threads)
    if store.is_floating_point and store.itemsize > 1:  # a NaN to write; the last row's slots past the rows read too
        unseen = ~mask.any(2)[:, 0]  # (B, S)
        for cache in (attention.kv_cache.k_cache, attention.kv_cache.v_cache):
            cache[:B, :, :S][unseen[:, None].expand(-1, n_kv, -1)] = float("nan")
        cache[B:] = float("nan")
        assert torch.equal(attention.attend_cache(q, mask), ours)


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(),
                    reason="huge pages only where asked for (madvise), as PyTorch's THP_MEM_ALLOC_ENABLE asks")
def test_importing_the_package_puts_big_cpu_tensors_in_huge_pages():
    """fastllama sets THP_MEM_ALLOC_ENABLE=1 unless the environment sets it: a 64 MB tensor made after the import
    lies in huge pages; with THP_MEM_ALLOC_ENABLE=0, in none."""
    code = ("import fastllama, torch; x = torch.ones(1 << 24); print(next(line.split()[1] for line in "
            "open('/proc/self/smaps_rollup') if line.startswith('AnonHugePages')))")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    on, off = (int(subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                                  check=True).stdout) for extra in ({}, {"THP_MEM_ALLOC_ENABLE": "0"}))
    assert on >= 32 * 1024 and off == 0  # kB: half the tensor at least
