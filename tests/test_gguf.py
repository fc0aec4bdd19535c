"""Any llama-architecture GGUF file as a checkpoint: Q4_0, Q4_1, Q4_K, IQ4_NL and IQ4_XS copied as int4 without
loss, other types dequantized and quantized again with a notice (int8 where they hold more bits than int4, as
Q5_0 and Q8_0 do), floats kept unquantized; what the import does not take refused in one line. The files are
random weights in SmolLM2-135M's shape, two layers, with the bundled model's tokenizer
(scripts/make_gguf.py)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastllama import convert, generate as gen, quantize
from fastllama.checkpoint import CHECKPOINT_NAME, load_config, read_safetensors
from fastllama.errors import UserError
from fastllama.model import rope_tables

gguf = pytest.importorskip("gguf")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_gguf import make_gguf  # noqa: E402

LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")


@pytest.fixture(scope="module")
def files(bundled_checkpoint, tmp_path_factory):
    """A small GGUF file of each type, made once: {type: path}."""
    folder = tmp_path_factory.mktemp("gguf")
    files = {kind: make_gguf(folder / f"tiny-{kind}.gguf", "SmolLM2-135M", kind, n_layer=2)
             for kind in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS", "F16")}
    # as llama-quantize's K-quant mixes: Q4_K where a matrix's rows allow (ffn_down's 1536 inputs; Q5_0 where
    # not), some matrices in more bits (Q8_0, in layer 1); and beyond them, layer 0's wqkv joining Q4_1 q and k
    # to an IQ4_NL v (one table of levels a linear: v rounded to int4), and its wo all IQ4_NL (copied)
    files["Q4_K"] = make_gguf(folder / "tiny-Q4_K.gguf", "SmolLM2-135M", "Q4_K", n_layer=2, tensor_types={
        "blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q4_1", "blk.0.attn_v.weight": "IQ4_NL",
        "blk.0.attn_output.weight": "IQ4_NL", "blk.1.attn_v.weight": "Q8_0", "blk.1.ffn_down.weight": "Q8_0"})
    return files


def source_weights(path: Path, config) -> dict[str, torch.Tensor]:
    """Each of our linears' weights as the GGUF file's own dequantization gives it, rows in our order."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}

    def dequantized(name: str, heads: int | None) -> torch.Tensor:
        t = tensors[name]
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
        return w if heads is None else convert.unpermute_rows(w, heads)

    return {name.removesuffix(".weight"): torch.cat([dequantized(n, h) for n, h in parts])
            for name, parts in convert.gguf_names(config).items() if name.removesuffix(".weight").endswith(LINEARS)}


def converted(path: Path, out: Path, capfd) -> tuple[dict, dict, dict, str]:
    """Convert path into out: (our tensors, their metadata, the source's weights, what was said on stderr)."""
    capfd.readouterr()
    checkpoint = gen.convert_gguf(path, out)
    said = capfd.readouterr().err
    ours, metadata = read_safetensors(checkpoint)
    return ours, metadata, source_weights(path, load_config(checkpoint)), said


def dequantized(ours: dict, scheme: quantize.Int4GGUF, name: str) -> torch.Tensor:
    """Our int4 linear `name`'s weight, its levels IQ4_LEVELS where the scheme says so."""
    levels = torch.tensor(quantize.IQ4_LEVELS, dtype=torch.int8) if name in scheme.iq4_layers else None
    return quantize.dequantize_int4(ours[f"{name}.weight"], ours[f"{name}.scales"], ours[f"{name}.mins"], levels=levels)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS"])
def test_q4_and_iq4_weights_are_copied_without_loss(files, tmp_path, capfd, kind):
    """IQ4_XS's scales d (ls - 32) to fp16's precision; the 135M shape's rows of 576 inputs fall back to IQ4_NL
    in its file, as llama-quantize's do, and ffn_down's 1536 are IQ4_XS."""
    ours, metadata, source, said = converted(files[kind], tmp_path / "out", capfd)
    scheme = quantize.read_scheme(metadata)
    assert type(scheme) is quantize.Int4GGUF
    assert scheme.iq4_layers == (set(source) if kind.startswith("IQ4") else set())
    assert len(source) == 4 * 2
    for name, w in source.items():
        mine = dequantized(ours, scheme, name)
        if kind == "IQ4_XS" and name.endswith("w2"):
            assert 0 < (mine - w).abs().max() <= 2 ** -11 * w.abs().max(), name
        else:
            assert torch.equal(mine, w), name
    assert "dequantized" not in said  # the embedding table (Q8_0) is not one of the linears: no notice


