"""Hugging Face conversion: what is not implemented is refused with one line and leaves nothing
behind; what is implemented converts to the same logits; source files are never touched."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file

from fastllama.checkpoint import CHECKPOINT_NAME, CONFIG_NAME, resolve_checkpoint, single, write_safetensors
from fastllama.convert import SUPPORTED, config_from_hf, convert_hf_checkpoint
from fastllama.errors import UserError
from fastllama.generate import load_model

transformers = pytest.importorskip("transformers")

# small enough that building, saving and converting takes milliseconds
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def tiny(config_name: str, model_name: str, **overrides):
    """A tiny random-weight HF model, skipping the test where this transformers lacks the classes."""
    config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}/{model_name}")
    torch.manual_seed(0)
    return model_cls(config_cls(**{**TINY, **overrides})).eval()


def tiny_llama(**overrides):
    return tiny("LlamaConfig", "LlamaForCausalLM", **overrides)


def digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def assert_refused(directory, match: str) -> str:
    """convert_hf_checkpoint raises a one-line UserError matching `match`, and writes nothing."""
    before = digests(directory)
    with pytest.raises(UserError, match=match) as info:
        convert_hf_checkpoint(directory)
    message = str(info.value)
    assert "\n" not in message, message
    assert not (directory / CHECKPOINT_NAME).exists()
    assert not (directory / CONFIG_NAME).exists()
    assert not list(directory.glob("*.partial"))
    assert digests(directory) == before  # nothing added, removed or rewritten
    return message


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# 1. architectures that are not implemented


REFUSED = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16), "GemmaForCausalLM"),
    "phi": ("PhiConfig", "PhiForCausalLM", {}, "PhiForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_attention_heads=4), "GPTNeoXForCausalLM"),
}


@pytest.mark.parametrize("family", REFUSED)
def test_unsupported_architecture_is_refused(family, tmp_path):
    config_name, model_name, overrides, expected = REFUSED[family]
    hf = tiny(config_name, model_name, **overrides)
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [model_name]
    message = assert_refused(tmp_path / "hf", expected)
    assert "supported" in message and all(a in message for a in SUPPORTED.values())


# ---------------------------------------------------------------------------------------------
# 2. Mistral without a sliding window is a Llama


def test_mistral_without_window_matches_hf(tmp_path):
    hf = tiny("MistralConfig", "MistralForCausalLM", sliding_window=None, head_dim=16)
    hf.save_pretrained(tmp_path / "hf")
    path = convert_hf_checkpoint(tmp_path / "hf")
    assert path == tmp_path / "hf" / CHECKPOINT_NAME
    model = load_model(path, "cpu", "fp32")
    assert model.config.n_local_heads == 2 and model.config.n_layer == 2
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.setup_caches(2, 40)
        ours = model(ids, torch.arange(40))
        ref = hf(ids).logits
    assert ours.shape == ref.shape
    assert relative_error(ours, ref) <= 1e-4


def test_mistral_window_at_least_the_context_converts():
    """A window as long as the context never acts: the model converts as one without a window."""
    config = tiny("MistralConfig", "MistralForCausalLM", sliding_window=TINY["max_position_embeddings"]
                  ).config.to_dict()
    args = config_from_hf(config)
    assert args.block_size == TINY["max_position_embeddings"]
    assert (args.sliding_window, args.sliding_layers) == (None, None)


def test_mistral_window_acts_whatever_use_sliding_window_says(tmp_path):
    """Mistral's modeling code applies sliding_window whenever it is set (unlike Qwen's)."""
    config = tiny("MistralConfig", "MistralForCausalLM", sliding_window=32, use_sliding_window=False,
                  head_dim=16).config.to_dict()
    assert config["use_sliding_window"] is False
    args = config_from_hf(config)
    assert args.sliding_window == 32 and args.sliding_layers == [0, 1]


# ---------------------------------------------------------------------------------------------
# 3. a source tensor that would be left out


def test_unmapped_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_llama().save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    extra = "model.layers.0.self_attn.q_norm.weight"
    tensors[extra] = torch.ones(16)
    save_file(tensors, weights, metadata={"format": "pt"})
    message = assert_refused(tmp_path / "hf", "have no place")
    assert repr(extra) in message


@pytest.mark.parametrize("extra, values, said", [
    ("output_norm.bias", [0.0] * 8, "would leave out 1 of the tensors of .*model.gguf \\(e.g. 'output_norm.bias'\\)"),
    ("rope_freqs.weight", [1.0, 3.0], "model.gguf: its rope_freqs.weight are not Llama 3.1's RoPE scaling"),
    ("rope_freqs.weight", [1.0, 1.0, 1.0], "3 values, up to 1\\) are not a RoPE scaling of its 2 frequencies")])
def test_a_gguf_tensor_the_import_would_leave_out_or_misread_is_refused(tmp_path, extra, values, said):
    """A tensor with no place in the model (an import without it would compute another model), and RoPE
    factors (rope_freqs) that are not Llama 3.1's scaling: refused, nothing written."""
    gguf = pytest.importorskip("gguf")
    from fastllama.convert import import_gguf

    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    for key, value in {"context_length": 64, "block_count": 1, "embedding_length": 8, "feed_forward_length": 16,
                       "attention.head_count": 2, "attention.head_count_kv": 1}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(["a", "b", "c", "d"])
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.add_tensor(extra, torch.tensor(values).numpy())
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with pytest.raises(UserError, match=said):
        import_gguf(tmp_path / "model.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# 4. the source files are only read


def test_a_hf_file_without_metadata_is_not_taken_for_ours(tmp_path):
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")  # no __metadata__ at all
    with pytest.raises(UserError, match="convert its directory"):
        resolve_checkpoint(tmp_path / "model.safetensors")
    write_safetensors(tmp_path / CHECKPOINT_NAME, [single("w", torch.float32, (2,), lambda: torch.zeros(2))])
    assert resolve_checkpoint(tmp_path / "model.safetensors") == tmp_path / CHECKPOINT_NAME
    save_file({"w": torch.zeros(2)}, tmp_path / CHECKPOINT_NAME)  # our file's name, not our format
    with pytest.raises(UserError, match="convert its directory"):
        resolve_checkpoint(tmp_path)


def test_conversion_never_touches_source_files(tmp_path):
    from fastllama import quantize

    hf = tiny_llama()
    directory = tmp_path / "hf"
    hf.save_pretrained(directory)  # a single model.safetensors
    source = digests(directory)
    assert "model.safetensors" in source and "config.json" in source

    with pytest.raises(UserError, match="convert its directory"):
        resolve_checkpoint(directory / "model.safetensors")
    path = convert_hf_checkpoint(directory)
    assert resolve_checkpoint(directory / "model.safetensors") == path  # the HF file, once converted, means ours
    after = digests(directory)
    assert path == directory / CHECKPOINT_NAME
    assert set(after) == set(source) | {CHECKPOINT_NAME, CONFIG_NAME}
    assert {k: after[k] for k in source} == source
    first = after

    # our own files beside the HF ones (told by their metadata) are not read as HF shards
    assert convert_hf_checkpoint(directory) == path
    assert digests(directory) == first

    quantized = quantize.quantize(path, "int8")
    assert quantized.parent == directory and quantized.exists()
    assert convert_hf_checkpoint(directory) == path
    final = digests(directory)
    assert set(final) == set(first) | {quantized.name}
    assert {k: final[k] for k in first} == first

    model = load_model(path, "cpu", "fp32")  # and what was converted is still the HF model
    ids = torch.randint(0, TINY["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.setup_caches(1, 16)
        assert relative_error(model(ids, torch.arange(16)), hf(ids).logits) <= 1e-4


# ---------------------------------------------------------------------------------------------
# 5. config settings that change the math


MATH_CHANGES = {
    "attention_bias": (dict(attention_bias=True), "biases"),
    "mlp_bias": (dict(mlp_bias=True), "biases"),
    "gelu": (dict(hidden_act="gelu"), "activation 'gelu'"),
    "yarn_rope_scaling": (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "rope_scaling"),
}


@pytest.mark.parametrize("case", MATH_CHANGES)
def test_config_that_changes_the_math_is_refused(case, tmp_path):
    overrides, expected = MATH_CHANGES[case]
    tiny_llama(**overrides).save_pretrained(tmp_path / "hf")
    message = assert_refused(tmp_path / "hf", expected)
    assert "LlamaForCausalLM" in message or case == "yarn_rope_scaling"


# ---------------------------------------------------------------------------------------------
# 3. what a folder of downloads can hold: shards of two shardings, a missing shard, the old .bin format


def converted_logits(directory) -> torch.Tensor:
    model = load_model(convert_hf_checkpoint(directory), "cpu", "fp32")
    ids = torch.arange(24)[None] % TINY["vocab_size"]
    with torch.no_grad():
        model.setup_caches(1, 24)
        return model(ids, torch.arange(24))


def hf_logits(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.arange(24)[None] % TINY["vocab_size"]).logits


def test_the_index_says_which_shards_to_read(tmp_path):
    """A repository sharded anew and downloaded again into the same folder keeps the old shards beside
    the new ones: the index names the files to read. Without an index, a tensor in two files is refused."""
    old, new = tiny_llama(), tiny_llama(rms_norm_eps=1e-5)
    for p in new.parameters():
        p.data.add_(0.5)  # other weights, so that reading the old shards would show
    old.save_pretrained(tmp_path / "old", max_shard_size="40KB")
    new.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    new_shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    old_shards = sorted(p.name for p in (tmp_path / "old").glob("model-*.safetensors"))
    assert len(old_shards) > len(new_shards) > 1 and not set(old_shards) & set(new_shards)
    for name in old_shards:  # the old sharding's files, left behind
        (tmp_path / "hf" / name).write_bytes((tmp_path / "old" / name).read_bytes())
    assert relative_error(converted_logits(tmp_path / "hf"), hf_logits(new)) <= 1e-4

    missing = tmp_path / "hf" / new_shards[-1]
    missing.rename(tmp_path / new_shards[-1])
    (tmp_path / "hf" / CHECKPOINT_NAME).unlink()
    (tmp_path / "hf" / CONFIG_NAME).unlink()
    assert_refused(tmp_path / "hf", f"lacks {new_shards[-1]}, which its model.safetensors.index.json names .*"
                                    f"run scripts/download.py again")
    (tmp_path / new_shards[-1]).rename(missing)
    (tmp_path / "hf" / "model.safetensors.index.json").unlink()
    assert_refused(tmp_path / "hf", r"is in two weight files of .*: remove the stale copy")


def test_a_bin_file_in_the_format_before_zip_converts(tmp_path):
    hf = tiny_llama()
    (tmp_path / "hf").mkdir()
    hf.config.save_pretrained(tmp_path / "hf")
    torch.save(hf.state_dict(), tmp_path / "hf" / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert relative_error(converted_logits(tmp_path / "hf"), hf_logits(hf)) <= 1e-4


@pytest.mark.parametrize("content, match", [
    ("[]", "holds a JSON list, not an object: download it again"),
    (json.dumps({"architectures": ["LlamaForCausalLM"]}), "config.json names no model_type"),
])
def test_a_config_json_without_the_fields_is_one_line(content, match, tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(content)
    assert_refused(tmp_path, match)
