import pytest
import torch

from checkpoint import bundled_gguf, default_checkpoint
from generate import load_model


@pytest.fixture(scope="session")
def bundled_checkpoint():
    """The bundled SmolLM2-135M-Instruct in our format (converted from its GGUF on first use)."""
    return default_checkpoint()


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
