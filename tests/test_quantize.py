"""Weight-only quantization: the kernels against dequantize-then-matmul, the layouts, quantized
checkpoints of the bundled model end to end (older metadata too), a scheme the test adds on its own, bad
input, and the memory a quantized load takes.

The kernel checks draw fresh random data on every run (no seed): their bounds hold for any data."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from fastllama import cpu_decode, quantize
from fastllama.checkpoint import (CHECKPOINT_NAME, CONFIG_NAME, copy_companions, load_config, read_metadata, read_safetensors,
                        single, write_safetensors)
from fastllama.errors import UserError
from fastllama.generate import generate, get_tokenizer, load_model, weight_bytes_per_token
from fastllama.model import ModelArgs, Transformer
from fastllama.quantize import (GROUPSIZES, Int4Linear, Int8Linear, dequantize_int4, pack_int4, quantize_int8, rtn_int4,
                      unpack_int4)

REPO = Path(__file__).resolve().parents[1]
BF16_RTOL = 2e-2  # max|y - ref| / max|ref| for a bf16 result against an fp32 reference
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(autouse=True)
def fresh_random_data():
    """Other test files seed torch's global generator: reseed from the OS so each run draws new data,
    and print the seed (shown with a failure) to reproduce it."""
    print(f"torch seed {torch.seed()}")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def random_weight(n: int, k: int) -> torch.Tensor:
    """Gaussian rows of very different magnitudes, so that per-row / per-group scales matter."""
    return torch.randn(n, k) * torch.randn(n, 1).exp()


def as_the_kernel_takes(x: torch.Tensor, padded_in: int, bits: int) -> torch.Tensor:
    """x as cpu_linear.cpp's int4 or int8 products multiply it: where cpu_decode.rounds_activations(bits), each
    block of 32 inputs (of x zero-padded to padded_in) rounded to int8 against its largest magnitude, ties to even;
    else x."""
    if not cpu_decode.rounds_activations(bits):
        return x.float()
    k = x.shape[-1]
    blocks = F.pad(x.float(), (0, padded_in - k)).unflatten(-1, (-1, 32))
    largest = blocks.abs().amax(-1, keepdim=True)
    # a true division, as the kernel's (127 / largest is 127 times largest's reciprocal, rounded twice)
    levels = torch.round(blocks * torch.where(largest > 0, torch.tensor(127.0) / largest, 0))
    return (levels * (largest / 127)).flatten(-2)[..., :k]


# ---------------------------------------------------------------------------------------------
# int8


def int8_module(n: int, k: int, kernel: str | None = None) -> tuple[Int8Linear, torch.Tensor]:
    """An Int8Linear filled the way loading fills it and packed for `kernel` (by default, the device's), and
    its dequantized fp32 weight."""
    q, scales = quantize_int8(random_weight(n, k))
    m = Int8Linear(k, n)
    m.weight, m.scales = q, scales  # what load_state_dict(assign=True) does
    w_ref = q.float() * scales.float()[:, None]  # before packing, which may lay q out anew in place
    if kernel is None:
        quantize.pack_for_device(m, quantize.Int8())
    else:
        m.pack(kernel)
    return m, w_ref


@pytest.mark.parametrize("n,k", [(96, 64), (200, 128)])
@pytest.mark.parametrize("M", [1, 5, 40])  # 40 rows: the prefill path
def test_int8_linear_matches_dequantized_matmul(n, k, M):
    m, w_ref = int8_module(n, k)
    x = torch.randn(1, M, k).bfloat16()  # (B, T, k), as the model calls it
    with torch.no_grad():
        y = m(x)
    assert y.dtype == torch.bfloat16 and y.shape == (1, M, n)
    x_taken = as_the_kernel_takes(x, k, 8) if m.kernel == "cpu-tiles" else x.float()
    assert rel_err(y, F.linear(x_taken, w_ref)) <= BF16_RTOL


INT8_CPU_KERNELS = ["cpu-fused", "cpu"] + (["cpu-tiles"] if cpu_decode.int8_kernel() else [])


@pytest.mark.parametrize("kernel", INT8_CPU_KERNELS)
@pytest.mark.parametrize("n,k,shape", [(96, 64, (1, 1)), (208, 128, (1,))])
def test_int8_linear_compiled_one_row(n, k, shape, kernel):
    """Compiled at one row for CPU decoding, Int8Linear packed "cpu-fused" is a multiply-and-sum that
    inductor fuses, not the aten kernel; packed "cpu", the aten kernel; packed "cpu-tiles", cpu_linear.cpp's."""
    from torch._inductor.compile_fx import compile_fx  # the inductor backend, so we can see its graph

    torch._dynamo.reset()  # each case compiles Int8Linear.forward anew: past the recompile limit otherwise
    m, w_ref = int8_module(n, k, kernel)
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(m, backend=inductor, fullgraph=True)
    x = torch.randn(*shape, k).bfloat16()
    with torch.no_grad():
        y = compiled(x)
    assert y.dtype == torch.bfloat16 and y.shape == (*shape, n)
    taken = (lambda x: as_the_kernel_takes(x, k, 8)) if kernel == "cpu-tiles" else (lambda x: x.float())
    assert rel_err(y, F.linear(taken(x), w_ref)) <= BF16_RTOL
    assert len(graphs) == 1 and ("_weight_int8pack_mm" in graphs[0].code) == (kernel == "cpu")
    assert ("int8_rows" in graphs[0].code) == (kernel == "cpu-tiles")
    if kernel == "cpu-tiles":  # prefill, compiled for any length, takes it too
        prefill = torch.compile(m, backend=inductor, fullgraph=True, dynamic=True)
        for rows in (5, 40):
            x = torch.randn(1, rows, k).bfloat16()
            with torch.no_grad():
                assert rel_err(prefill(x), F.linear(taken(x), w_ref)) <= BF16_RTOL
        assert "int8_rows" in graphs[-1].code


@pytest.mark.skipif(cpu_decode.int8_kernel() is None, reason="cpu_linear.cpp needs AVX2 or AVX-512 BF16 and a compiler")
@pytest.mark.parametrize("n, k", [(48, 64), (112, 576), (16, 32)])  # groups of 3 tiles; 4 and 3; one tile
@torch.no_grad()
def test_the_int8_kernel_multiplies_x_as_rounded_and_a_row_alone_as_in_a_batch(n, k):
    """cpu_linear.cpp's int8_rows over int8_rows_layout's weight (levels -128 to 127): x as it takes it (rounded
    to int8 a block of 32 inputs at a time) times the levels, to fp32's rounding, for 1 to 20 rows (passes of 4
    over each group of tiles; a pass of one row loads the levels its own way) and 150; and each row's numbers the
    same bits alone as in a batch (a request's tokens in the server do not depend on who shares its steps;
    speculation's verify steps reproduce decoding's)."""
    levels = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    tiles = quantize.int8_rows_layout(levels.clone())
    x = torch.randn(20, k).bfloat16()
    y = torch.ops.fastllama.int8_rows(x, tiles)
    assert y.dtype == torch.float32 and y.shape == (20, n)
    exact = as_the_kernel_takes(x, k, 8).double() @ levels.double().t()
    torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-6 * exact.abs().max().item(), check_dtype=False)
    for rows in (1, 3, 4, 5, 9, 17):
        assert torch.equal(torch.ops.fastllama.int8_rows(x[:rows], tiles), y[:rows])
    assert torch.equal(torch.ops.fastllama.int8_rows(x[5:6], tiles), y[5:6])
    many = torch.randn(150, k).bfloat16()
    exact = as_the_kernel_takes(many, k, 8).double() @ levels.double().t()
    torch.testing.assert_close(torch.ops.fastllama.int8_rows(many, tiles), exact, rtol=1e-5,
                               atol=1e-6 * exact.abs().max().item(), check_dtype=False)


