"""Weight-only quantization, written once into a checkpoint and loaded straight into quantized modules.

    python quantize.py --checkpoint_path checkpoints/X/model.safetensors --mode int8
    python quantize.py --checkpoint_path checkpoints/X/model.safetensors --mode int4 --groupsize 32
    python quantize.py --checkpoint_path checkpoints/X/model.safetensors --mode int4-gptq --groupsize 64

Modes: int8 (per output channel, symmetric), int4 (per group of `groupsize` input columns,
asymmetric, round to nearest) and int4-gptq (the same format, with GPTQ's error-compensating
rounding, calibrated layer by layer). The output head is int8 in every mode: it is the largest
single matrix of small models and int4 costs it the most accuracy. Embeddings stay bf16 (a step
reads one row of them).

Layouts in the file are device-neutral: int8 `weight` (n, k) with `scales` (n,); int4 `weight` uint8
(n, k/2), two 4-bit values a byte, high nibble first, with `scales` and `mins` (n, k/groupsize),
where w = q * scale + min. `pack_for_device` turns int4 into the layout of the device's kernel at
load. The scheme is recorded in the file's safetensors metadata, never parsed from its name.
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

from checkpoint import Group, check_checkpoint_path, load_config, single, write_safetensors
from model import Transformer, UserError

GROUPSIZES = (32, 64, 128, 256)
MODES = ("int8", "int4", "int4-gptq")


# ---------------------------------------------------------------------------------------------
# Quantizing a weight


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (n, k) -> int8 q (n, k) and bf16 scales (n,) with w ~ q * scale."""
    w = w.float()
    scales = (w.abs().amax(dim=1).clamp(min=1e-8) / 127).bfloat16()  # rounded first: q fits the stored scale
    return torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8), scales


def int4_group_params(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor]:
    """Per-group scale and min of w (n, k): 16 levels from each group's min to its max."""
    groups = w.float().reshape(w.shape[0], -1, groupsize)
    lo, hi = groups.amin(-1), groups.amax(-1)
    return ((hi - lo) / 15).clamp(min=1e-8), lo  # (n, k/groupsize) each


