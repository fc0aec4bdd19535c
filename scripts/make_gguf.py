"""A GGUF file of random weights in a known model shape, with the bundled model's tokenizer: what
benchmarks and tests run on where the real file is too large to have (llama.cpp reads it too).

    python scripts/make_gguf.py --model SmolLM2-1.7B --type Q4_1 --output /tmp/smollm2-1.7b-random.Q4_1.gguf

The shape's vocabulary must be the bundled tokenizer's (the SmolLM2 shapes'); with --sentencepiece
MODEL, the vocabulary is that SentencePiece tokenizer.model's instead, as llama.cpp writes a Llama 2 or
Mistral vocabulary (tokenizer.ggml.model "llama"); with --hf_tokenizer DIR, that folder's byte-level BPE
tokenizer.json (and its tokenizer_config.json's bos and eos), as llama.cpp writes a Llama 3 vocabulary
(tokenizer.ggml.model "gpt2", --pre llama-bpe). A shape with Llama 3.1's RoPE scaling gets the
rope_freqs tensor llama.cpp's converter writes for it. The layers' matrices
are of --type, the embedding table of --embedding_type, the norms F32; the gguf package quantizes
(it writes F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, no K-quants). The weights are normal
with a standard deviation of dim^-0.5, so that the activations stay of the size real models have;
Q4_K's, IQ4_NL's and IQ4_XS's are written here as random blocks of about that deviation (RANDOM_BLOCKS).
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, installed or not

from fastllama.errors import UserError, run_cli  # noqa: E402
from shapes import shape  # noqa: E402

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "IQ4_NL", "IQ4_XS")
K_BLOCK = 256  # the inputs of a K-quant's block: a matrix whose rows are not a multiple of it takes FALLBACK's
FALLBACK = {"Q4_K": "Q5_0", "IQ4_XS": "IQ4_NL"}  # as llama-quantize's


def make_gguf(output: Path, model: str, tensor_type: str, embedding_type: str = "Q8_0",
              n_layer: int | None = None, seed: int = 0, sentencepiece: Path | None = None,
              hf_tokenizer: Path | None = None, pre: str = "llama-bpe", rope_scaling: dict | None = None,
              tensor_types: dict[str, str] | None = None) -> Path:
    """rope_scaling: another Llama 3.1 RoPE scaling than the shape's; tensor_types: some matrices' types by their
    name, as llama-quantize's K-quant mixes keep some in more bits (tests)."""
    import gguf
    import torch

    from fastllama.convert import ROPE_FREQS, bundled_gguf
    from fastllama.model import llama3_scale_frequencies

    args = shape(model)
    if rope_scaling:
        args = dataclasses.replace(args, rope_scaling=rope_scaling)
    n_layer = n_layer or args.n_layer
    if sentencepiece or hf_tokenizer:
        tokenizer = sentencepiece_fields(sentencepiece) if sentencepiece else hf_bpe_fields(hf_tokenizer, pre)
        args = dataclasses.replace(args, vocab_size=len(tokenizer["tokenizer.ggml.tokens"][0]))
    else:  # the bundled model's tokenizer fields, with their types (llama.cpp checks them)
        tokenizer = {name: (field.contents(), field.types)
                     for name, field in gguf.GGUFReader(str(bundled_gguf())).fields.items() if name.startswith("tokenizer.")}
    vocabulary = len(tokenizer["tokenizer.ggml.tokens"][0])
    if vocabulary != args.vocab_size:
        raise UserError(f"{model} has a vocabulary of {args.vocab_size}, the bundled tokenizer one of {vocabulary}: "
                        f"take a SmolLM2 shape, or give the shape's vocabulary (--sentencepiece, --hf_tokenizer)")
    llama3 = (args.rope_scaling or {}).get("rope_type") == "llama3"
    if args.rope_scaling and not llama3 or args.qkv_bias or args.qk_norm or args.sliding_window or args.n_experts:
        raise UserError(f"{model} is not a plain Llama: take a SmolLM2 or Llama shape")
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")  # renamed once whole
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_context_length(args.block_size)
    writer.add_block_count(n_layer)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.n_head)
    writer.add_head_count_kv(args.n_local_heads)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_rope_freq_base(args.rope_base)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_vocab_size(args.vocab_size)
    for key, (value, types) in tokenizer.items():
        writer.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)

    rng = np.random.default_rng(seed)

    def add(name: str, rows: int, cols: int, kind: str):
        kind = (tensor_types or {}).get(name, kind)
        if kind in FALLBACK and cols % K_BLOCK:
            kind = FALLBACK[kind]
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in RANDOM_BLOCKS:
            writer.add_tensor(name, RANDOM_BLOCKS[kind](rng, rows, cols, args.dim ** -0.5), raw_dtype=qtype)
            return
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * args.dim ** -0.5)
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    q, kv = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    add("token_embd.weight", args.vocab_size, args.dim, embedding_type)
    if not args.tie_embeddings:
        add("output.weight", args.vocab_size, args.dim, tensor_type)
    writer.add_tensor("output_norm.weight", np.ones(args.dim, dtype=np.float32))
    if llama3:  # what each frequency is divided by
        inv_freq = 1.0 / args.rope_base ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim)
        writer.add_tensor(ROPE_FREQS, (inv_freq / llama3_scale_frequencies(inv_freq, args.rope_scaling)).numpy())
    for i in range(n_layer):
        b = f"blk.{i}."
        for name, rows, cols in (("attn_q", q, args.dim), ("attn_k", kv, args.dim), ("attn_v", kv, args.dim),
                                 ("attn_output", args.dim, q), ("ffn_gate", args.intermediate_size, args.dim),
                                 ("ffn_up", args.intermediate_size, args.dim),
                                 ("ffn_down", args.dim, args.intermediate_size)):
            add(f"{b}{name}.weight", rows, cols, tensor_type)
        writer.add_tensor(f"{b}attn_norm.weight", np.ones(args.dim, dtype=np.float32))
        writer.add_tensor(f"{b}ffn_norm.weight", np.ones(args.dim, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(output)
    return output


def random_q4_k(rng, rows: int, cols: int, std: float) -> np.ndarray:
    """Random weights in Q4_K's blocks (the gguf package does not write K-quants), as bytes (rows, cols / 256
    * 144): for each 256 inputs fp16 d and dmin, 8 groups' 6-bit scales sc and mins mn packed in 12 bytes, and
    128 bytes of levels q (w = d sc q - dmin mn). The levels are uniform over 0..15 and each group's sc over
    16..63 (so that all 6 bits are used), mn centring its weights near 0; their standard deviation about std."""
    n = rows * cols // K_BLOCK
    sc = rng.integers(16, 64, (n, 8))
    d = np.full((n, 1), std / (40 * 4.6), np.float16)  # a level's deviation is 4.6, sc's mean about 40
    dmin = (d * 8).astype(np.float16)
    mn = np.rint(sc * 7.5 / 8).astype(np.int64)  # at most 59: dmin mn near d sc 7.5, the levels' mean
    scales = np.empty((n, 12), np.uint8)  # groups 0-3 in 6 bits; 4-7's low 4 bits in bytes 8-11, high 2 atop 0-7
    scales[:, 0:4] = sc[:, :4] | sc[:, 4:] >> 4 << 6
    scales[:, 4:8] = mn[:, :4] | mn[:, 4:] >> 4 << 6
    scales[:, 8:12] = sc[:, 4:] & 15 | (mn[:, 4:] & 15) << 4
    levels = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, levels], axis=1).reshape(rows, -1)


