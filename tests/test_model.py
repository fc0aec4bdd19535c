"""Our model against HF transformers on the same weights: the bundled GGUF and tiny HF checkpoints."""

import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastllama.checkpoint import CHECKPOINT_NAME, read_metadata, single, write_atomically, write_safetensors
from fastllama.convert import convert_hf_checkpoint
from fastllama.errors import UserError
from fastllama.generate import generate, get_tokenizer, load_model
from fastllama.model import ModelArgs, Transformer
from shapes import SHAPES, shape

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Water boils at a temperature of 100 degrees",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def assert_logits_match(model, hf, ids: torch.Tensor, decode_steps: int = 3, tol: float = 1e-4):
    """Prefill, then a few single-token decode steps, each against HF's full forward."""
    B, T = ids.shape
    model.setup_caches(B, T + decode_steps)
    ours = model(ids, torch.arange(T))
    assert relative_error(ours, hf(ids).logits) <= tol
    for step in range(decode_steps):
        nxt = ours[:, -1:].argmax(-1)
        ids = torch.cat([ids, nxt], dim=1)
        ours = model(nxt, torch.tensor([T + step]))
        assert relative_error(ours[:, -1], hf(ids).logits[:, -1]) <= tol


def test_bundled_model_logits_match_hf(model_fp32, hf_model, bundled_checkpoint):
    tokenizer = get_tokenizer(bundled_checkpoint)
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        assert_logits_match(model_fp32, hf_model, ids)
    chat = torch.tensor([tokenizer.encode_prompt("Tell me about Paris", chat=True)])
    assert_logits_match(model_fp32, hf_model, chat)


def test_bundled_model_greedy_tokens_match_hf(model_fp32, hf_model, bundled_checkpoint):
    tokenizer = get_tokenizer(bundled_checkpoint)
    for prompt in PROMPTS[1:]:  # prompts whose greedy continuation runs past 32 tokens
        ids = torch.tensor(tokenizer.encode(prompt))
        ours = generate(model_fp32, ids, 32, temperature=0, stop_ids=tokenizer.stop_ids)
        ref = hf_model.generate(ids[None], max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.eos_id)[0]
        assert len(ours) == len(ids) + 32
        assert ours.tolist() == ref.tolist()


def test_bundled_tokenizer_matches_hf(bundled_checkpoint, hf_tokenizer):
    tokenizer = get_tokenizer(bundled_checkpoint)
    for text in PROMPTS + ["Prices rose 12.5% in 2024 — naïve café, 日本語 😀", "  spaces\n\ttabs  "]:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "Tell me about Paris"}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.encode_dialog(messages) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.stop_ids == [hf_tokenizer.convert_tokens_to_ids("<|im_end|>")]


# ---------------------------------------------------------------------------------------------
# Tiny random-weight HF checkpoints, converted with convert_hf_checkpoint


def tiny_hf_model(**overrides):
    config = transformers.LlamaConfig(**{
        **dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
               num_key_value_heads=8, max_position_embeddings=512, rms_norm_eps=1e-6), **overrides})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def save_bin_shards(hf, directory, n_shards=2):
    """The pytorch_model-0000i-of-0000n.bin layout (transformers 5 only writes safetensors)."""
    directory.mkdir()
    hf.config.save_pretrained(directory)
    names = list(hf.state_dict())
    weight_map = {}
    for i in range(n_shards):
        shard = f"pytorch_model-{i + 1:05d}-of-{n_shards:05d}.bin"
        part = {k: v.clone() for k, v in hf.state_dict().items() if k in names[i::n_shards]}
        torch.save(part, directory / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


TINY_CASES = {
    "llama31_rope_gqa_safetensors_shards": dict(
        overrides=dict(num_key_value_heads=2, rope_theta=500000.0,
                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=256)),
        fmt="safetensors"),
    "untied_bin_shards": dict(overrides=dict(tie_word_embeddings=False), fmt="bin"),
    "tied_single_safetensors": dict(overrides=dict(tie_word_embeddings=True, num_key_value_heads=4), fmt="single"),
}


@pytest.mark.parametrize("case", TINY_CASES)
def test_converted_hf_checkpoint_matches_hf(case, tmp_path):
    spec = TINY_CASES[case]
    hf = tiny_hf_model(**spec["overrides"])
    directory = tmp_path / "hf"
    if spec["fmt"] == "bin":
        save_bin_shards(hf, directory)
    else:
        hf.save_pretrained(directory, max_shard_size="100KB" if spec["fmt"] == "safetensors" else "1GB")
    n_weight_files = len([p for p in directory.iterdir() if p.suffix in (".safetensors", ".bin")])
    assert (n_weight_files == 1) == (spec["fmt"] == "single")

    path = convert_hf_checkpoint(directory)
    model = load_model(path, "cpu", "fp32")
    assert model.config.tie_embeddings == hf.config.tie_word_embeddings
    assert (model.config.rope_scaling is not None) == ("rope_scaling" in spec["overrides"])
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    assert_logits_match(model, hf, ids, decode_steps=4)
    if "rope_scaling" in spec["overrides"]:  # past original_max_position_embeddings, where scaling acts
        # the shape puts a frequency in each of the three bands: kept, blended (the smoothing formula), divided
        c, scaling = model.config, model.config.rope_scaling
        wavelengths = 2 * math.pi * c.rope_base ** (torch.arange(0, c.head_dim, 2) / c.head_dim)
        old = scaling["original_max_position_embeddings"]
        short, long = old / scaling["high_freq_factor"], old / scaling["low_freq_factor"]
        bands = [(wavelengths < short).any(), ((wavelengths >= short) & (wavelengths <= long)).any(),
                 (wavelengths > long).any()]
        assert all(bands), wavelengths
        long_ids = torch.randint(0, 320, (1, 300), generator=torch.Generator().manual_seed(2))
        assert_logits_match(model, hf, long_ids, decode_steps=2)
    # converting again reads the HF files, not our own output
    assert convert_hf_checkpoint(directory) == path