@torch.no_grad()
def test_a_k_quant_mix_keeps_each_linear_as_near_the_file_as_its_bits_allow(files, tmp_path, capfd):
    """Q4_K's and Q4_1's weights are copied (Q4_K's scales d sc and mins dmin mn to fp16's precision), and a
    linear all IQ4_NL; a linear of ours held in part in more bits a weight than int4 holds (Q5_0, Q8_0) is int8,
    the others int4, copying what is Q4 in them and rounding the rest (fitted to its levels); the notices say
    which types were rounded to what. The mixed model loads and computes as its weights say."""
    ours, metadata, source, said = converted(files["Q4_K"], tmp_path / "out", capfd)
    scheme = quantize.read_scheme(metadata)
    assert type(scheme) is quantize.Int4GGUF
    assert scheme.int8_layers == {f"layers.{i}.{name}" for i, name in [
        (0, "feed_forward.w13"), (1, "attention.wqkv"), (1, "attention.wo"), (1, "feed_forward.w13"),
        (1, "feed_forward.w2")]}
    assert scheme.iq4_layers == {"layers.0.attention.wo"}
    assert said.count("dequantized") == 2, said
    assert "its IQ4_NL weights that a linear of ours joins to Q4 ones are dequantized and quantized again" in said
    assert "its Q5_0, Q8_0 weights are dequantized and quantized again as int8 (per output channel)" in said, said

    def mine(name: str) -> torch.Tensor:
        if name in scheme.int8_layers:
            return ours[f"{name}.weight"].float() * ours[f"{name}.scales"].float()[:, None]
        return dequantized(ours, scheme, name)

    w = source["layers.0.feed_forward.w2"]  # Q4_K
    assert 0 < (mine("layers.0.feed_forward.w2") - w).abs().max() <= 2 ** -10 * w.abs().max()
    assert torch.equal(mine("layers.0.attention.wo"), source["layers.0.attention.wo"])  # IQ4_NL
    w, qk = source["layers.0.attention.wqkv"], 576 + 192  # Q4_1 q and k copied, then an IQ4_NL v rounded to int4
    assert torch.equal(mine("layers.0.attention.wqkv")[:qk], w[:qk])
    # each group's scale and min fitted to IQ4_NL's uneven levels: nearer than from its min to its max
    plain = quantize.dequantize_int4(*quantize.rtn_int4(w[qk:], 32))
    assert 0 < (mine("layers.0.attention.wqkv")[qk:] - w[qk:]).norm() < 0.95 * (plain - w[qk:]).norm()
    for name in scheme.int8_layers:  # Q5_0 or Q8_0, or both
        assert (mine(name) - source[name]).abs().max() <= 0.01 * source[name].abs().max()

    # the mixed model against one in fp32 of the same weights, as dequantized above: near, where a layer
    # loaded as the other kind, or with another's weights, would be far
    model = gen.load_model(tmp_path / "out" / CHECKPOINT_NAME, "cpu", "fp32")
    assert [type(layer.attention.wqkv).__name__ for layer in model.layers] == ["Int4Linear", "Int8Linear"]
    assert model.layers[0].attention.wo.iq4 and not model.layers[0].attention.wqkv.iq4
    reference = gen.load_model(convert.import_gguf(files["Q4_K"], tmp_path / "exact"), "cpu", "fp32")
    for name in source:
        reference.get_submodule(name).weight.copy_(mine(name))
    tokens = torch.randint(3, 49152, (1, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for m in (model, reference):
        m.setup_caches(1, 32)
        logits.append(m(tokens, torch.arange(24))[0])
    assert ((logits[0] - logits[1]).norm() / logits[1].norm()).item() < 0.05


@pytest.mark.parametrize("kind, mode, tolerance", [("Q8_0", "int8", 0.02), ("Q5_0", "int8", 0.02), ("F16", None, 0.005)])
def test_other_types_are_dequantized_and_quantized_again_with_a_notice(files, tmp_path, capfd, kind, mode, tolerance):
    ours, metadata, source, said = converted(files[kind], tmp_path / "out", capfd)
    scheme = quantize.read_scheme(metadata)
    assert (scheme and scheme.layout) == mode
    notice = [line for line in said.splitlines() if "dequantized" in line]
    assert len(notice) == 1 and kind in notice[0] and f"tiny-{kind}.gguf" in notice[0], said
    for name, w in source.items():
        if mode == "int8":
            mine = ours[f"{name}.weight"].float() * ours[f"{name}.scales"].float()[:, None]
        else:
            mine = ours[f"{name}.weight"].float()
        assert (mine - w).norm() <= tolerance * w.norm(), name  # relative to the weight's norm


def test_a_gguf_path_is_converted_on_first_use_and_again_when_the_file_or_the_import_changes(files, tmp_path, monkeypatch):
    monkeypatch.setattr(convert, "GGUF_CHECKPOINTS", tmp_path / "gguf")
    conversions = []
    real = gen.convert_gguf
    monkeypatch.setattr(gen, "convert_gguf", lambda *a: conversions.append(a) or real(*a))
    path = shutil.copy(files["Q4_1"], tmp_path / "model.gguf")
    first = gen.find_checkpoint(path)
    assert first == tmp_path / "gguf" / "model" / CHECKPOINT_NAME and len(conversions) == 1
    assert gen.find_checkpoint(path) == first and len(conversions) == 1
    os.utime(path, ns=(0, 0))
    assert gen.find_checkpoint(path) == first and len(conversions) == 2
    stamp = tmp_path / "gguf" / "model" / convert.GGUF_STAMP  # as an earlier version of the import wrote it
    stamp.write_text(json.dumps({k: v for k, v in json.loads(stamp.read_text()).items() if k != "import"}))
    assert gen.find_checkpoint(path) == first and len(conversions) == 3


def test_generate_runs_on_a_gguf_file(files, tmp_path):
    """The command line, as a user runs it: the file converted into checkpoints/gguf/NAME, then decoded."""
    path = shutil.copy(files["Q4_0"], tmp_path / f"test-gguf-{os.getpid()}.gguf")
    try:
        run = subprocess.run([sys.executable, "generate.py", "--checkpoint_path", str(path), "--prompt", "Hello",
                              "--max_new_tokens", "4", "--temperature", "0"],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        assert "converting" in run.stderr and "4 tokens" in run.stdout + run.stderr
    finally:
        shutil.rmtree(convert.GGUF_CHECKPOINTS / path.stem, ignore_errors=True)


def test_a_sentencepiece_vocabulary_tokenizes_as_its_own_model_does(bundled_checkpoint, tmp_path):
    """A "llama" vocabulary (Llama 2, Mistral, TinyLlama): a SentencePiece BPE model trained here as theirs were
    (byte fallback, whitespace kept, a user-defined piece), written into a GGUF file as llama.cpp writes one,
    converted back into a tokenizer.model that encodes every text as the original does."""
    import io

    import sentencepiece

    from fastllama.tokenizer import load_tokenizer

    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2,
        user_defined_symbols=["<|user|>"], minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    path = make_gguf(tmp_path / "sp.gguf", "SmolLM2-135M", "Q4_0", n_layer=1,
                     sentencepiece=tmp_path / "tokenizer.model")
    checkpoint = gen.convert_gguf(path, tmp_path / "out")
    original = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    ours = load_tokenizer(checkpoint.parent)
    for text in ["Hello world", "  two  spaces,\ta tab\nand a line", "digits 12345, ünïcödé 東京 🙂", "<|user|> hi",
                 " a leading space", "trailing  "]:
        assert ours.encode(text) == original.encode(text), text
        assert ours.decode(ours.encode(text)) == original.decode(original.encode(text))
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, True)


# Llama 3's tokenizer.json splits a text so before its byte-level BPE: written out here, apart from
# convert.LLAMA3_SPLIT, as the reference the conversion is checked against
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXTS = ["Hello world", "  two  spaces,\ta tab\nand a line\n\n", "digits 1234567 and 3.14159", "I'M HERE, don't we'll",
         "ünïcödé 東京 🙂!!", "<|eot_id|> after a special", " a leading space", "trailing  ", "x=y+1;//ok...?",
         "run `python generate.py --compile` (the default) **now**", "a zqxv word found whole"]


@pytest.fixture(scope="module")
def llama3_file(bundled_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """A GGUF file as llama.cpp writes Llama 3.2's (a "llama-bpe" vocabulary, RoPE scaled through rope_freqs)
    at a tiny scale, fp32: a byte-level BPE trained here with Llama 3's pre-tokenizer, its original context set
    to 32 positions so that the scaling shows within a short text. (the file, the tokenizer's folder)"""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("llama3")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    # as in Llama 3's: a word found whole in the vocabulary is one token, merges or not ("Ġ" is a space)
    data = json.loads(tok.to_str())
    data["model"]["ignore_merges"] = True
    data["model"]["vocab"]["Ġzqxv"] = len(data["model"]["vocab"])
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}')
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
    path = make_gguf(folder / "llama3.gguf", "SmolLM2-135M", "F32", "F32", n_layer=2, hf_tokenizer=folder,
                     rope_scaling=scaling)
    return path, folder


def test_a_llama3_vocabulary_tokenizes_as_llama_cpp_and_its_own_tokenizer_do(llama3_file, tmp_path):
    """A "llama-bpe" vocabulary (Llama 3): converted, it encodes every text as the tokenizer.json it came from
    and as llama.cpp reading the GGUF file does (digits in threes, contractions, runs of spaces and lines)."""
    from tokenizers import Tokenizer

    from fastllama.tokenizer import load_tokenizer

    path, folder = llama3_file
    convert.import_gguf(path, tmp_path / "out")
    ours = load_tokenizer(tmp_path / "out")
    original = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text) == original.encode(text).ids, text
        assert ours.decode(ours.encode(text)) == original.decode(original.encode(text).ids)  # specials left out
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (0, 2, True)
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's tokenizer: pip install llama-cpp-python")
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert ours.encode(text) == theirs.tokenize(text.encode(), add_bos=False, special=True), text


@torch.no_grad()
def test_rope_scaling_from_rope_freqs_computes_what_llama_cpp_computes(llama3_file, tmp_path):
    """Llama 3.1's RoPE scaling, which a GGUF file holds as rope_freqs (what each frequency is divided by),
    comes back as the llama3 parameters that give those factors; the model's logits over a text past the
    original context then match llama.cpp's on the same file (without the scaling they would not)."""
    path, _ = llama3_file
    checkpoint = convert.import_gguf(path, tmp_path / "out")
    config = load_config(checkpoint)
    assert config.rope_scaling == dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=32)
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's logits: pip install llama-cpp-python")
    tokens = torch.randint(3, config.vocab_size, (48,), generator=torch.Generator().manual_seed(0))
    theirs = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                             type_k=0, type_v=0)  # an fp32 cache (GGML_TYPE_F32), as ours
    theirs.eval(tokens.tolist())
    reference = torch.from_numpy(theirs.scores[:len(tokens)].copy())
    model = gen.load_model(checkpoint, "cpu", "fp32")
    model.setup_caches(1, 64)
    ours = model(tokens[None], torch.arange(len(tokens)))[0]
    error = ((ours - reference).norm() / reference.norm()).item()
    model.rope_cache = rope_tables(dataclasses.replace(config, rope_scaling=None), 64)[0]
    unscaled = model(tokens[None], torch.arange(len(tokens)))[0]
    assert error < 1e-5 and ((unscaled - reference).norm() / reference.norm()).item() > 1e-2, error