def random_iq4_nl(rng, rows: int, cols: int, std: float) -> np.ndarray:
    """Random weights in IQ4_NL's blocks (which the gguf package reads but does not write), as bytes (rows,
    cols / 32 * 18): for each 32 inputs an fp16 d and 16 bytes of 4-bit indices into a fixed table of 16
    levels (w = d level), uniform over it; their standard deviation about std."""
    import gguf

    n = rows * cols // 32
    levels = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)
    d = np.full((n, 1), std / np.sqrt(np.mean(levels ** 2)), np.float16)
    return np.concatenate([d.view(np.uint8), rng.integers(0, 256, (n, 16), dtype=np.uint8)], axis=1).reshape(rows, -1)


def random_iq4_xs(rng, rows: int, cols: int, std: float) -> np.ndarray:
    """Random weights in IQ4_XS's blocks, as bytes (rows, cols / 256 * 136): for each 256 inputs an fp16 d, 8
    groups' 6-bit scales ls (their high 2 bits in 2 bytes, their low 4 in 4 more) and 128 bytes of IQ4_NL's
    indices (w = d (ls - 32) level), all uniform; their standard deviation about std."""
    import gguf

    n = rows * cols // K_BLOCK
    levels = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)
    d = np.full((n, 1), std / np.sqrt(np.mean(levels ** 2) * np.mean((np.arange(64) - 32.0) ** 2)), np.float16)
    scales_and_levels = rng.integers(0, 256, (n, 2 + 4 + 128), dtype=np.uint8)
    return np.concatenate([d.view(np.uint8), scales_and_levels], axis=1).reshape(rows, -1)


RANDOM_BLOCKS = {"Q4_K": random_q4_k, "IQ4_NL": random_iq4_nl, "IQ4_XS": random_iq4_xs}  # written as random blocks


def sentencepiece_fields(path: Path) -> dict:
    """A SentencePiece tokenizer.model's vocabulary as GGUF tokenizer fields (name -> (value, types)), as
    llama.cpp's converter writes them: each piece with its score and type (SentencePiece's numbering)."""
    import gguf
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (RuntimeError, OSError):
        raise UserError(f"{path} is not a SentencePiece model")
    # the types from the model's protobuf itself: sentencepiece's Python API cannot tell a user-defined piece
    types = [fields.get(3, int(gguf.TokenType.NORMAL)) for number, fields in protobuf_messages(path.read_bytes())
             if number == 1]
    V = gguf.GGUFValueType
    fields = {"tokenizer.ggml.model": ("llama", [V.STRING]),
              "tokenizer.ggml.tokens": ([sp.id_to_piece(i) for i in range(len(sp))], [V.ARRAY, V.STRING]),
              "tokenizer.ggml.scores": ([sp.get_score(i) for i in range(len(sp))], [V.ARRAY, V.FLOAT32]),
              "tokenizer.ggml.token_type": (types, [V.ARRAY, V.INT32]),
              "tokenizer.ggml.add_bos_token": (True, [V.BOOL])}
    for key, i in (("unknown", sp.unk_id()), ("bos", sp.bos_id()), ("eos", sp.eos_id())):
        if i >= 0:
            fields[f"tokenizer.ggml.{key}_token_id"] = (i, [V.UINT32])
    return fields