@pytest.mark.parametrize("capability,kernel", [("AVX512", "cpu-fused"), ("AVX2", "cpu"), ("DEFAULT", "cpu")])
def test_int8_kernel_follows_the_cpu(monkeypatch, capability, kernel):
    """cpu_linear.cpp's int8 kernel where it is built, for a bf16 model's whole tiles; otherwise the fused int8
    product only where it was measured to beat PyTorch's kernel: AVX-512."""
    cpu = torch.device("cpu")
    whole_tiles = quantize.int8_kernel(cpu, 64, 32, torch.bfloat16)
    assert whole_tiles == ("cpu-tiles" if cpu_decode.int8_kernel() else quantize.int8_kernel(cpu, 8, 32, torch.bfloat16))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    for n, k, dtype in ((8, 32, torch.bfloat16), (64, 33, torch.bfloat16), (64, 32, torch.float32)):  # not tiles
        assert quantize.int8_kernel(cpu, n, k, dtype) == kernel


def test_quantize_int8_error_and_range():
    n, k = 64, 256
    w = random_weight(n, k)
    w[3] = 0  # an all-zero row must not divide by zero
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (n, k)
    assert scales.dtype == torch.bfloat16 and scales.shape == (n,)
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    assert torch.isfinite(scales.float()).all() and (q[3] == 0).all()
    # every nonzero row uses the whole range: its largest |w| lands on +-127
    nonzero = torch.arange(n) != 3
    assert (q[nonzero].abs().amax(1) == 127).all()
    # round to nearest: |w - q*s| <= s/2, where s is the stored (bf16) scale; a scale rounded down
    # by bf16 clips the largest values by at most 127 * (exact scale - stored scale)
    s = scales.float()[:, None]
    exact = w.abs().amax(1, keepdim=True) / 127
    assert ((s - exact).abs() <= 2**-8 * exact)[nonzero].all()  # the step is max|w|/127, rounded to bf16
    bound = s / 2 + 127 * (exact - s).clamp(min=0) + 1e-6 * w.abs().amax(1, keepdim=True)
    assert ((w - q.float() * s).abs() <= bound).all()