def test_linear_rope_scaling_is_read_from_the_metadata(tmp_path):
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    assert convert.gguf_rope_scaling(meta, {}, 64, 1e4, tmp_path / "x.gguf") == {"rope_type": "linear", "factor": 4.0}
    assert convert.gguf_rope_scaling({}, {}, 64, 1e4, tmp_path / "x.gguf") is None


def minimal_gguf(path: Path, architecture: str = "llama", pre: str = "smollm") -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_uint32(f"{architecture}.block_count", 1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "c", "d"])
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


@pytest.mark.parametrize("architecture, pre, named", [("qwen2", "smollm", "holds a qwen2 model"),
                                                      ("llama", "tekken", "pre-tokenizer 'tekken'"),
                                                      ("llama", "smollm", "holds no layers' weights")])
def test_what_the_import_does_not_take_is_refused_in_one_line(tmp_path, architecture, pre, named):
    path = minimal_gguf(tmp_path / "model.gguf", architecture, pre)
    run = subprocess.run([sys.executable, "scripts/convert_gguf.py", "--gguf", str(path), "--output_dir",
                          str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and named in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()


def test_int4_gguf_refuses_an_import_whose_file_is_gone(files, tmp_path):
    """quantize.py --mode int4-gguf copies from the GGUF file itself: where it has moved, it says so."""
    path = shutil.copy(files["Q4_1"], tmp_path / "model.gguf")
    imported = convert.import_gguf(path, tmp_path / "imported")
    path.unlink()
    with pytest.raises(UserError, match="was not imported from a GGUF file that is still there"):
        quantize.quantize(imported, "int4-gguf", output=tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_benchmark_depths_runs_ours_and_llama_cpp_on_one_gguf_file(files, tmp_path):
    """benchmark_depths.py --gguf FILE --llama-cpp: ours (the file converted) and llama.cpp on it, a row each."""
    pytest.importorskip("llama_cpp")
    import json

    path = shutil.copy(files["Q4_1"], tmp_path / f"test-depths-{os.getpid()}.gguf")
    try:
        run = subprocess.run([sys.executable, "scripts/benchmark_depths.py", "--gguf", str(path), "--depths", "0", "16",
                              "--no-prefill", "--no-own-cache", "--max_new_tokens", "2", "--runs", "1", "--llama-cpp",
                              "--json", str(tmp_path / "out.json")],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        rows = json.loads((tmp_path / "out.json").read_text())["rows"]
        assert [r["weights"] for r in rows] == ["gguf-q4_1, bf16", "llama.cpp (llama-cpp-python)"]
        assert "ours / llama-cpp-python" in run.stdout
    finally:
        shutil.rmtree(convert.GGUF_CHECKPOINTS / path.stem, ignore_errors=True)
