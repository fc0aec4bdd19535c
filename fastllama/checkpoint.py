"""Checkpoints on disk in our format: what every run reads (convert.py makes them from other formats).

A checkpoint directory holds `fastllama.safetensors` (our parameter names, q/k/v and gate/up fused;
quantize.py writes its quantized copies beside it), `model_config.json` (the `ModelArgs` fields, read
from the source's own config, never guessed from a path) and the tokenizer files. Every file we
write says so in its metadata (`format`), which is how our files are told from anyone else's, never
by their names. Files are written tensor by tensor to a temporary name and renamed only when
complete, so peak memory stays near the largest tensor and an interrupted run leaves nothing
half-written behind.
"""

import json
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import UserError
from .model import ModelArgs

CHECKPOINT_NAME = "fastllama.safetensors"
CONFIG_NAME = "model_config.json"
FORMAT = "fastllama"  # the `format` in the metadata of every file written here

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}
DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}

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
    header["__metadata__"] = {**(metadata or {}), "format": FORMAT}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data section to 8 bytes

    def write(f):
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for specs, make in tqdm(groups, desc=desc, unit="tensor"):
            for (name, dtype, shape), t in zip(specs, make(), strict=True):
                assert t.dtype == dtype and tuple(t.shape) == shape, (name, t.dtype, t.shape, dtype, shape)
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # from any device

    write_atomically(path, write, binary=True)


