"""Weight-only quantization, written once into a checkpoint and loaded straight into quantized modules.

    python quantize.py --checkpoint_path checkpoints/X --mode int8
    python quantize.py --checkpoint_path checkpoints/X --mode int4 --groupsize 32
    python quantize.py --checkpoint_path checkpoints/X --mode int4-gptq --groupsize 64
    python quantize.py --mode int4-gguf       # the bundled model's own Q4_1 weights, copied losslessly

Modes: int8 (per output channel, symmetric), int4 (per group of `groupsize` input columns,
asymmetric, round to nearest) and int4-gptq (the same format, with GPTQ's error-compensating
rounding, calibrated layer by layer). The output head is int8 in every mode: it is the largest
single matrix of small models and int4 costs it the most accuracy. Embeddings stay bf16 (a step
reads one row of them).

Layouts in the file are device-neutral: int8 `weight` (n, k) with `scales` (n,); int4 `weight` uint8
(n, k/2), two 4-bit values a byte, high nibble first, with `scales` and `mins` (n, k/groupsize),
where w = q * scale + min. `pack_for_device` chooses each module's kernel for its device once, at
load, and turns int4 into that kernel's layout. The scheme is recorded in the file's safetensors
metadata, never parsed from its name.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

from checkpoint import (Group, copy_companions, load_config, read_metadata, resolve_checkpoint, resolve_output, single,
                        write_safetensors)
from cpu_decode import compiling_few_rows, few_rows_product, linear_in, matmul_dtype
from errors import UserError, run_cli
from model import ExpertLinears, KVCache, ModelArgs, Transformer, TransformerBlock, attention_mask, rope_tables
from tokenizer import load_tokenizer

try:  # Triton's int8 products of a few rows on a GPU; PyTorch's CUDA wheels bring Triton, its CPU wheels do not
    import kernels
except ImportError:
    kernels = None

GROUPSIZES = (32, 64, 128, 256)
MODES = ("int8", "int4", "int4-gptq", "int4-gguf")


# ---------------------------------------------------------------------------------------------
# Quantizing a weight


# Each works on a weight (n, k) or on a stack of them, (..., n, k): the experts of a MoE layer.


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (n, k) -> int8 q (n, k) and bf16 scales (n,) with w ~ q * scale."""
    w = w.float()
    scales = (w.abs().amax(dim=-1).clamp(min=1e-8) / 127).bfloat16()  # rounded first: q fits the stored scale
    return torch.round(w / scales.float()[..., None]).clamp(-127, 127).to(torch.int8), scales


def int4_group_params(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor]:
    """Per-group scale and min of w (n, k): 16 levels from each group's min to its max."""
    groups = w.float().reshape(*w.shape[:-1], -1, groupsize)
    lo, hi = groups.amin(-1), groups.amax(-1)
    return ((hi - lo) / 15).clamp(min=1e-8), lo  # (n, k/groupsize) each