def test_conversion_is_streamed_and_atomic(tmp_path, monkeypatch):
    """An interrupted conversion leaves no checkpoint and no partial file."""
    hf = tiny_hf_model()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    calls = []

    def interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_cat(*args, **kwargs)

    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_hf_checkpoint(tmp_path / "hf")
    monkeypatch.undo()
    assert len(calls) == 5
    assert not (tmp_path / "hf" / CHECKPOINT_NAME).exists()
    assert not list((tmp_path / "hf").glob("*.partial"))
    assert not (tmp_path / "hf" / "model_config.json").exists()


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    def fill(f):
        f.write("x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name

    with pytest.raises(UserError, match=f"could not write {tmp_path / 'out.json'}: No space left on device"):
        write_atomically(tmp_path / "out.json", fill)
    assert list(tmp_path.iterdir()) == []


def test_a_terminated_command_leaves_no_partial_file(tmp_path):
    """SIGTERM (kill, timeout) ends a command line as Ctrl-C does, through write_atomically's cleanup."""
    script = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
              "from fastllama.checkpoint import write_atomically; from fastllama.errors import run_cli\n"
              f"run_cli(lambda args: write_atomically({str(tmp_path / 'out.bin')!r}, "
              "lambda f: (f.write('x'), f.flush(), time.sleep(60))), None)\n")
    process = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 60
    while not list(tmp_path.glob("*.partial")) and time.time() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob("*.partial")), "the write never started"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_config_errors(tmp_path):
    with pytest.raises(UserError, match="config.json is missing"):
        convert_hf_checkpoint(tmp_path)
    hf = tiny_hf_model()
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))  # more than it has
    with pytest.raises(UserError, match="has no tensor"):
        convert_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(UserError, match=r"stored quantized \(fp8\): convert its bf16"):
        convert_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rms_norm_eps"}))
    with pytest.raises(UserError, match="config.json has no 'rms_norm_eps', which its family needs"):
        convert_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    save_file({"scale": torch.zeros(2, dtype=torch.float8_e4m3fn)}, tmp_path / "hf" / "extra.safetensors")
    with pytest.raises(UserError, match="stores scale as F8_E4M3, which conversion does not read"):
        convert_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "hf" / "extra.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")  # a pointer
    with pytest.raises(UserError, match="extra.safetensors is not a readable weights file .*scripts/download.py"):
        convert_hf_checkpoint(tmp_path / "hf")
    # Mistral's second copy of the weights, in its own names, is not read as a shard
    (tmp_path / "hf" / "extra.safetensors").rename(tmp_path / "hf" / "consolidated.safetensors")
    assert convert_hf_checkpoint(tmp_path / "hf").is_file()
    with pytest.raises(UserError, match="unknown model name 'Llama-9B'"):
        shape("Llama-9B")


def test_known_shapes_build():
    for name in SHAPES:
        with torch.device("meta"):
            model = Transformer(shape(name))
        args = model.config
        assert args.n_head % args.n_local_heads == 0
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Transformer(shape("Llama-3.1-8B")).parameters())
    assert abs(n_params - 8.03e9) < 0.01e9


def test_safetensors_writer_round_trip(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int8), "c": torch.randn(4).bfloat16()}
    entries = [single(k, v.dtype, v.shape, lambda v=v: v) for k, v in tensors.items()]
    write_safetensors(tmp_path / "x.safetensors", entries, {"note": "hi"})
    loaded = load_file(tmp_path / "x.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert read_metadata(tmp_path / "x.safetensors")["note"] == "hi"


@torch.no_grad()
def test_a_tree_a_row_equals_each_branch_after_its_prefix():
    """Rows of their own trees (B, T, T) in one forward: a prefix, then branches that each see the
    prefix and their own earlier tokens; every branch equals a forward over its prefix and itself."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=48, n_head=4, n_local_heads=2, block_size=64)).eval()
    rows = [(torch.randint(0, 64, (6,)), [torch.randint(0, 64, (n,)) for n in (3, 1, 4)]),
            (torch.randint(0, 64, (9,)), [torch.randint(0, 64, (2,))])]  # 14 and 11 tokens: the second padded
    T = 14
    idx, tree = torch.zeros(2, T, dtype=torch.long), torch.eye(T, dtype=torch.bool).repeat(2, 1, 1)
    for r, (prefix, branches) in enumerate(rows):
        P = start = len(prefix)
        idx[r, :P], tree[r, :P, :P] = prefix, torch.ones(P, P, dtype=torch.bool).tril()
        for branch in branches:
            end = start + len(branch)
            idx[r, start:end], tree[r, start:end, :P] = branch, True
            tree[r, start:end, start:end] = torch.ones(len(branch), len(branch), dtype=torch.bool).tril()
            start = end
    model.setup_caches(2, T)
    logits = model.logits(model.hidden_states(idx, torch.arange(T).expand(2, T), tree=tree))
    for r, (prefix, branches) in enumerate(rows):
        start = len(prefix)
        for branch in branches:
            model.setup_caches(1, T)
            whole = torch.cat([prefix, branch])[None]
            reference = model(whole, torch.arange(whole.shape[1]))[0, len(prefix):]
            assert relative_error(logits[r, start: start + len(branch)], reference) <= 1e-5
            start += len(branch)