# ---------------------------------------------------------------------------------------------
# int4


def int4_cases():
    cases = []
    ours = pytest.mark.skipif(cpu_decode.int4_kernel() is None, reason="cpu_linear.cpp needs AVX2 or AVX-512 and a C++ compiler")
    for kernel in ("cpu", "cpu-tiles", "dequantize"):
        for g in GROUPSIZES:
            # k a multiple of g; k = 576 (SmolLM2's dim: a multiple of 32 and 64, padded for 128, 256);
            # k = 592, a multiple of none. The CPU kernel takes n in multiples of 16 only.
            for n, k in [(96, 2 * g), (64, 576), (200 if kernel == "dequantize" else 112, 592)]:
                cases.append(pytest.param(kernel, g, n, k, id=f"{kernel}-g{g}-n{n}-k{k}",
                                          marks=[ours] if kernel == "cpu-tiles" else []))
    return cases


def int4_module(n: int, k: int, groupsize: int) -> tuple[Int4Linear, torch.Tensor]:
    """An Int4Linear filled as loading fills it (quantized as quantize.Int4.group does: k
    zero-padded to whole groups), and its dequantized fp32 weight (n, k)."""
    m = Int4Linear(k, n, groupsize)
    assert m.padded_in == -(-k // groupsize) * groupsize
    w = F.pad(random_weight(n, k), (0, m.padded_in - k))
    m.weight, m.scales, m.mins = rtn_int4(w, groupsize)
    assert (m.weight.shape, m.scales.shape) == ((n, m.padded_in // 2), (n, m.padded_in // groupsize))
    return m, dequantize_int4(m.weight, m.scales, m.mins)[:, :k]


@pytest.mark.parametrize("kernel,groupsize,n,k", int4_cases())
def test_int4_linear_matches_dequantized_matmul(kernel, groupsize, n, k):
    m, w_ref = int4_module(n, k, groupsize)
    m.pack(kernel)
    for M in (1, 3, 6):  # cpu_linear.cpp: 6 rows in two passes over the weight, of 4 rows and 2
        x = torch.randn(1, M, k).bfloat16()
        with torch.no_grad():
            y = m(x)
        assert y.dtype == torch.bfloat16 and y.shape == (1, M, n)
        x_taken = as_the_kernel_takes(x, m.padded_in, 4) if kernel == "cpu-tiles" else x.float()
        assert rel_err(y, F.linear(x_taken, w_ref)) <= BF16_RTOL, (kernel, groupsize, n, k, M)


@pytest.mark.skipif(cpu_decode.int4_kernel() is None, reason="cpu_linear.cpp needs AVX2 or AVX-512 and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_int4_kernel_of_our_own_keeps_scales_and_mins_exact(dtype):
    """cpu_linear.cpp takes scales and mins in the checkpoint's own dtype (a GGUF's fp16), not rounded to bf16
    as PyTorch's int4 kernels take them: its products are the dequantized weight's to fp32's precision (with
    x as it takes it: rounded to int8 a block of 32 at a time)."""
    n, k, g = 64, 256, 32
    m = Int4Linear(k, n, g, dtype=dtype)
    m.weight.copy_(pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8)))
    m.scales.copy_(torch.rand(n, k // g) / 64 + 1 / 256)  # fp16 scales that bf16 does not hold
    m.mins.copy_(-8 * m.scales.float() + torch.randn(n, k // g) / 1000)
    w_ref = dequantize_int4(m.weight, m.scales, m.mins)
    m.pack("cpu-tiles")
    x = torch.randn(5, k).bfloat16()
    with torch.no_grad():
        y = quantize.int4_matmul(m.kernel, x, m.weight, g, m.scales_and_zeros)
    assert rel_err(y, F.linear(as_the_kernel_takes(x, k, 4), w_ref)) < 1e-5


@pytest.mark.parametrize("kernel", [
    pytest.param("cpu-tiles", marks=pytest.mark.skipif(cpu_decode.int4_kernel() is None,
                                                        reason="cpu_linear.cpp needs AVX2 or AVX-512 and a C++ compiler")),
    "dequantize", "cpu"])
def test_iq4_levels_are_looked_up_by_our_kernel_and_the_weight_rounded_for_others(kernel):
    """An IQ4 linear (a GGUF file's IQ4_NL or IQ4_XS weights, copied): its 4 bits stand for IQ4_LEVELS, times an
    fp16 scale a group. cpu_linear.cpp looks them up, to fp32's precision (x as it takes it); the dequantizing
    path holds them in bf16; a kernel of levels 0 .. 15 gets the weight rounded to them, near."""
    n, k, g = 64, 256, 32
    m = Int4Linear(k, n, g, dtype=torch.float16, iq4=True)
    m.weight.copy_(pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8)))
    m.scales.copy_((torch.rand(n, k // g) + 0.5) / 1000 * torch.where(torch.rand(n, k // g) < 0.2, -1, 1))
    m.mins.zero_()
    w_ref = dequantize_int4(m.weight, m.scales, m.mins, levels=torch.tensor(quantize.IQ4_LEVELS, dtype=torch.int8))
    m.pack(kernel)
    assert (m.levels is not None) == (kernel == "cpu-tiles")
    x = torch.randn(5, k).bfloat16()
    with torch.no_grad():
        y = m(x)
    if kernel == "cpu-tiles":
        y = quantize.int4_matmul(m.kernel, x, m.weight, g, m.scales_and_zeros, m.levels)
        assert rel_err(y, F.linear(as_the_kernel_takes(x, k, 4), w_ref)) < 1e-5
    else:
        assert rel_err(y, F.linear(x.float(), w_ref)) <= (BF16_RTOL if kernel == "dequantize" else 0.15)


@pytest.mark.skipif(cpu_decode.int4_kernel() is None, reason="cpu_linear.cpp needs AVX2 or AVX-512 and a C++ compiler")
def test_the_int4_kernel_of_our_own_gives_a_row_the_same_numbers_alone_and_in_a_batch():
    """Its passes take 1 to 4 rows; each row's sums are added in one order whatever the others, so that a
    prompt decodes to the same tokens alone and in a batch (generate's promise in fp32)."""
    m, _ = int4_module(64, 576, 32)
    m.pack("cpu-tiles")
    x = torch.randn(7, 576).bfloat16()
    with torch.no_grad():
        batch = quantize.int4_matmul(m.kernel, x, m.weight, 32, m.scales_and_zeros)
        for n in range(1, 4):
            assert torch.equal(quantize.int4_matmul(m.kernel, x[:n], m.weight, 32, m.scales_and_zeros), batch[:n])


def test_int4_kernel_choice_packs_any_out_features():
    """The CPU kernel wants n % 16 == 0; other shapes fall back to the dequantizing path."""
    n, k, g = 200, 128, 32
    m, w_ref = int4_module(n, k, g)
    assert quantize.int4_kernel(torch.device("cpu"), n) == "dequantize"
    m.pack(quantize.int4_kernel(torch.device("cpu"), n))
    x = torch.randn(2, k).bfloat16()
    assert rel_err(m(x), F.linear(x.float(), w_ref)) <= BF16_RTOL


# ---------------------------------------------------------------------------------------------
# Layouts


def test_pack_int4_layout_and_round_trip():
    assert pack_int4(torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)).tolist() == \
        [[0x12, 0x34], [0xF0, 0x0F]]
    q = torch.randint(0, 16, (37, 256), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (37, 128)
    assert torch.equal(packed >> 4, q[:, 0::2])  # the high nibble holds the even column
    assert torch.equal(packed & 15, q[:, 1::2])
    unpacked = unpack_int4(packed)
    assert unpacked.dtype == torch.uint8 and torch.equal(unpacked, q)


def test_dequantize_int4_is_level_times_scale_plus_min():
    n, k, g = 8, 128, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales, mins = torch.rand(n, k // g).bfloat16(), torch.randn(n, k // g).bfloat16()
    group = torch.arange(k) // g
    expected = q.float() * scales.float()[:, group] + mins.float()[:, group]
    torch.testing.assert_close(dequantize_int4(pack_int4(q), scales, mins), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("groupsize", GROUPSIZES)
def test_rtn_int4_reproduces_weights_within_half_a_step(groupsize):
    n, k = 48, 512
    w = random_weight(n, k) + torch.randn(n, 1)  # groups off center too: mins matter
    packed, scales, mins = rtn_int4(w, groupsize)
    assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
    assert scales.dtype == mins.dtype == torch.bfloat16 and scales.shape == mins.shape == (n, k // groupsize)
    # the exact (fp32) per-group range, and the bf16 parameters actually stored
    groups = w.reshape(n, -1, groupsize)
    lo, hi = groups.amin(-1), groups.amax(-1)
    exact_scale = (hi - lo) / 15
    s, m = scales.float(), mins.float()
    # 16 levels from each group's min to its max: the stored step and min are those, rounded to bf16
    assert ((s - exact_scale).abs() <= 2**-8 * exact_scale).all() and ((m - lo).abs() <= 2**-8 * lo.abs()).all()
    # within [m, m + 15 s] rounding is to the nearest level (s/2); outside, the levels clip by at most
    # what bf16 rounding moved the ends of the range
    bound = s / 2 + (lo - m).abs() + 15 * (exact_scale - s).abs() + 1e-6 * (lo.abs() + hi.abs())
    err = (dequantize_int4(packed, scales, mins) - w).abs().reshape(n, -1, groupsize)
    assert (err <= bound.unsqueeze(-1)).all()


def test_rtn_int4_fits_take_weights_on_another_grid_nearer():
    """Weights already on a grid of 16 uneven levels (IQ4_NL's, a scale a block of 32): each group's scale
    and min fitted to its levels by least squares (and stored in bf16) leave every group at most as far as
    min-to-max rounding does, and all of them together a good deal nearer."""
    levels = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113.0])
    g = torch.Generator().manual_seed(0)
    n, k = 64, 512
    blocks = levels[torch.randint(0, 16, (n, k // 32, 32), generator=g)] + 20 * torch.randn(n, k // 32, 1, generator=g)
    w = (blocks * (0.1 + torch.rand(n, k // 32, 1, generator=g)) / 1000).reshape(n, k)  # off centre: mins matter

    def errors(fits):  # squared, by group
        return (dequantize_int4(*rtn_int4(w, 32, fits)) - w).square().reshape(n, -1, 32).sum(-1)

    plain, fitted = errors(0), errors(4)
    assert (fitted <= plain).all()
    assert fitted.sum() < 0.8 * plain.sum()


# ---------------------------------------------------------------------------------------------
# End to end on the bundled model


def quantize_bundled(bundled_checkpoint, tmp_path_factory, mode: str, groupsize: int) -> Path:
    """Quantize the bundled model into a fresh directory, which quantize completes with copies of the
    config and tokenizer files, then give the file a neutral name: the scheme must come from its metadata."""
    out_dir = tmp_path_factory.mktemp(f"{mode}-g{groupsize}")
    target = out_dir / f"model_{mode}.g{groupsize}.safetensors"
    assert quantize.quantize(bundled_checkpoint, mode, groupsize, output=target) == target
    assert (out_dir / CONFIG_NAME).is_file() and (out_dir / "tokenizer.json").is_file()
    assert not list(out_dir.glob("*.partial")) and len(list(out_dir.glob("*.safetensors"))) == 1
    neutral = out_dir / "weights.safetensors"
    target.rename(neutral)
    return neutral


@pytest.fixture(scope="module")
def int8_file(bundled_checkpoint, tmp_path_factory):
    return quantize_bundled(bundled_checkpoint, tmp_path_factory, "int8", 32)


@pytest.fixture(scope="module")
def int4_file(bundled_checkpoint, tmp_path_factory):
    return quantize_bundled(bundled_checkpoint, tmp_path_factory, "int4", 32)


@pytest.fixture(scope="module")
def prompt_ids(bundled_checkpoint):
    ids = torch.tensor(get_tokenizer(bundled_checkpoint).encode(PROMPT))
    assert 10 <= len(ids) <= 20
    return ids


def logits(model, ids: torch.Tensor, token: torch.Tensor | None = None):
    """fp32 logits of the prompt's last position (prefill: T rows) and of one decode step (one row)
    that feeds `token` (default: the greedy one), and that token."""
    T = len(ids)
    model.setup_caches(1, 64)
    with torch.no_grad():
        last = model(ids[None], torch.arange(T))[0, -1].float()
        token = last.argmax() if token is None else token
        step = model(token.view(1, 1), torch.tensor([T]))[0, -1].float()
    return last, step, token


@pytest.fixture(scope="module")
def reference(bundled_checkpoint, prompt_ids):
    """What the bf16 model gives (the model itself is not kept)."""
    return logits(load_model(bundled_checkpoint, "cpu", "bf16"), prompt_ids)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a, b, dim=0).item()


# The "quantization" metadata quantize.py writes (int4: at groupsize 32), word for word as older checkpoints carry
# it: they must keep loading
METADATA = {"int8": '{"mode": "int8", "method": "int8", "head": "int8"}',
            "int4": '{"mode": "int4", "groupsize": 32, "method": "int4", "head": "int8"}'}


def check_file(path: Path, mode: str, groupsize: int):
    """The scheme is in the metadata; the tensors are stored in its layout."""
    c = load_config(path)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["quantization"] == METADATA[mode]
        scheme = json.loads(f.metadata()["quantization"])
        assert scheme["mode"] == mode
        head, wo = f.get_slice("output.weight"), f.get_slice("layers.0.attention.wo.weight")
        assert head.get_dtype() == "I8" and head.get_shape() == [c.vocab_size, c.dim]  # int8 in every mode
        assert f.get_slice("output.scales").get_shape() == [c.vocab_size]
        assert f.get_slice("tok_embeddings.weight").get_dtype() == "BF16"
        k = c.n_head * c.head_dim
        if mode == "int8":
            assert wo.get_dtype() == "I8" and wo.get_shape() == [c.dim, k]
            assert "layers.0.attention.wo.mins" not in f.keys()
        else:
            assert scheme["groupsize"] == groupsize
            padded = -(-k // groupsize) * groupsize
            assert wo.get_dtype() == "U8" and wo.get_shape() == [c.dim, padded // 2]
            assert f.get_slice("layers.0.attention.wo.mins").get_shape() == [c.dim, padded // groupsize]


def check_logits(model, prompt_ids, reference):
    ref_last, ref_step, ref_token = reference
    last, step, _ = logits(model, prompt_ids, ref_token)
    cos_last, cos_step = cosine(last, ref_last), cosine(step, ref_step)
    assert cos_last > 0.99 and cos_step > 0.99, (cos_last, cos_step)
    assert last.argmax() == ref_token  # " Rome", by 2.4 logits over " Florence"


def test_int8_checkpoint_end_to_end(int8_file, prompt_ids, reference):
    check_file(int8_file, "int8", 32)
    model = load_model(int8_file, "cpu", "bf16")
    linears = [m for name, m in model.named_modules() if name.endswith(("wqkv", "wo", "w13", "w2", "output"))]
    assert len(linears) == 4 * model.config.n_layer + 1 and all(type(m) is Int8Linear for m in linears)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    check_logits(model, prompt_ids, reference)  # measured cosines 0.9996 (prefill) and 0.9974 (step)


def test_int4_checkpoint_end_to_end(int4_file, prompt_ids, reference):
    check_file(int4_file, "int4", 32)
    model = load_model(int4_file, "cpu", "bf16")
    assert type(model.output) is Int8Linear  # the head is int8 in every mode
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 4 * model.config.n_layer
    assert all(m.groupsize == 32 and m.kernel in ("cpu", "cpu-tiles") for m in int4)  # packed for a CPU kernel
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    # measured 0.9999 and 0.9994, closer than int8: the bundled weights come from a Q4_1 GGUF
    # (asymmetric 4-bit in groups of 32), which int4 g32 nearly reproduces
    check_logits(model, prompt_ids, reference)


@pytest.mark.parametrize("which,metadata", [
    ("int8_file", METADATA["int8"]),
    ("int8_file", '{"mode": "int8", "groupsize": 32, "method": "int8", "head": "int8"}'),  # quantize.py's first files
    ("int4_file", '{"mode": "int4", "groupsize": 32, "method": "int4-gptq", "head": "int8"}'),  # GPTQ: int4's layout
])
def test_a_checkpoint_with_older_metadata_loads(which, metadata, request, tmp_path, prompt_ids):
    """One of our files under metadata as quantize.py has written it loads into the same model, and what
    this version would write for its scheme says nothing else."""
    path = request.getfixturevalue(which)
    tensors, file_metadata = read_safetensors(path)
    older = tmp_path / "weights.safetensors"
    write_safetensors(older, [single(name, t.dtype, t.shape, lambda t=t: t) for name, t in tensors.items()],
                      {**file_metadata, "quantization": metadata})
    copy_companions(path, tmp_path)
    assert quantize.read_scheme(read_metadata(older)).metadata().items() <= json.loads(metadata).items()
    ours, theirs = load_model(path, "cpu", "bf16"), load_model(older, "cpu", "bf16")
    assert [type(m) for m in theirs.modules()] == [type(m) for m in ours.modules()]
    assert torch.equal(logits(theirs, prompt_ids)[0], logits(ours, prompt_ids)[0])


# ---------------------------------------------------------------------------------------------
# A new scheme is one class and an entry in quantize.SCHEMES: this one, the test's own, int8 with one
# scale a weight


class TensorInt8(quantize.Scheme):
    """int8 with one scale for the whole weight, in a module of its own (no kernel to choose)."""

    method = layout = "int8-tensor"

    class Linear(torch.nn.Module):
        def __init__(self, in_features: int, out_features: int, device=None):
            super().__init__()
            self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
            self.register_buffer("scale", torch.empty((), dtype=torch.bfloat16, device=device))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)

    def group(self, name: str, read, shape: tuple):
        base = name.removesuffix(".weight")

        def make():
            w = read().float()
            scale = (w.abs().max() / 127).bfloat16()
            return torch.round(w / scale.float()).clamp(-127, 127).to(torch.int8), scale

        return [(f"{base}.weight", torch.int8, shape), (f"{base}.scale", torch.bfloat16, ())], make

    def module(self, old: torch.nn.Linear, name: str) -> torch.nn.Module:
        return self.Linear(old.in_features, old.out_features, old.weight.device)


@pytest.fixture
def tiny_checkpoint(tmp_path) -> Path:
    """A 2-layer model with random weights, as a checkpoint in fp32: quantizing the file and quantizing the
    model loaded from it in fp32 start from the same numbers."""
    config = ModelArgs(vocab_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                       block_size=64)
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config.__dict__))
    torch.manual_seed(0)
    state = Transformer(config).state_dict()
    write_safetensors(tmp_path / CHECKPOINT_NAME, [single(name, t.dtype, t.shape, lambda t=t: t)
                                                   for name, t in state.items()])
    return tmp_path / CHECKPOINT_NAME


def decode_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits of a prefill of tokens[:4], then of a decode step for each token after it."""
    model.setup_caches(1, 64)
    with torch.no_grad():
        steps = [model(tokens[None, :4], torch.arange(4))[0, -1]]
        steps += [model(tokens[p: p + 1][None], torch.tensor([p]))[0, -1] for p in range(4, len(tokens))]
    return torch.stack(steps).float()


def test_a_new_scheme_is_a_class_and_an_entry(monkeypatch, tiny_checkpoint):
    """Registered, and nothing else: quantize() writes it, load_model() loads it into its modules and
    decodes as the unquantized model does, and the benchmark quantizes a model to it in memory."""
    monkeypatch.setitem(quantize.SCHEMES, "int8-tensor", TensorInt8)
    path = quantize.quantize(tiny_checkpoint, "int8-tensor")
    assert read_metadata(path)["quantization"] == '{"mode": "int8-tensor", "method": "int8-tensor", "head": "int8"}'
    reference, quantized = load_model(tiny_checkpoint, "cpu", "fp32"), load_model(path, "cpu", "fp32")
    linears = {name: type(m) for name, m in quantized.named_modules()
               if name.endswith(("wqkv", "wo", "w13", "w2", "output"))}
    assert linears.pop("output") is Int8Linear and list(linears.values()) == [TensorInt8.Linear] * 8

    tokens = generate(reference, torch.tensor([1, 2, 3, 4]), 8)  # greedy
    ours, theirs = decode_logits(quantized, tokens), decode_logits(reference, tokens)
    assert (F.cosine_similarity(ours, theirs, dim=-1) > 0.999).all()
    assert torch.equal(ours.argmax(-1)[:-1], tokens[4:])

    spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    in_memory = benchmark.quantized_copy(reference, reference.config, "int8-tensor", 32)
    assert {name: type(m) for name, m in in_memory.named_modules() if name in linears} == linears
    for name in [*linears, "output"]:  # the same quantized tensors as the file's
        for key, t in in_memory.get_submodule(name).state_dict().items():
            assert torch.equal(t.float(), quantized.get_submodule(name).state_dict()[key].float()), (name, key)


# ---------------------------------------------------------------------------------------------
# Bad input: a UserError that says what to do, and no file (not even a partial one) left behind


def test_unknown_mode(bundled_checkpoint, tmp_path):
    with pytest.raises(UserError, match=r"unknown mode 'int3'.*int8, int4"):
        quantize.quantize(bundled_checkpoint, "int3", output=tmp_path / "out.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_groupsize_not_supported(bundled_checkpoint, tmp_path):
    with pytest.raises(UserError, match=r"groupsize 48 .*\(32, 64, 128, 256\)"):
        quantize.quantize(bundled_checkpoint, "int4", 48, output=tmp_path / "out.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_already_quantized(int8_file, tmp_path):
    for mode in ("int4", "int4-gguf"):
        with pytest.raises(UserError, match=r"already quantized.*unquantized checkpoint it came from"):
            quantize.quantize(int8_file, mode, 32, output=tmp_path / "out.safetensors")
    assert list(tmp_path.iterdir()) == [] and not list(int8_file.parent.glob("*.partial"))


def test_int4_gguf_keeps_groups_of_32(bundled_checkpoint, tmp_path):
    with pytest.raises(UserError, match="int4-gguf keeps the GGUF's Q4 and IQ4 groups of 32: leave out --groupsize"):
        quantize.quantize(bundled_checkpoint, "int4-gguf", 64, output=tmp_path / "out.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_output_goes_where_asked_but_never_over_the_checkpoint(bundled_checkpoint, tmp_path):
    """A folder gets the default name in it; the checkpoint itself (here through a link, which a
    mistaken write would replace rather than the bundled file) and a missing folder are refused."""
    (tmp_path / "ck").mkdir()
    checkpoint = tmp_path / "ck" / bundled_checkpoint.name
    checkpoint.symlink_to(bundled_checkpoint)
    assert quantize.output_file(tmp_path, checkpoint, "int8", 32) == tmp_path / "fastllama_int8.safetensors"
    assert quantize.output_file(None, checkpoint, "int4", 64) == checkpoint.with_name("fastllama_int4.g64.safetensors")
    with pytest.raises(UserError, match="is the checkpoint being quantized: name another file"):
        quantize.quantize(checkpoint, "int8", output=checkpoint)
    with pytest.raises(UserError, match="its folder does not exist"):
        quantize.quantize(checkpoint, "int8", output=tmp_path / "missing" / "out.safetensors")
    assert checkpoint.is_symlink() and sorted(p.name for p in tmp_path.rglob("*")) == ["ck", checkpoint.name]


def test_missing_checkpoint(tmp_path):
    with pytest.raises(UserError, match=r"no checkpoint at .*missing\.safetensors"):
        quantize.quantize(tmp_path / "missing.safetensors", "int8")
    with pytest.raises(UserError, match=r"no checkpoint at"):
        quantize.quantize(tmp_path / "missing.safetensors", "int4", 32, output=tmp_path / "out.safetensors")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Peak memory of loading a quantized checkpoint

PEAK_RSS = """
import sys
import torch
from fastllama import generate

def peak_kb():  # this process's peak RSS (VmHWM); ru_maxrss would carry over the parent's peak across exec
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])

# The first meta-device op imports PyTorch's meta kernels (~70 MB of Python code, whatever the model's
# size): done before the baseline, so that what is measured is the model's data.
torch.empty(1, device="meta").normal_()
before = peak_kb()
model = generate.load_model(sys.argv[1], "cpu", "bf16")
model.setup_caches(1, 256)
print(before, peak_kb())
"""


@pytest.mark.parametrize("which", ["int8_file", "int4_file"])
def test_quantized_load_peak_memory(which, request):
    path = request.getfixturevalue(which)
    c = load_config(path)
    kv_bytes = 2 * c.n_layer * c.n_local_heads * 256 * c.head_dim * 2  # k and v, bf16
    run = subprocess.run([sys.executable, "-c", PEAK_RSS, str(path)], cwd=REPO, capture_output=True, text=True,
                         timeout=180)
    if run.returncode != 0:  # pytest.fail, not assert: only the bound below is the expected failure
        pytest.fail(f"loading in a subprocess failed:\n{run.stderr}")
    before, after = (int(kb) * 1024 for kb in run.stdout.split()[-2:])
    delta, size = after - before, os.path.getsize(path)
    if not (before > 100 * 2**20 and delta > size / 2):  # a real measurement: torch imported, weights read
        pytest.fail(f"implausible measurement: {before} bytes before, {delta} more after loading")
    print(f"{which}: peak RSS delta {delta / 2**20:.1f} MiB, file {size / 2**20:.1f} MiB "
          f"({delta / size:.2f}x), KV cache {kv_bytes / 2**20:.1f} MiB")
    assert delta <= 1.15 * size + kv_bytes, (delta, size, kv_bytes)


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_tensors_read_together_are_views_of_one_allocation_with_the_values_read_apart(tmp_path):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3, 5), "b": torch.randint(0, 255, (7, 4), dtype=torch.uint8),
               "c": torch.randn(6, 4).bfloat16(), "d": torch.randn(2, 3).bfloat16()}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, [single(n, t.dtype, t.shape, lambda t=t: t) for n, t in tensors.items()])
    select = {"a": (0, [(0, 1), (2, 3)]), "c": (1, [(1, 3)])}.get  # rows of a, columns of c (tp.py's pieces)
    apart, _ = read_safetensors(path, "cpu", torch.bfloat16, lambda name, shape: select(name))
    together, _ = read_safetensors(path, "cpu", torch.bfloat16, lambda name, shape: select(name),
                                   together=lambda name: name != "b")
    assert set(together) == set(apart) == set(tensors)
    for name in tensors:
        assert together[name].dtype == apart[name].dtype and torch.equal(together[name], apart[name]), name
        assert together[name].data_ptr() % 64 == 0, name  # as CPU kernels need them
    assert together["a"].dtype == torch.bfloat16 and together["c"].shape == (6, 2)
    assert len(storages(together[n] for n in "acd")) == 1 and storages([together["b"]]).isdisjoint(
        storages([together["a"]]))
    on_meta, _ = read_safetensors(path, "meta", together=lambda name: True)  # only CPU tensors share
    assert all(t.device.type == "meta" for t in on_meta.values())


@pytest.mark.parametrize("which", ["bundled_checkpoint", "int8_file", "int4_file"])
def test_loading_on_cpu_puts_the_weights_packing_keeps_in_one_allocation(which, request):
    sd = load_model(request.getfixturevalue(which), "cpu", "bf16").state_dict()
    new = [t for n, t in sd.items() if n.endswith(".scales_and_zeros")]  # made by packing int4
    kept = {t.data_ptr(): t for n, t in sd.items() if not n.endswith(".scales_and_zeros")}.values()  # tied once
    assert len(storages(kept)) == 1 and len(storages(new)) == len(new)
    (storage,) = {t.untyped_storage().nbytes() for t in kept}
    assert storage == sum(-(-t.nbytes // 64) * 64 for t in kept)  # nothing else: no int4 scales and mins left in it


def test_weight_bytes_per_token(bundled_checkpoint, int8_file):
    """What a decode step reads: the tied table once as the bf16 head; once the head is quantized
    apart, the int8 head and not the bf16 table, of which a step reads one row."""
    bf16, int8 = load_model(bundled_checkpoint, "cpu", "bf16"), load_model(int8_file, "cpu", "bf16")
    assert weight_bytes_per_token(bf16) == sum(p.nbytes for p in bf16.parameters())
    table = int8.tok_embeddings.weight.nbytes
    assert weight_bytes_per_token(int8) == sum(t.nbytes for t in int8.state_dict().values()) - table