def quantize_int4(w: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """w (n, k) -> levels 0..15 (n, k) as uint8, for per-group scales and mins (n, k/groupsize)."""
    groupsize = w.shape[1] // scales.shape[1]
    scales, mins = scales.repeat_interleave(groupsize, 1), mins.repeat_interleave(groupsize, 1)
    return torch.round((w.float() - mins) / scales).clamp(0, 15).to(torch.uint8)


def pack_int4(q: Tensor) -> Tensor:
    """(n, k) levels 0..15 -> (n, k/2) uint8, high nibble first (CUDA's int4pack input layout)."""
    return (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)


def unpack_int4(packed: Tensor) -> Tensor:
    """(n, k/2) uint8 -> (n, k) levels 0..15 as uint8."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    groupsize = 2 * packed.shape[1] // scales.shape[1]
    q = unpack_int4(packed).float()
    return q * scales.float().repeat_interleave(groupsize, 1) + mins.float().repeat_interleave(groupsize, 1)


# ---------------------------------------------------------------------------------------------
# Quantized modules: the model does not know it is quantized


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu":
            if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1:
                # inductor fuses this into one loop that reads int8 and dequantizes in registers: at one
                # row it beats _weight_int8pack_mm on large weights (see generate.CPUDecodeLinear)
                return ((x.unsqueeze(-2).float() * self.weight.float()).sum(-1) * self.scales).to(x.dtype)
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, self.scales)
            return y.reshape(*x.shape[:-1], self.out_features)
        # compiled, inductor fuses the int8 -> x.dtype conversion into the matmul
        return F.linear(x, self.weight.to(x.dtype)) * self.scales


class Int4Linear(nn.Module):
    """Groupwise int4. Holds the neutral layout until `pack(device)`, then the kernel's layout."""

    def __init__(self, in_features: int, out_features: int, groupsize: int, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.padded_in = -(-in_features // groupsize) * groupsize  # k padded to whole groups
        groups = self.padded_in // groupsize
        self.register_buffer("weight", torch.empty(out_features, self.padded_in // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("mins", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.kernel = None  # "cuda", "cpu", or "dequantize" once packed

    def pack(self, kernel: str):
        """Turn the neutral layout into `kernel`'s: tinygemm's packed weight and scales_and_zeros."""
        if kernel == "dequantize":
            self.register_buffer("weight_bf16", dequantize_int4(self.weight, self.scales, self.mins).bfloat16())
            del self.weight
        else:
            # tinygemm dequantizes (q - 8) * scale + zero, so zero = min + 8 * scale; (k/groupsize, n, 2)
            zeros = self.mins.float() + 8 * self.scales.float()
            scales_and_zeros = torch.stack([self.scales.float(), zeros], -1).transpose(0, 1).contiguous()
            self.register_buffer("scales_and_zeros", scales_and_zeros.bfloat16())
            if kernel == "cuda":
                inner_k_tiles = next(t for t in (8, 4, 2) if self.padded_in % (t * 16) == 0)
                self.weight = torch.ops.aten._convert_weight_to_int4pack(self.weight, inner_k_tiles)
            else:
                self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    unpack_int4(self.weight).to(torch.int32), 1)
        del self.scales, self.mins
        self.kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        assert self.kernel is not None, "call quantize.pack_for_device(model) after loading"
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if self.kernel == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(x.bfloat16(), self.weight, self.groupsize, self.scales_and_zeros)
        elif self.kernel == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), self.weight, self.groupsize,
                                                            self.scales_and_zeros)
        else:
            y = F.linear(x.bfloat16(), self.weight_bf16)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def int4_kernel(device: torch.device, out_features: int) -> str:
    """Which int4 kernel this device and shape can use; "dequantize" where none can."""
    if device.type == "cuda":
        ok = torch.cuda.get_device_capability(device) >= (8, 0) and out_features % 8 == 0
        return "cuda" if ok else "dequantize"
    if device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "cpu"
    return "dequantize"


def linear_names(model: Transformer) -> list[str]:
    """The linears that quantization replaces: all of them, the output head included."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def swap_linears(model: Transformer, scheme: dict):
    """Replace nn.Linear by the quantized modules of `scheme` (the buffers are filled by loading)."""
    for name in linear_names(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        device = old.weight.device
        if scheme["mode"] == "int8" or name == "output":
            new = Int8Linear(old.in_features, old.out_features, device=device)
        else:
            new = Int4Linear(old.in_features, old.out_features, scheme["groupsize"], device=device)
        setattr(parent, child, new)


def pack_for_device(model: Transformer):
    """Give each int4 module the layout of its device's kernel; say once if some fall back."""
    fallbacks = []
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear) and m.kernel is None:
            kernel = int4_kernel(m.weight.device, m.out_features)
            m.pack(kernel)
            if kernel == "dequantize":
                fallbacks.append(name)
    if fallbacks:
        print(f"note: no int4 kernel here for {len(fallbacks)} layers (e.g. {fallbacks[0]}): they run as "
              f"bf16 matmuls of dequantized weights, correct but not faster", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Writing a quantized checkpoint, one tensor at a time


def output_path(checkpoint_path: Path, mode: str, groupsize: int) -> Path:
    suffix = {"int8": "int8", "int4": f"int4.g{groupsize}", "int4-gptq": f"int4-gptq.g{groupsize}"}[mode]
    return checkpoint_path.with_name(f"{checkpoint_path.stem}_{suffix}.safetensors")


def quantized_group(name: str, read, shape: tuple, scheme: dict, gptq=None) -> Group:
    """The tensors replacing linear weight `name`, made from read() when written."""
    base = name.removesuffix(".weight")
    n, k = shape
    if scheme["mode"] == "int8" or base == "output":
        specs = [(f"{base}.weight", torch.int8, (n, k)), (f"{base}.scales", torch.bfloat16, (n,))]
        return specs, lambda: quantize_int8(read())
    g = scheme["groupsize"]
    padded = -(-k // g) * g
    specs = [(f"{base}.weight", torch.uint8, (n, padded // 2)), (f"{base}.scales", torch.bfloat16, (n, padded // g)),
             (f"{base}.mins", torch.bfloat16, (n, padded // g))]

    def make():
        w = F.pad(read().float(), (0, padded - k))  # zero columns: x is zero-padded to match
        return gptq.quantize(base, w) if gptq else rtn_int4(w, g)

    return specs, make


def rtn_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor, Tensor]:
    scales, mins = int4_group_params(w, groupsize)
    # round the parameters to their stored dtype first, so the levels fit what dequantization sees
    scales, mins = scales.bfloat16(), mins.bfloat16()
    return pack_int4(quantize_int4(w, scales.float(), mins.float())), scales, mins


def quantize(checkpoint_path: Path, mode: str, groupsize: int = 32, output: Path | None = None,
             calibration_file: Path | None = None) -> Path:
    """Write a quantized copy of a checkpoint beside it, tensor by tensor."""
    checkpoint_path = Path(checkpoint_path)
    check_checkpoint_path(checkpoint_path)
    if mode not in MODES:
        raise UserError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode != "int8" and groupsize not in GROUPSIZES:
        raise UserError(f"groupsize {groupsize} is not one the int4 kernels take: choose one of {GROUPSIZES}")
    config = load_config(checkpoint_path)
    source = safe_open(str(checkpoint_path), framework="pt")
    if read_scheme(source.metadata() or {}):
        raise UserError(f"{checkpoint_path} is already quantized ({source.metadata()['quantization']}): "
                        f"quantize the bf16 checkpoint it came from")
    output = Path(output or output_path(checkpoint_path, mode, groupsize))
    with torch.device("meta"):
        model = Transformer(config)
    linears = {f"{n}.weight" for n in linear_names(model)}
    gptq = None
    if mode == "int4-gptq":
        from gptq import GPTQ

        gptq = GPTQ(checkpoint_path, config, groupsize, calibration_file)

    scheme = {"mode": "int8" if mode == "int8" else "int4", "groupsize": groupsize, "method": mode, "head": "int8"}
    groups = []
    for name, tensor in model.state_dict().items():
        # a tied head is quantized from the embedding table, which itself stays bf16 for lookups
        stored = "tok_embeddings.weight" if name == "output.weight" and config.tie_embeddings else name
        read = lambda stored=stored: source.get_tensor(stored)  # noqa: E731 (read when written)
        if name in linears:
            groups.append(quantized_group(name, read, tuple(tensor.shape), scheme, gptq))
        else:
            groups.append(single(name, torch.bfloat16, tensor.shape, lambda read=read: read().bfloat16()))
    write_safetensors(output, groups, {"quantization": json.dumps(scheme), "source": str(checkpoint_path)},
                      desc=f"quantizing to {mode}")
    return output


def read_scheme(metadata: dict[str, str]) -> dict | None:
    """The quantization scheme recorded in a checkpoint's metadata, or None for an unquantized one."""
    scheme = metadata.get("quantization")
    return json.loads(scheme) if scheme else None


def main(args):
    path = quantize(args.checkpoint_path, args.mode, args.groupsize, args.output, args.calibration_file)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); run: python generate.py --checkpoint_path {path}")


if __name__ == "__main__":
    from generate import run_cli

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, required=True)
    p.add_argument("--mode", required=True, help=f"one of {', '.join(MODES)}")
    p.add_argument("--groupsize", type=int, default=32, help=f"int4 group size, one of {GROUPSIZES}")
    p.add_argument("--calibration_file", type=Path, default=None,
                   help="text to calibrate GPTQ on (default: the documentation text that ships with Python)")
    p.add_argument("--output", type=Path, default=None)
    run_cli(main, p.parse_args())
