"""What quantization costs in accuracy, on the bundled model and held-out text; the lossless GGUF import."""

import pytest
import torch

from fastllama import quantize
from fastllama.checkpoint import read_safetensors
from fastllama.eval import perplexity
from fastllama.generate import get_tokenizer, load_model


@pytest.fixture(scope="module")
def workdir(quantized_dir):
    return quantized_dir


@pytest.fixture(scope="module")
def held_out_tokens(bundled_checkpoint):
    return torch.tensor(get_tokenizer(bundled_checkpoint).encode(quantize.python_docs_text("held-out"))[:8192])


def test_gguf_int4_import_is_lossless(bundled_checkpoint, workdir):
    path = quantize.quantize(bundled_checkpoint, "int4-gguf", output=workdir / "gguf.safetensors")
    ours, metadata = read_safetensors(path)
    reference, _ = read_safetensors(bundled_checkpoint)  # the GGUF's own dequantization, in fp32
    # the metadata as this import has always written it
    assert metadata["quantization"] == '{"mode": "int4", "groupsize": 32, "method": "gguf-q4_1", "head": "int8"}'
    assert type(quantize.read_scheme(metadata)) is quantize.Int4GGUF
    linears = [name.removesuffix(".mins") for name in ours if name.endswith(".mins")]
    assert len(linears) == 4 * 30
    for name in linears:
        w = quantize.dequantize_int4(ours[f"{name}.weight"], ours[f"{name}.scales"], ours[f"{name}.mins"])
        assert torch.equal(w, reference[f"{name}.weight"]), name


def test_perplexity_cost_of_each_scheme(bundled_checkpoint, workdir, held_out_tokens, int4_checkpoint):
    def ppl(path, n_tokens=8192):  # 16 windows: 4 were too few to tell a 1% difference
        # fp32 activations: bf16 GEMMs are several times slower on CPUs without AVX-512 bf16
        return perplexity(load_model(path, "cpu", "fp32"), held_out_tokens[:n_tokens], seq_len=512)

    base = ppl(bundled_checkpoint)
    int8 = ppl(quantize.quantize(bundled_checkpoint, "int8", output=workdir / "int8.safetensors"))
    int4 = ppl(int4_checkpoint)
    assert int8 <= 1.01 * base
    assert int4 <= 1.08 * base
    # at groupsize 128 round-to-nearest loses much more, and GPTQ's error compensation wins part of it back
    rtn = ppl(quantize.quantize(bundled_checkpoint, "int4", 128, output=workdir / "rtn128.safetensors"), 2048)
    gptq = ppl(quantize.quantize(bundled_checkpoint, "int4-gptq", 128, output=workdir / "gptq128.safetensors",
                                 calibration_samples=12, calibration_seq_len=256), 2048)  # 8 a batch, then 4
    assert gptq < rtn
    print(f"perplexity bf16 {base:.3f} int8 {int8:.3f} int4.g32 {int4:.3f} int4.g128 {rtn:.3f} gptq.g128 {gptq:.3f}")


def test_gptq_rejects_short_or_missing_calibration(bundled_checkpoint, workdir, tmp_path):
    with pytest.raises(quantize.UserError, match="does not exist"):
        quantize.quantize(bundled_checkpoint, "int4-gptq", 64, output=workdir / "x.safetensors",
                          calibration_file=tmp_path / "missing.txt")
    (tmp_path / "short.txt").write_text("Too short to calibrate anything.")
    with pytest.raises(quantize.UserError, match="GPTQ needs"):
        quantize.quantize(bundled_checkpoint, "int4-gptq", 64, output=workdir / "x.safetensors",
                          calibration_file=tmp_path / "short.txt")
    with pytest.raises(quantize.UserError, match="GPTQ needs at least one calibration sample"):
        quantize.quantize(bundled_checkpoint, "int4-gptq", 64, output=workdir / "x.safetensors", calibration_samples=0)
    assert not list(workdir.glob("x.safetensors*"))


def test_gptq_beats_round_to_nearest_on_its_objective():
    """On one matrix: GPTQ's output error on the calibration inputs is below plain rounding's."""
    w = torch.randn(64, 256)
    x = torch.randn(2048, 256) @ torch.randn(256, 256) / 16  # correlated inputs, as in a real layer
    rtn = quantize.dequantize_int4(*quantize.rtn_int4(w, 64))
    gptq = quantize.dequantize_int4(*quantize.gptq_int4(w, x.T @ x, 64))
    error = lambda q: ((x @ (q - w).T) ** 2).mean()  # noqa: E731
    assert error(gptq) < 0.8 * error(rtn)