def quantize_int4(w: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """w (n, k) -> levels 0..15 (n, k) as uint8, for per-group scales and mins (n, k/groupsize)."""
    groupsize = w.shape[-1] // scales.shape[-1]
    scales, mins = scales.repeat_interleave(groupsize, -1), mins.repeat_interleave(groupsize, -1)
    return torch.round((w.float() - mins) / scales).clamp(0, 15).to(torch.uint8)


def pack_int4(q: Tensor) -> Tensor:
    """(n, k) levels 0..15 -> (n, k/2) uint8, high nibble first (CUDA's int4pack input layout)."""
    return (q[..., ::2] << 4 | q[..., 1::2]).to(torch.uint8)


def unpack_int4(packed: Tensor) -> Tensor:
    """(n, k/2) uint8 -> (n, k) levels 0..15 as uint8."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(*packed.shape[:-1], -1)


def dequantize_int4(packed: Tensor, scales: Tensor, mins: Tensor, dtype=torch.float32) -> Tensor:
    """(n, k/2) packed levels, (n, k/groupsize) scales and mins -> w (n, k) in dtype."""
    q = unpack_int4(packed).to(dtype).view(*scales.shape, -1)  # (n, groups, groupsize)
    return (q * scales.to(dtype).unsqueeze(-1) + mins.to(dtype).unsqueeze(-1)).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Quantized modules: the model does not know it is quantized


class Int8Linear(nn.Module):
    """Per-channel int8. Its kernel is chosen for its device once, by `pack` (int8_kernel): on CPU,
    PyTorch's int8 kernel for a few rows, or with "cpu-fused" a multiply-and-sum that compiled code
    fuses (cpu_decode.py), and for many rows (prefill), where the kernel is slower, a matmul of the
    weight converted a block at a time (to bf16, or to fp32 where bf16 is slow: cpu_decode.linear_in);
    on a GPU with Triton, kernels.py's for a few rows; elsewhere, and for many rows, the dequantized
    matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)
        self.kernel = None  # "cpu", "cpu-fused", "triton" or "dequantize" once packed

    def pack(self, kernel: str):
        self.kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        assert self.kernel is not None, "call quantize.pack_for_device(model) after loading"
        rows = x.shape[:-1].numel()
        if self.kernel == "cpu-fused" and compiling_few_rows(x):
            y = few_rows_product(x, self.weight) * self.scales  # int8 converted in registers
        elif self.kernel.startswith("cpu") and rows <= 16:
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, self.in_features), self.weight, self.scales)
            y = y.reshape(*x.shape[:-1], self.out_features)
        elif self.kernel == "triton" and rows <= kernels.ROWS:
            y = kernels.int8_rows(x.reshape(rows, self.in_features), self.weight, self.scales)
            y = y.reshape(*x.shape[:-1], self.out_features)
        elif self.kernel in ("dequantize", "triton"):
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales
        else:
            y = linear_in(matmul_dtype(x), x, self.weight) * self.scales
        return (y if self.bias is None else y + self.bias).to(x.dtype)