def write_atomically(path: Path, write: Callable, binary: bool = False):
    """Run write(file) on a temporary file beside `path` and rename it into place only on success. The
    temporary name is the process's own, so that two processes writing the same file (ranks under
    torchrun, say) never write into each other's: the rename is all they share."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as e:  # KeyboardInterrupt too (and SIGTERM: errors.run_cli): never a partial file
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename in (None, str(tmp), str(path)):  # a full disk, say
            raise UserError(f"could not write {path}: {e.strerror or e}") from None
        raise


def write_json(path: Path, obj: dict):
    """obj as JSON, written whole or not at all; values JSON has no type for (paths) as their text."""
    write_atomically(path, lambda f: json.dump(obj, f, indent=2, default=str))


def read_json(path: Path) -> dict:
    """A JSON file that may be beside a checkpoint (generation_config.json, tokenizer_config.json): {}
    where it is not there, one line where it is not JSON."""
    try:
        content = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}): download it again") from None
    if not isinstance(content, dict):
        raise UserError(f"{path} holds a JSON {type(content).__name__}, not an object: download it again")
    return content


def read_safetensors(path: Path, device="cpu", float_dtype: torch.dtype | None = None, select=None,
                     together: Callable[[str], bool] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a safetensors file (floating ones cast to float_dtype) and its metadata.
    select(name, shape), if given, names the pieces of a tensor to read and concatenate, as
    (dim, [(start, stop), ...]), or None for all of it (tensor parallelism keeps its own slice: rows are
    read alone, a slice of columns is cut from the whole tensor, one tensor at a time).

    Read with plain reads into fresh memory, one tensor at a time, rather than memory-mapped: the
    file's offsets leave tensors unaligned, which CPU kernels such as _weight_int8pack_mm crash on,
    and mapped pages would count against memory on top of any copy (peak stays the tensors' size).
    On CPU the tensors that together(name) names are read into one allocation (views of it, 64-byte
    aligned) that lies in huge pages from end to end (fastllama/__init__.py), where on their own a tensor
    under 2 MB gets none and a bigger one only the 2 MB ranges it covers whole: a decode step streams
    the weights faster so (benchmarks/RESULTS.md, "One allocation for the weights")."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (header_size,) = struct.unpack("<Q", f.read(8))
            if header_size > size:
                raise ValueError("header larger than the file")
            header = json.loads(f.read(header_size))
            metadata = header.pop("__metadata__", None) or {}
            entries = []  # (name, offset, shape, dtype, pieces), in the file's order
            for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                begin, end = info["data_offsets"]
                shape, dtype = info["shape"], DTYPES[info["dtype"]]
                if end - begin != torch.Size(shape).numel() * dtype.itemsize:
                    raise ValueError(f"tensor {name} has the wrong size")
                pieces = select(name, tuple(shape)) if select else None
                entries.append((name, 8 + header_size + begin, shape, dtype, pieces))
            slots = {}
            if together and torch.device(device).type == "cpu":
                kept = lambda dtype: float_dtype if float_dtype and dtype.is_floating_point else dtype  # noqa: E731
                slots = one_allocation({name: (selected_shape(shape, pieces), kept(dtype))
                                        for name, _, shape, dtype, pieces in entries if together(name)})
            tensors = {}
            for name, offset, shape, dtype, pieces in entries:
                slot = slots.get(name)
                if pieces is None:
                    t = read_tensor(f, offset, shape, dtype, slot if slot is not None and slot.dtype == dtype else None)
                elif pieces[0] == 0:  # rows lie together in the file: read just ours
                    row_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
                    t = torch.cat([read_tensor(f, offset + a * row_bytes, [b - a, *shape[1:]], dtype)
                                   for a, b in pieces[1]])
                else:
                    whole = read_tensor(f, offset, shape, dtype)
                    t = torch.cat([whole.narrow(pieces[0], a, b - a) for a, b in pieces[1]], dim=pieces[0])
                if float_dtype is not None and t.is_floating_point():
                    t = t.to(float_dtype)
                if slot is not None and t is not slot:
                    t = slot.copy_(t)
                tensors[name] = t.to(device)
        return tensors, metadata
    except (ValueError, KeyError, TypeError, struct.error) as e:  # JSON and Unicode errors are ValueErrors
        raise UserError(f"{path} is not a readable safetensors file ({e}); delete it and convert again")


def selected_shape(shape: list[int], pieces) -> list[int]:
    """The shape of a tensor's pieces (read_safetensors' select) put together."""
    if pieces is None:
        return shape
    dim, ranges = pieces
    return [*shape[:dim], sum(b - a for a, b in ranges), *shape[dim + 1:]]


def one_allocation(specs: dict[str, tuple[list[int], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Empty tensors of these shapes and dtypes, views of one CPU allocation, each 64 bytes aligned."""
    sizes = {name: torch.Size(shape).numel() * dtype.itemsize for name, (shape, dtype) in specs.items()}
    offsets, end = {}, 0
    for name, n in sizes.items():
        offsets[name], end = end, end + -(-n // 64) * 64
    buffer = torch.empty(end, dtype=torch.uint8)
    return {name: buffer[offsets[name]: offsets[name] + sizes[name]].view(dtype).view(shape)
            for name, (shape, dtype) in specs.items()}


def read_tensor(f, offset: int, shape: list[int], dtype: torch.dtype, into: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor's bytes at offset, into a tensor of its own (64-byte aligned) or `into`."""
    t = torch.empty(shape, dtype=dtype) if into is None else into
    f.seek(offset)
    if f.readinto(t.reshape(-1).view(torch.uint8).numpy()) != t.nbytes:
        raise ValueError("the file is truncated")
    return t


def read_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata, from its header alone ({} where it has none or is unreadable)."""
    return header_metadata(path) or {}


def header_metadata(path: Path) -> dict[str, str] | None:
    """A safetensors file's metadata ({} where it has none), or None for a file that is not safetensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # safetensors raises its own error types for files that are not safetensors
        return None


def is_ours(path: Path) -> bool:
    """Whether a safetensors file was written here (a Hugging Face one has no `format` of ours)."""
    return read_metadata(path).get("format") == FORMAT


def load_config(checkpoint_path: Path) -> ModelArgs:
    path = Path(checkpoint_path).parent / CONFIG_NAME
    if not path.is_file():
        raise UserError(f"{path} is missing: convert the checkpoint with "
                        f"scripts/convert_hf_checkpoint.py --checkpoint_dir {path.parent}")
    try:
        return ModelArgs(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:  # bad JSON, or fields that are not ModelArgs' (never dropped silently)
        raise UserError(f"{path} is not a readable model config ({e}): convert the checkpoint again")


# the files read beside a checkpoint's weights: load_config's, then tokenizer.load_tokenizer's
COMPANIONS = (CONFIG_NAME, "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja")


def resolve_output(output: Path, default_name: str) -> Path:
    """An --output that may name a folder (the file then goes in it as default_name), refused before any
    work where its folder is not there."""
    output = Path(output) / default_name if Path(output).is_dir() else Path(output)
    if not output.parent.is_dir():
        raise UserError(f"--output {output}: its folder does not exist")
    return output


def copy_companions(checkpoint_path: Path, directory: Path):
    """Give weights written from checkpoint_path into another directory copies of the COMPANIONS
    beside them, where directory has none of that name."""
    for name in COMPANIONS:
        source, copy = Path(checkpoint_path).parent / name, Path(directory) / name
        if source.is_file() and not copy.exists():
            with open(source, "rb") as f:
                write_atomically(copy, lambda out, f=f: shutil.copyfileobj(f, out), binary=True)


def resolve_checkpoint(checkpoint_path: Path | str) -> Path:
    """The checkpoint file a user means: a directory means its fastllama.safetensors, and so does a
    Hugging Face file beside it (checkpoints/REPO/model.safetensors, once converted)."""
    checkpoint_path = Path(checkpoint_path)
    if checkpoint_path.suffix == ".gguf":
        raise UserError(f"{checkpoint_path} is a GGUF file: generate.py, serve.py and eval.py take it as it is "
                        f"(converted on first use); convert it once with scripts/convert_gguf.py for the rest")
    if checkpoint_path.is_dir():
        checkpoint_path = checkpoint_path / CHECKPOINT_NAME
    if not checkpoint_path.is_file():
        raise UserError(f"no checkpoint at {checkpoint_path}: get one with scripts/prepare.sh REPO_ID "
                        f"(e.g. meta-llama/Llama-3.1-8B-Instruct), or leave out --checkpoint_path for the "
                        f"bundled model")
    if checkpoint_path.suffix != ".safetensors":
        instead = (f"give its directory, {checkpoint_path.parent}, which holds one"
                   if (checkpoint_path.parent / CHECKPOINT_NAME).is_file() else
                   f"give a converted checkpoint's directory, one holding {CHECKPOINT_NAME} and {CONFIG_NAME}, "
                   f"or that {CHECKPOINT_NAME} itself")
        raise UserError(f"{checkpoint_path} is not a checkpoint (a .safetensors file): {instead}")
    metadata = header_metadata(checkpoint_path)  # None for a file that is not safetensors: the reader says why
    foreign = metadata is not None and metadata.get("format") != FORMAT  # a Hugging Face file (any metadata or none)
    converted = checkpoint_path.parent / CHECKPOINT_NAME
    if foreign and converted.is_file() and converted != checkpoint_path:
        return resolve_checkpoint(converted)
    if foreign:
        raise UserError(f"{checkpoint_path} is not in this library's format (a Hugging Face file?): convert its "
                        f"directory with scripts/convert_hf_checkpoint.py --checkpoint_dir {checkpoint_path.parent}")
    return checkpoint_path


def fused_parts(args: ModelArgs, layer: int) -> dict[str, list[int]]:
    """Rows of each part of a layer's fused weights: q, k, v in wqkv; gate, up in w13 (of each expert's)."""
    q, kv = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    hidden = args.moe_intermediate_size if args.is_moe(layer) else args.intermediate_size
    return {"attention.wqkv": [q, kv, kv], "feed_forward.w13": [hidden] * 2}
