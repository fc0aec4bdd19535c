import pytest
import torch

import convert
from convert import bundled_gguf
from generate import load_model


@pytest.fixture(scope="session")
def bundled_checkpoint():
    """The bundled SmolLM2-135M-Instruct in our format (converted from its GGUF on first use)."""
    return convert.bundled_checkpoint()


@pytest.fixture(scope="session")
def model_fp32(bundled_checkpoint):
    return load_model(bundled_checkpoint, "cpu", "fp32")


@pytest.fixture(scope="session")
def hf_model():
    """The reference: HF transformers' LlamaForCausalLM loaded from the same GGUF file."""
    transformers = pytest.importorskip("transformers")
    gguf = bundled_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    gguf = bundled_gguf()
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def quantized_dir(tmp_path_factory, bundled_checkpoint):
    """A directory with the bundled model's config and tokenizer, for quantized checkpoints."""
    import shutil

    from checkpoint import CONFIG_NAME

    directory = tmp_path_factory.mktemp("quantized")
    for name in (CONFIG_NAME, "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_checkpoint.parent / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def int4_checkpoint(bundled_checkpoint, quantized_dir):
    """The bundled model quantized to int4, groupsize 32 (round to nearest)."""
    import quantize

    return quantize.quantize(bundled_checkpoint, "int4", 32, output=quantized_dir / "int4.safetensors")