class Int4Linear(nn.Module):
    """Groupwise int4. Holds the neutral layout until `pack(kernel)`, then the kernel's layout."""

    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False,
                 dtype=torch.bfloat16, device=None):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.padded_in = -(-in_features // groupsize) * groupsize  # k padded to whole groups
        groups = self.padded_in // groupsize
        self.register_buffer("weight", torch.empty(out_features, self.padded_in // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("mins", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)
        self.kernel = None  # "cuda", "cpu", or "dequantize" once packed

    def pack(self, kernel: str):
        """Turn the neutral layout into `kernel`'s: tinygemm's packed weight and scales_and_zeros, or
        for "dequantize" the bf16 weight."""
        if kernel == "dequantize":
            self.register_buffer("weight_bf16", dequantize_int4(self.weight, self.scales, self.mins).bfloat16())
            del self.weight
        else:
            self.weight, scales_and_zeros = int4_kernel_layout(kernel, self.weight, self.scales, self.mins)
            self.register_buffer("scales_and_zeros", scales_and_zeros)
        del self.scales, self.mins
        self.kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        assert self.kernel is not None, "call quantize.pack_for_device(model) after loading"
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if self.kernel == "dequantize":
            y = F.linear(x.bfloat16(), self.weight_bf16)
        else:
            y = int4_matmul(self.kernel, x, self.weight, self.groupsize, self.scales_and_zeros)
        y = y if self.bias is None else y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def int4_kernel_layout(kernel: str, weight: Tensor, scales: Tensor, mins: Tensor) -> tuple[Tensor, Tensor]:
    """The neutral layout, (n, k/2) packed levels and (n, k/groupsize) scales and mins, in `kernel`'s:
    tinygemm's packed weight and scales_and_zeros (k/groupsize, n, 2)."""
    # tinygemm dequantizes (q - 8) * scale + zero, so zero = min + 8 * scale
    zeros = mins.float() + 8 * scales.float()
    scales_and_zeros = torch.stack([scales.float(), zeros], -1).transpose(0, 1).contiguous().bfloat16()
    if kernel == "cuda":
        inner_k_tiles = next(t for t in (8, 4, 2) if 2 * weight.shape[1] % (t * 16) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(weight, inner_k_tiles), scales_and_zeros
    # the CPU kernel takes (n, k) int32 levels and packs them to (n, k/2) uint8, in blocks of 64 rows:
    # convert in place a block at a time, so that packing needs no memory to speak of
    for r in range(0, weight.shape[0], 64):
        weight[r: r + 64] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(weight[r: r + 64]).int(), 1)
    return weight, scales_and_zeros


def int4_matmul(kernel: str, x: Tensor, weight: Tensor, groupsize: int, scales_and_zeros: Tensor) -> Tensor:
    """x (m, k) times a weight packed for `kernel`, in bf16."""
    if kernel == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x.bfloat16(), weight, groupsize, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), weight, groupsize, scales_and_zeros)


class Int8ExpertLinears(ExpertLinears):
    """A MoE layer's stacked experts in int8: weight (n_experts, n, k), scales (n_experts, n). Dequantized
    as read: in compiled decoding that fuses into the one pass over the selected experts' bytes."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, dtype=torch.bfloat16, device=None):
        nn.Module.__init__(self)
        shape = (n_experts, out_features, in_features)
        self.register_buffer("weight", torch.empty(shape, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(n_experts, out_features, dtype=dtype, device=device))

    def expert_weights(self, experts: Tensor | None, dtype: torch.dtype) -> Tensor:
        e = slice(None) if experts is None else experts
        return self.weight[e].to(dtype) * self.scales[e].to(dtype).unsqueeze(-1)


class Int4ExpertLinears(ExpertLinears):
    """A MoE layer's stacked experts in int4: weight (n_experts, n, k/2), scales and mins (n_experts, n,
    k/groupsize) as in the file (k padded to whole groups), then each expert packed for the device's
    int4 kernel. A few rows (decoding) each take their expert's packed bytes; rows sorted by expert go
    through each expert's kernel once."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, groupsize: int, dtype=torch.bfloat16,
                 device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.padded_in = -(-in_features // groupsize) * groupsize
        shape = (n_experts, out_features)
        self.register_buffer("weight", torch.empty(*shape, self.padded_in // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(*shape, self.padded_in // groupsize, dtype=dtype, device=device))
        self.register_buffer("mins", torch.empty(*shape, self.padded_in // groupsize, dtype=dtype, device=device))
        self.kernel = None  # as Int4Linear's

    def pack(self, kernel: str):
        if kernel == "dequantize":  # bf16 experts, computed as ExpertLinears computes them
            self.weight = dequantize_int4(self.weight, self.scales, self.mins, torch.bfloat16)[..., : self.in_features]
        else:
            packed = [int4_kernel_layout(kernel, *expert) for expert in zip(self.weight, self.scales, self.mins)]
            self.weight = torch.stack([weight for weight, _ in packed])
            self.register_buffer("scales_and_zeros", torch.stack([sz for _, sz in packed]))
        del self.scales, self.mins
        self.kernel = kernel

    def forward(self, x: Tensor, experts: Tensor, ends: Tensor | None = None) -> Tensor:
        assert self.kernel is not None, "call quantize.pack_for_device(model) after loading"
        if self.kernel == "dequantize":
            return super().forward(x, experts, ends)
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if ends is None:  # a few rows, each through its own expert's packed weights (gathered by index)
            return torch.cat([self.expert_matmul(x[p: p + 1], experts[p: p + 1]) for p in range(x.shape[0])])
        if not torch.compiler.is_compiling():  # rows sorted by expert: each expert's rows in one product
            bounds = [0, *ends.tolist()]
            return torch.cat([self.expert_matmul(x[a:b], e)
                              for e, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a])
        # compiled code cannot slice by the data: every expert over all the rows, each row keeping its own
        y = x.new_zeros(x.shape[0], self.out_features)
        for e in range(self.weight.shape[0]):
            y = torch.where((experts == e).unsqueeze(1), self.expert_matmul(x, e), y)
        return y

    def expert_matmul(self, x: Tensor, expert: int | Tensor) -> Tensor:
        """x (m, k) through one expert: an index, or a 1-element tensor of one (no host sync)."""
        weight, scales_and_zeros = self.weight[expert], self.scales_and_zeros[expert]
        if isinstance(expert, Tensor):
            weight, scales_and_zeros = weight[0], scales_and_zeros[0]
        return int4_matmul(self.kernel, x, weight, self.groupsize, scales_and_zeros).to(x.dtype)


def int8_kernel(device: torch.device) -> str:
    """How int8 runs here. On CPU, compiled code's fused multiply-and-sum pays only with AVX-512, whose
    masked loads take the int8 weight a part-vector at a time; with AVX2 inductor copies each 8 bytes
    through memory first, and PyTorch's int8 kernel is faster (benchmarks/RESULTS.md, "CPUs without
    AVX-512"). On a GPU, kernels.py's, where Triton is."""
    if device.type == "cuda" and kernels:
        return "triton"
    if device.type != "cpu":
        return "dequantize"
    return "cpu-fused" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "cpu"


def int4_kernel(device: torch.device, out_features: int) -> str:
    """Which int4 kernel this device and shape can use; "dequantize" where none can."""
    if device.type == "cuda":
        ok = torch.cuda.get_device_capability(device) >= (8, 0) and out_features % 8 == 0
        return "cuda" if ok else "dequantize"
    if device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "cpu" if out_features % 16 == 0 else "dequantize"
    return "dequantize"


def linear_names(model: Transformer) -> list[str]:
    """The layers that quantization replaces: every linear, the output head included, and every MoE
    layer's stacked experts; not a MoE router, whose few weights pick the experts."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, ExpertLinears)) and not name.endswith(".router")]


def swap_linears(model: Transformer, scheme: dict):
    """Replace the layers of linear_names (nn.Linear, and MoE experts' stacked linears) by the quantized
    modules of `scheme` (the buffers are filled by loading)."""
    for name in linear_names(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        device = old.weight.device
        if isinstance(old, ExpertLinears):
            n_experts, out_features, in_features = old.weight.shape
            new = (Int8ExpertLinears(n_experts, in_features, out_features, device=device) if scheme["mode"] == "int8"
                   else Int4ExpertLinears(n_experts, in_features, out_features, scheme["groupsize"], device=device))
            setattr(parent, child, new)
            continue
        bias = old.bias is not None
        if scheme["mode"] == "int8" or name == "output":
            new = Int8Linear(old.in_features, old.out_features, bias, device=device)
        else:
            new = Int4Linear(old.in_features, old.out_features, scheme["groupsize"], bias, device=device)
        setattr(parent, child, new)


def pack_for_device(model: Transformer):
    """Choose each quantized module's kernel for its device, once, and give int4 weights that kernel's
    layout; say once if some int4 layers have no kernel here."""
    from tqdm import tqdm

    fallbacks = []
    int4 = [m for m in model.modules() if isinstance(m, (Int4Linear, Int4ExpertLinears))]
    progress = tqdm(total=len(int4), desc="packing int4 weights", unit="layer", leave=False, disable=not int4)
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear) and m.kernel is None:
            m.pack(int8_kernel(m.weight.device))
        elif isinstance(m, (Int4Linear, Int4ExpertLinears)) and m.kernel is None:
            progress.update()
            kernel = int4_kernel(m.weight.device, m.out_features)
            m.pack(kernel)
            if kernel == "dequantize":
                fallbacks.append(name)
    progress.close()
    if fallbacks:
        print(f"note: no int4 kernel here for {len(fallbacks)} layers (e.g. {fallbacks[0]}): they run as "
              f"bf16 matmuls of dequantized weights, correct but not faster", file=sys.stderr)


def int4_groupsize(scheme: dict | None) -> int | None:
    """The group size of an int4 scheme, None for any other."""
    return scheme["groupsize"] if scheme and scheme["mode"] == "int4" else None


# ---------------------------------------------------------------------------------------------
# Writing a quantized checkpoint, one tensor at a time


def output_path(checkpoint_path: Path, mode: str, groupsize: int) -> Path:
    suffix = "int8" if mode == "int8" else f"{mode}.g{groupsize}"
    return checkpoint_path.with_name(f"{checkpoint_path.stem}_{suffix}.safetensors")


def output_file(output: Path | None, checkpoint_path: Path, mode: str, groupsize: int) -> Path:
    """Where a quantized copy goes: --output (a folder: output_path's name in it), else beside the
    checkpoint; never over the checkpoint itself, nor into a folder that is not there."""
    default = output_path(checkpoint_path, mode, groupsize)
    if output is None:
        return default
    output = resolve_output(output, default.name)
    if output.resolve() == checkpoint_path.resolve():
        raise UserError(f"--output {output} is the checkpoint being quantized: name another file")
    return output


def quantized_group(name: str, read, shape: tuple, scheme: dict, gptq=None) -> Group:
    """The tensors replacing linear weight `name`, made from read() when written."""
    base = name.removesuffix(".weight")
    *rows, k = shape  # rows: (n,), or (n_experts, n) for a MoE layer's stacked experts
    if scheme["mode"] == "int8" or base == "output":
        specs = [(f"{base}.weight", torch.int8, shape), (f"{base}.scales", torch.bfloat16, tuple(rows))]
        return specs, lambda: quantize_int8(read())
    g = scheme["groupsize"]
    padded = -(-k // g) * g
    specs = [(f"{base}.weight", torch.uint8, (*rows, padded // 2)),
             (f"{base}.scales", torch.bfloat16, (*rows, padded // g)),
             (f"{base}.mins", torch.bfloat16, (*rows, padded // g))]

    def make():
        if gptq:
            return gptq.quantize(base)
        return rtn_int4(F.pad(read().float(), (0, padded - k)), g)  # zero columns: x is zero-padded to match

    return specs, make


def rtn_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor, Tensor]:
    scales, mins = int4_group_params(w, groupsize)
    # round the parameters to their stored dtype first, so the levels fit what dequantization sees
    scales, mins = scales.bfloat16(), mins.bfloat16()
    return pack_int4(quantize_int4(w, scales.float(), mins.float())), scales, mins


def quantize(checkpoint_path: Path, mode: str, groupsize: int = 32, output: Path | None = None,
             calibration_file: Path | None = None, calibration_samples: int = 32, calibration_seq_len: int = 512
             ) -> Path:
    """Write a quantized copy of a checkpoint beside it (or at output, with copies of the files read
    beside the weights), tensor by tensor."""
    checkpoint_path = resolve_checkpoint(checkpoint_path)
    if mode not in MODES:
        raise UserError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    existing = read_scheme(read_metadata(checkpoint_path))
    if existing:
        raise UserError(f"{checkpoint_path} is already quantized ({json.dumps(existing)}): quantize the unquantized "
                        f"checkpoint it came from")
    if mode == "int4-gguf" and groupsize != 32:
        raise UserError("int4-gguf keeps the GGUF's Q4_1 groups of 32: leave out --groupsize")
    if mode == "int4-gptq" and min(calibration_samples, calibration_seq_len) < 1:
        raise UserError("GPTQ needs at least one calibration sample of at least one token")
    if mode not in ("int8", "int4-gguf") and groupsize not in GROUPSIZES:
        raise UserError(f"groupsize {groupsize} is not one the int4 kernels take: choose one of {GROUPSIZES}")
    output = output_file(output, checkpoint_path, mode, groupsize)
    if mode == "int4-gguf":
        import_gguf_int4(checkpoint_path, output)
        copy_companions(checkpoint_path, output.parent)
        return output
    config = load_config(checkpoint_path)
    source = safe_open(str(checkpoint_path), framework="pt")
    with torch.device("meta"):
        model = Transformer(config)
    linears = {f"{n}.weight" for n in linear_names(model)}
    gptq = None
    if mode == "int4-gptq" and config.n_experts:
        raise UserError("GPTQ is not implemented for mixture-of-experts models: use --mode int4 (round to nearest)")
    if mode == "int4-gptq":
        gptq = GPTQ(source, checkpoint_path.parent, config, groupsize, calibration_file,
                    calibration_samples, calibration_seq_len)

    scheme = {"mode": "int8"} if mode == "int8" else {"mode": "int4", "groupsize": groupsize}
    scheme.update(method=mode, head="int8")
    groups = []
    for name, tensor in model.state_dict().items():
        # a tied head is quantized from the embedding table, which itself stays bf16 for lookups
        stored = "tok_embeddings.weight" if name == "output.weight" and config.tie_embeddings else name
        if stored not in source.keys() or tuple(source.get_slice(stored).get_shape()) != tuple(tensor.shape):
            raise UserError(f"{checkpoint_path} does not fit its model_config.json at {stored}: convert it again")
        read = lambda stored=stored: source.get_tensor(stored)  # noqa: E731 (read when written)
        if name in linears:
            groups.append(quantized_group(name, read, tuple(tensor.shape), scheme, gptq))
        else:
            groups.append(single(name, torch.bfloat16, tensor.shape, lambda read=read: read().bfloat16()))
    write_safetensors(output, groups, {"quantization": json.dumps(scheme), "source": str(checkpoint_path)},
                      desc=f"quantizing to {mode}")
    copy_companions(checkpoint_path, output.parent)
    return output


# ---------------------------------------------------------------------------------------------
# GPTQ (Frantar et al., 2022): round each column to int4, then spread its rounding error over the
# columns not yet rounded, weighted by the inverse Hessian of the layer's inputs, so the layer's
# output moves as little as possible on the calibration data.


class GPTQ:
    """Quantizes a checkpoint's linears layer by layer: a layer's Hessians come from the calibration
    activations entering it, and its quantized output feeds the next. Only one layer's weights and
    the activations are in memory at a time."""

    def __init__(self, source, checkpoint_dir: Path, config: ModelArgs, groupsize: int,
                 calibration_file: Path | None = None, n_samples: int = 32, seq_len: int = 512):
        self.source, self.config, self.groupsize = source, config, groupsize
        tokens = calibration_tokens(checkpoint_dir, calibration_file, n_samples * seq_len)
        embeddings = source.get_tensor("tok_embeddings.weight").float()
        # (n_samples, T, dim), scaled as the model scales its embeddings (Gemma)
        self.hidden = F.embedding(tokens.view(n_samples, seq_len), embeddings) * config.embedding_scale
        self.global_rope, self.local_rope = rope_tables(config, seq_len)
        self.results, self.layer = {}, -1

    def quantize(self, name: str) -> tuple[Tensor, Tensor, Tensor]:
        """Packed levels, scales and mins of linear `name` (e.g. layers.3.attention.wqkv)."""
        layer = int(name.split(".")[1])
        if layer != self.layer:  # the writer asks for layers in order
            self.quantize_layer(layer)
        return self.results.pop(name)

    @torch.no_grad()
    def quantize_layer(self, i: int):
        prefix = f"layers.{i}."
        block = TransformerBlock(self.config, i)
        block.load_state_dict({k: self.source.get_tensor(prefix + k).float() for k in block.state_dict()})
        linears = {prefix + n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        hessians = {name: torch.zeros(m.in_features, m.in_features) for name, m in linears.items()}

        def accumulate(name):
            def hook(module, args):
                x = args[0].reshape(-1, module.in_features).float()
                hessians[name].addmm_(x.T, x)  # sum of x x^T; its scale does not matter to GPTQ
            return hook

        hooks = [m.register_forward_pre_hook(accumulate(name)) for name, m in linears.items()]
        self.run(block, i)
        for h in hooks:
            h.remove()
        for name, m in linears.items():
            w = m.weight.float()
            padded = -(-w.shape[1] // self.groupsize) * self.groupsize
            packed, scales, mins = gptq_int4(F.pad(w, (0, padded - w.shape[1])),
                                             F.pad(hessians[name], (0, padded - w.shape[1]) * 2), self.groupsize)
            self.results[name] = packed, scales, mins
            m.weight.copy_(dequantize_int4(packed, scales, mins)[:, : w.shape[1]])
        self.hidden = self.run(block, i)  # the next layer sees this layer's quantized output
        self.layer = i

    def run(self, block: TransformerBlock, layer: int) -> Tensor:
        """The block's output for the calibration samples, 8 at a time."""
        n, T, _ = self.hidden.shape
        c = self.config
        sliding = c.is_sliding(layer)
        rope, window = (self.local_rope, c.sliding_window) if sliding else (self.global_rope, None)
        outputs = []
        for x in self.hidden.split(8):
            # a cache of the rows at hand: the last part of the samples may be fewer than 8
            block.attention.kv_cache = KVCache(x.shape[0], T, c.n_local_heads, c.head_dim, torch.float32)
            input_pos = torch.arange(T).expand(x.shape[0], T)  # also the position in each cache slot
            outputs.append(block(x, input_pos, rope[input_pos], attention_mask(input_pos, input_pos, window)))
        return torch.cat(outputs)


def gptq_int4(w: Tensor, hessian: Tensor, groupsize: int, blocksize: int = 128, damping: float = 0.01
              ) -> tuple[Tensor, Tensor, Tensor]:
    """w (n, k) -> packed levels, scales and mins as rtn_int4 gives, rounded GPTQ's way."""
    w, H = w.clone().float(), hessian.clone().double()
    n, k = w.shape
    dead = H.diagonal() == 0  # inputs that were always zero (padding, say): their weights do not matter
    H[dead, dead] = 1
    w[:, dead] = 0
    H.diagonal().add_(damping * H.diagonal().mean())  # keeps H invertible and the updates tame
    # the upper Cholesky factor of H^-1 gives each column's update row in order
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    levels = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, k // groupsize, dtype=torch.bfloat16)
    mins = torch.zeros_like(scales)
    blocksize = max(blocksize, groupsize)  # a group's parameters are set from columns of one block
    for b0 in range(0, k, blocksize):
        b1 = min(b0 + blocksize, k)
        wb, hb = w[:, b0:b1], h_inv[b0:b1, b0:b1]  # wb is a view: updates land in w
        errors = torch.zeros(n, b1 - b0)
        for j in range(b1 - b0):
            col = b0 + j
            if col % groupsize == 0:  # parameters from the group's columns as already updated
                s, m = int4_group_params(wb[:, j: j + groupsize], groupsize)
                scales[:, col // groupsize], mins[:, col // groupsize] = s[:, 0].bfloat16(), m[:, 0].bfloat16()
            s, m = scales[:, col // groupsize].float(), mins[:, col // groupsize].float()
            q = torch.round((wb[:, j] - m) / s).clamp(0, 15)
            levels[:, col] = q.to(torch.uint8)
            errors[:, j] = (wb[:, j] - (q * s + m)) / hb[j, j]
            wb[:, j:] -= errors[:, j: j + 1] * hb[j: j + 1, j:]
        w[:, b1:] -= errors @ h_inv[b0:b1, b1:]
    return pack_int4(levels), scales, mins


def calibration_tokens(checkpoint_dir: Path, calibration_file: Path | None, n_tokens: int) -> Tensor:
    """n_tokens of calibration text: the user's file, or Python's own documentation."""
    if calibration_file is not None:
        if not Path(calibration_file).is_file():
            raise UserError(f"calibration file {calibration_file} does not exist")
        text = Path(calibration_file).read_text(errors="replace")
    else:
        text = python_docs_text("calibration")
    tokens = load_tokenizer(checkpoint_dir).encode(text)
    if len(tokens) < n_tokens:
        raise UserError(f"the calibration text has {len(tokens)} tokens; GPTQ needs {n_tokens} "
                        f"(n_samples x seq_len): give a longer --calibration_file")
    return torch.tensor(tokens[:n_tokens])


def python_docs_text(part: str) -> str:
    """English text every CPython ships (pydoc's topic help): its first half for calibration, the
    second held out for evaluation, so that a scheme is never scored on the text it was fitted to."""
    from pydoc_data.topics import topics

    names, halves = sorted(topics), ("calibration", "held-out")
    assert part in halves, part
    half = names[: len(names) // 2] if part == "calibration" else names[len(names) // 2:]
    return "\n\n".join(topics[name] for name in half)


# ---------------------------------------------------------------------------------------------
# The bundled GGUF's Q4_1 weights, imported without loss


def import_gguf_int4(checkpoint_path: Path, output: Path):
    """For a checkpoint imported from a GGUF file: llama.cpp's Q4_1 (blocks of 32: scale d, min m,
    levels q, w = d * q + m) is our int4 layout at groupsize 32, so its linears are copied from the
    GGUF, not re-quantized: the file holds its levels and fp16 scales and mins exactly (at run time the
    int4 kernels take scales and zeros in bf16, to which these round: about 2^-9 of each, relative).
    The head is int8 as in every mode."""
    import gguf

    from convert import gguf_names, unpermute_rows

    gguf_path = read_metadata(checkpoint_path).get("source", "")
    if not gguf_path.endswith(".gguf") or not Path(gguf_path).is_file():
        raise UserError(f"{checkpoint_path} was not imported from a GGUF file that is still there")
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    config = load_config(checkpoint_path)

    def q4_1(name: str, heads: int | None) -> list[Tensor]:
        t = tensors[name]
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            raise UserError(f"{name} is {t.tensor_type.name}, not Q4_1: this GGUF has no lossless int4 import")
        blocks = torch.from_numpy(t.data.copy()).view(t.data.shape[0], -1, 20)  # (rows, k/32, 20 bytes)
        d, m, qs = blocks[..., :2], blocks[..., 2:4], blocks[..., 4:]
        levels = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(blocks.shape[0], -1)  # low nibbles first
        d, m = (x.contiguous().view(torch.float16)[..., 0] for x in (d, m))  # (rows, k/32) each
        parts = [pack_int4(levels), d, m]
        return parts if heads is None else [unpermute_rows(p, heads) for p in parts]

    source = safe_open(str(checkpoint_path), framework="pt")
    with torch.device("meta"):
        model = Transformer(config)
    linears, sources = {f"{n}.weight" for n in linear_names(model)}, gguf_names(config)
    groups = []
    for name, tensor in model.state_dict().items():
        if name == "output.weight":  # our checkpoint keeps a tied head as the embedding table only
            stored = "tok_embeddings.weight" if config.tie_embeddings else name
            read = lambda: source.get_tensor(stored)  # noqa: E731
            groups.append(quantized_group(name, read, tuple(tensor.shape), {"mode": "int8"}))
        elif name in linears:
            base, (n, k) = name.removesuffix(".weight"), tensor.shape
            specs = [(f"{base}.weight", torch.uint8, (n, k // 2)), (f"{base}.scales", torch.float16, (n, k // 32)),
                     (f"{base}.mins", torch.float16, (n, k // 32))]
            parts = sources[name]
            groups.append((specs, lambda parts=parts: [torch.cat(p) for p in zip(*(q4_1(*g) for g in parts))]))
        else:
            read = lambda name=name: source.get_tensor(name).bfloat16()  # noqa: E731
            groups.append(single(name, torch.bfloat16, tensor.shape, read))
    scheme = {"mode": "int4", "groupsize": 32, "method": "gguf-q4_1", "head": "int8"}
    write_safetensors(output, groups, {"quantization": json.dumps(scheme), "source": str(gguf_path)},
                      desc="importing Q4_1")


def read_scheme(metadata: dict[str, str]) -> dict | None:
    """The quantization scheme recorded in a checkpoint's metadata, or None for an unquantized one."""
    scheme = metadata.get("quantization")
    return json.loads(scheme) if scheme else None


def main(args):
    checkpoint_path = args.checkpoint_path
    if checkpoint_path is None:
        from convert import bundled_checkpoint

        checkpoint_path = bundled_checkpoint()
    path = quantize(checkpoint_path, args.mode, args.groupsize, args.output, args.calibration_file,
                    args.calibration_samples, args.calibration_seq_len)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); run: python generate.py --checkpoint_path {path}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=None, help="default: the bundled model")
    p.add_argument("--mode", required=True,
                   help=f"one of {', '.join(MODES)} (int4-gguf: copy a GGUF import's Q4_1 weights losslessly)")
    p.add_argument("--groupsize", type=int, default=32, help=f"int4 group size, one of {GROUPSIZES}")
    p.add_argument("--calibration_file", type=Path, default=None,
                   help="text to calibrate GPTQ on (default: the documentation text that ships with Python)")
    p.add_argument("--calibration_samples", type=int, default=32, help="GPTQ: sequences of calibration text")
    p.add_argument("--calibration_seq_len", type=int, default=512, help="GPTQ: tokens per sequence")
    p.add_argument("--output", type=Path, default=None,
                   help="the file to write, or a folder for it (default: beside the checkpoint)")
    run_cli(main, p.parse_args())