def hf_bpe_fields(folder: Path, pre: str) -> dict:
    """A folder's HF tokenizer.json of byte-level BPE (a Llama 3 checkpoint's) as GGUF tokenizer fields, as
    llama.cpp's converter writes them: the tokens by id (added special tokens as control tokens, other
    added ones user-defined), the merges, the pre-tokenizer's name, and tokenizer_config.json's bos and eos."""
    import gguf

    try:
        data = json.loads((folder / "tokenizer.json").read_text())
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--hf_tokenizer {folder}: no tokenizer.json and tokenizer_config.json there ({e})")
    if data.get("model", {}).get("type") != "BPE":
        raise UserError(f"--hf_tokenizer {folder}: not a BPE tokenizer")
    ids = dict(data["model"]["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    ids.update({text: t["id"] for text, t in added.items()})
    tokens = sorted(ids, key=ids.get)
    if [ids[t] for t in tokens] != list(range(len(tokens))):
        raise UserError(f"--hf_tokenizer {folder}: its ids are not 0 .. {len(tokens) - 1}")
    T = gguf.TokenType
    types = [int(T.NORMAL if t not in added else T.CONTROL if added[t]["special"] else T.USER_DEFINED) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    V = gguf.GGUFValueType
    fields = {"tokenizer.ggml.model": ("gpt2", [V.STRING]), "tokenizer.ggml.pre": (pre, [V.STRING]),
              "tokenizer.ggml.tokens": (tokens, [V.ARRAY, V.STRING]),
              "tokenizer.ggml.token_type": (types, [V.ARRAY, V.INT32]),
              "tokenizer.ggml.merges": (merges, [V.ARRAY, V.STRING])}
    for key in ("bos", "eos"):
        token = config.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token in ids:
            fields[f"tokenizer.ggml.{key}_token_id"] = (ids[token], [V.UINT32])
    add_bos = config.get("add_bos_token", "tokenizer.ggml.bos_token_id" in fields)
    fields["tokenizer.ggml.add_bos_token"] = (bool(add_bos), [V.BOOL])
    return fields


def protobuf_messages(data: bytes):
    """(field number, {number: varint value}) for each length-delimited field of a protobuf message: the
    pieces of a SentencePiece model, each with the varint fields of its own message (3: the type)."""
    def varint(i: int) -> tuple[int, int]:
        n = shift = 0
        while True:
            n |= (data[i] & 0x7F) << shift
            shift += 7
            i += 1
            if data[i - 1] < 0x80:
                return n, i

    def fields(start: int, end: int):
        i = start
        while i < end:
            key, i = varint(i)
            wire = key & 7
            if wire == 0:
                value, i = varint(i)
                yield key >> 3, value, None
            elif wire == 2:
                length, i = varint(i)
                yield key >> 3, None, (i, i + length)
                i += length
            else:  # 1: 64 bits, 5: 32 bits
                i += 8 if wire == 1 else 4

    for number, _, span in fields(0, len(data)):
        if span:
            yield number, {n: v for n, v, _ in fields(*span) if v is not None}


def main(args):
    path = make_gguf(args.output, args.model, args.type, args.embedding_type, args.n_layer, args.seed,
                     args.sentencepiece, args.hf_tokenizer, args.pre)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--model", default="SmolLM2-1.7B", help="a known shape (scripts/shapes.py): a SmolLM2 one with the "
                   "bundled vocabulary, a plain Llama one with --sentencepiece or --hf_tokenizer")
    p.add_argument("--type", choices=TYPES, default="Q4_1",
                   help=f"of the layers' matrices (Q4_K: those whose rows are a multiple of {K_BLOCK}, {FALLBACK} the others)")
    p.add_argument("--embedding_type", choices=TYPES, default="Q8_0", help="of the embedding table")
    p.add_argument("--n_layer", type=int, default=None, help="fewer layers than the shape has (tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sentencepiece", type=Path, default=None,
                   help="a SentencePiece tokenizer.model whose vocabulary the file takes (as Llama 2's or Mistral's)")
    p.add_argument("--hf_tokenizer", type=Path, default=None,
                   help="a folder with a byte-level BPE tokenizer.json whose vocabulary the file takes (as Llama 3's)")
    p.add_argument("--pre", default="llama-bpe", help="with --hf_tokenizer: llama.cpp's name of its pre-tokenizer")
    p.add_argument("--output", type=Path, required=True)
    run_cli(main, p.parse_args())
