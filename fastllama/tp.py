"""Tensor parallelism: `torchrun --nproc_per_node=N generate.py ...` shards the model over N processes
(NCCL on GPUs, gloo on CPU).

Each rank holds a slice of every layer: attention by heads (q, k and v each split on its own head
boundary, the output projection by its input columns) and the MLP by hidden units (gate and up by
rows, down by input columns; a MoE layer's experts each the same way, its router whole). The
layers split by input columns (wo, w2) produce partial sums, added up by one all-reduce each: two
per layer and token (and one for each q/k norm over all heads, OLMoE's). Embeddings and the output
head are replicated.

A rank's model is simply a narrower model (fewer heads, a smaller MLP) whose attention and MLP
outputs are summed over the ranks: model.py knows nothing of it. `apply_tp` makes one from a model
on the meta device and says which rows of the checkpoint the rank reads; quantized layouts shard
the same way (per-row scales follow their rows; int4's per-group scales follow their columns, so a
shard must hold whole groups).
"""

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from .checkpoint import fused_parts
from .errors import UserError
from .model import Attention, FeedForward, ModelArgs, RMSNorm, Transformer
from .moe import MoEFeedForward


def maybe_init_distributed(device: str | None = None) -> tuple[int, int]:
    """(rank, world size) from torchrun's environment, with the process group started (NCCL for a CUDA
    device, gloo for the CPU; device None: CUDA when present); (0, 1) alone."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    on_gpu = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if on_gpu:
        if device not in (None, "cuda"):
            raise UserError(f"--device {device} under torchrun: each rank takes the GPU of its LOCAL_RANK, so "
                            "leave out --device or pass --device cuda")
        if not torch.cuda.is_available():
            raise UserError(f"--device {device} under torchrun, but this PyTorch has no CUDA device: leave out "
                            f"--device (the ranks then share the CPU, through gloo)")
        if world > torch.cuda.device_count():
            raise UserError(f"{world} processes but {torch.cuda.device_count()} GPUs: use --nproc_per_node "
                            f"{torch.cuda.device_count()} or fewer")
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    return rank, world


def apply_tp(model: Transformer, rank: int, world: int, groupsize: int | None = None):
    """Make `model` (on the meta device, before its weights are loaded) this rank's slice: 1/world of
    each layer's heads and MLP, their outputs summed over the ranks. Returns the checkpoint reader's
    selector for the rank's rows (checkpoint.read_safetensors). groupsize: of an int4 checkpoint,
    whose shards must hold whole groups."""
    check_divisible(model.config, world, groupsize)
    full, model.config = model.config, local_config(model.config, world)
    for i, layer in enumerate(model.layers):
        layer.attention = Attention(model.config)
        layer.feed_forward = (MoEFeedForward if model.config.is_moe(i) else FeedForward)(
            model.config, layer.feed_forward.activation)
        if model.config.qk_norm and not model.config.qk_norm_per_head:  # norms over all heads (OLMoE)
            layer.attention.q_norm.__class__ = layer.attention.k_norm.__class__ = ShardedRMSNorm
        # the hooks sit on the modules holding wo and w2, so that quantized swaps inside keep them
        layer.attention.register_forward_hook(all_reduce)
        layer.feed_forward.register_forward_hook(all_reduce)
    return shard_selector(full, rank, world)


def check_divisible(config: ModelArgs, world: int, groupsize: int | None = None):
    """A clear error, naming the world sizes that work, when the model does not split `world` ways."""
    def fits(w):
        if w == 1:  # one process takes any shape (int4 pads its columns to whole groups)
            return True
        hidden = [config.intermediate_size] + [config.moe_intermediate_size] * (config.n_experts > 0)
        ok = config.n_head % w == 0 and config.n_local_heads % w == 0 and all(h % w == 0 for h in hidden)
        if groupsize:  # wo's and w2's shards split their input columns: each must hold whole int4 groups
            ok &= all((k // w) % groupsize == 0 for k in [config.n_head * config.head_dim, *hidden])
        return ok

    if not fits(world):
        sizes = [w for w in range(1, config.n_head + 1) if fits(w)]
        experts = f", experts' MLPs of {config.moe_intermediate_size}" if config.n_experts else ""
        groups = f", int4 groups of {groupsize}" if groupsize else ""
        raise UserError(f"this model ({config.n_head} heads, {config.n_local_heads} key/value heads, MLP of "
                        f"{config.intermediate_size}{experts}{groups}) does not split {world} ways; world sizes "
                        f"that work: {sizes}")


def local_config(config: ModelArgs, world: int) -> ModelArgs:
    """The shape of one rank's slice: a model with 1/world of the heads and of the MLP."""
    moe = config.moe_intermediate_size
    return dataclasses.replace(config, n_head=config.n_head // world, n_local_heads=config.n_local_heads // world,
                               intermediate_size=config.intermediate_size // world,
                               moe_intermediate_size=moe // world if moe else None)


def shard_selector(config: ModelArgs, rank: int, world: int):
    """For the checkpoint reader: tensor name -> (dim, [(start, stop), ...]) of this rank's pieces, or
    None for a replicated tensor. Ranges are in units of the tensor's own dimension, so the same rule
    serves a bf16 weight, an int4 weight of k/2 bytes a row, and per-group scales."""
    def select(name: str, shape: tuple) -> tuple[int, list[tuple[int, int]]] | None:
        if not name.startswith("layers."):
            return None
        layer, module = int(name.split(".")[1]), ".".join(name.split(".")[2:4])
        parts = fused_parts(config, layer)
        # a MoE layer's experts are stacked: their rows and columns lie one dimension further in
        stacked = config.is_moe(layer) and module in ("feed_forward.w13", "feed_forward.w2")
        if module in parts:  # split each fused part's rows on its own boundary
            starts = [sum(parts[module][:i]) for i in range(len(parts[module]))]
            return int(stacked), [(s + rank * n // world, s + (rank + 1) * n // world)
                                  for s, n in zip(starts, parts[module])]
        if module in ("attention.wo", "feed_forward.w2") and len(shape) == 2 + stacked:  # input columns
            return 1 + stacked, [(rank * shape[-1] // world, (rank + 1) * shape[-1] // world)]
        if module in ("attention.q_norm", "attention.k_norm") and not config.qk_norm_per_head:  # over all heads
            return 0, [(rank * shape[0] // world, (rank + 1) * shape[0] // world)]
        return None

    return select


def all_reduce(module, args, output: Tensor) -> Tensor:
    """A forward hook summing a module's partial output over the ranks. A functional collective, so
    that the compiled decode step traces it; summed in fp32: one rounding to the model's dtype, not
    one per rank (the bytes are few)."""
    return funcol.all_reduce(output.float(), "sum", dist.group.WORLD).to(output.dtype)


class ShardedRMSNorm(RMSNorm):
    """An RMSNorm over a vector that lies in slices on the ranks (OLMoE normalizes all of q's heads
    together): the mean of squares is over the whole of it."""

    def mean_square(self, xf: Tensor) -> Tensor:
        total = funcol.all_reduce(xf.pow(2).sum(-1, keepdim=True), "sum", dist.group.WORLD)
        return total / (xf.shape[-1] * dist.get_world_size())


def rank_zero_first(make):
    """make() on rank 0, then on the other ranks once it has finished: for files the first call writes
    (the bundled model's conversion, a one-off quantization), so that no rank reads one half-written.
    If it fails on rank 0, every rank stops: rank 0 with its error, the others with one line saying so
    (a user error's own line on each)."""
    error = None
    if dist.get_rank() == 0:
        try:
            result = make()
        except Exception as e:  # the other ranks wait in the broadcast below: they must hear of it
            error = e
    message = [None]
    if isinstance(error, UserError):
        message = [str(error)]
    elif error is not None:
        first_line = str(error).strip().split("\n")[0]
        message = [f"rank 0 failed ({type(error).__name__}: {first_line}); its traceback says where"]
    dist.broadcast_object_list(message, src=0)
    if error is not None and not isinstance(error, UserError):
        raise error
    if message[0] is not None:
        raise UserError(message[0])
    return result if dist.get_rank() == 0 else make()


def shared_seed() -> int:
    """One seed for every rank, so that sampling draws the same tokens from the same logits."""
    # NCCL moves only GPU tensors, gloo CPU ones
    device = torch.cuda.current_device() if dist.get_backend() == "nccl" else "cpu"
    seed = torch.randint(0, 2**31, (1,), device=device)
    dist.broadcast(seed, src=0)
    return int(seed)
