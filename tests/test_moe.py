"""Mixture-of-experts layers beyond matching HF (tests/test_families.py does that for Mixtral,
Qwen3-MoE and OLMoE): a decode step reads only the experts its router picks, in every weight format
(eager, no op but indexing takes the stacked experts whole; eager and compiled, NaN in the others
changes nothing), and the grouped product of many tokens is what each token alone computes, compiled
too."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastllama import cpu_decode, quantize
from fastllama.model import ModelArgs, Transformer
from fastllama.moe import ExpertLinears, MoEFeedForward

CONFIG = dict(vocab_size=64, n_layer=2, dim=64, n_head=4, n_local_heads=2, block_size=64, n_experts=8,
              n_active_experts=2, moe_intermediate_size=64)


def tiny_moe(mode: str | None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**CONFIG)).eval()
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            m.router.weight.data.mul_(10)  # clear choices
    if mode is None:
        return model
    scheme = quantize.SCHEMES[mode].from_options(groupsize=32)
    state = quantize.quantized_state_dict(model, scheme)
    quantize.swap_linears(model, scheme)
    # as a fp32 model loads: floating tensors in fp32 (the file keeps bf16)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, assign=True)
    quantize.pack_for_device(model, scheme)
    return model


class WholeReads(TorchDispatchMode):
    """The ops, other than indexing, that take one of `tensors` whole as an input."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.tensors, self.ops = tensors, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        whole = any(isinstance(a, torch.Tensor) and any(a.data_ptr() == t.data_ptr() and a.numel() == t.numel()
                                                        for t in self.tensors)
                    for a in tree_leaves((args, kwargs)))
        if whole and func is not torch.ops.aten.index.Tensor:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def poison_unselected_experts(model: Transformer, x: torch.Tensor, pos: torch.Tensor) -> int:
    """NaN into the weights of every expert the router does not pick for this step; how many were."""
    picked = {}
    hooks = [m.register_forward_pre_hook(lambda m, args: picked.setdefault(m, args[0]))
             for m in model.modules() if isinstance(m, MoEFeedForward)]
    model(x, pos)  # the inputs each MoE layer sees (the cache is rewritten at the same positions after)
    for h in hooks:
        h.remove()
    poisoned = 0
    for m, hidden in picked.items():
        chosen = m.router(hidden.reshape(-1, hidden.shape[-1])).topk(m.top_k, dim=-1).indices.unique()
        others = [e for e in range(m.n_experts) if e not in chosen]
        for layer in (m.w13, m.w2):
            tensors = [t for t in [*layer.parameters(), *layer.buffers()] if t.is_floating_point()]
            assert tensors  # the int formats' weights cannot hold NaN: their scales do
            for t in tensors:
                t.data[others] = float("nan")
        poisoned += len(others)
    return poisoned


@pytest.mark.parametrize("mode", [None, "int8", "int4"])
@pytest.mark.parametrize("compiled", [False, True])
@torch.no_grad()
def test_a_decode_step_reads_only_the_selected_experts(mode, compiled):
    model = tiny_moe(mode)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    model.setup_caches(1, 32)
    model(ids[:, :11], torch.arange(11))
    x, pos = ids[:, 11:], torch.tensor([11])
    if compiled:
        cpu_decode.apply(model)
    step = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    if not compiled:  # eager: the stacked experts are only ever indexed, never read whole
        stacked = [t for m in model.modules() if isinstance(m, ExpertLinears)
                   for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]
        with WholeReads(stacked) as reads:
            model(x, pos)
        assert stacked and reads.ops == []
    before = step(x, pos)
    assert poison_unselected_experts(model, x, pos) >= 2 * (8 - 2)  # each layer: 6 of 8 poisoned
    after = step(x, pos)
    assert torch.isfinite(after).all() and torch.equal(after, before)


@pytest.mark.parametrize("mode, dtype", [(None, torch.float32), ("int4", torch.float32), (None, torch.bfloat16)])
@torch.no_grad()
def test_grouped_prefill_equals_token_by_token_and_compiles_for_any_length(mode, dtype):
    """Many tokens take the grouped product (pairs sorted by expert); one token at a time, each pair
    reads its own expert: the same numbers. Compiled with dynamic shapes, for two lengths, in one graph
    (in bf16, PyTorch's grouped matmul; compiled code cannot trace it in fp32, which takes another form)."""
    model = tiny_moe(mode) if dtype == torch.float32 else tiny_moe(mode).to(dtype)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    model.setup_caches(2, 32)
    grouped = model(ids, torch.arange(20)).float()
    one_by_one = torch.cat([model(ids[:, t: t + 1], torch.tensor([t])) for t in range(20)], dim=1).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((grouped - one_by_one).abs().max() / one_by_one.abs().max()).item() <= tolerance

    compiles = []
    prefill = torch.compile(lambda x, pos: model(x, pos), fullgraph=True, dynamic=True,
                            backend=lambda gm, inputs: compiles.append(gm) or gm)
    for n in (20, 13):
        expected = model(ids[:, :n], torch.arange(n))
        got = prefill(ids[:, :n].clone(), torch.arange(n))
        assert ((got - expected).abs().max() / expected.abs().max()).item() <= tolerance
    assert len(compiles) == 1


def test_weight_bytes_per_token_count_the_active_experts():
    from fastllama.generate import weight_bytes_per_token

    model = tiny_moe(None)
    experts = sum(p.nbytes for name, p in model.named_parameters() if ".w13." in name or ".w2." in name)
    others = sum(p.nbytes for name, p in model.named_parameters() if name != "tok_embeddings.weight") - experts
    assert weight_bytes_per_token(model) == others + experts * 2 // 8


def test_moe_configs_that_do_not_fit_are_refused_in_one_line(tmp_path):
    import json

    from fastllama.convert import config_from_hf, convert_hf_checkpoint
    from fastllama.errors import UserError
    from tests.test_families import build

    with pytest.raises(UserError, match="Qwen2MoeForCausalLM .* is not supported; supported: .*MixtralForCausalLM"):
        config_from_hf({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]})
    build("mixtral", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for n_experts in (2, 8):  # the file has 4
        (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": n_experts}))
        with pytest.raises(UserError, match=f"gate.weight has shape \\(4, 64\\), which does not fit config.json "
                                            f".*router.weight should be \\({n_experts}, 64\\)"):
            convert_hf_checkpoint(tmp_path)
    assert not list(tmp_path.glob("fastllama*"))


def test_tp_refuses_expert_mlps_that_do_not_split():
    from fastllama.errors import UserError
    from fastllama.tp import check_divisible

    config = ModelArgs(**{**CONFIG, "moe_intermediate_size": 48})
    check_divisible(config, 2)
    with pytest.raises(UserError, match="experts' MLPs of 48.*world sizes that work: \\[1, 2\\]"):
        check_divisible(config, 4)


def test_int4_experts_shard_over_two_ranks(tmp_path):
    """An int4 Mixtral's stacked experts (packed levels, per-group scales and mins) split by hidden
    units over 2 gloo ranks: the same tokens as one process, logits within the int4 kernel's bf16."""
    import subprocess
    import sys
    from pathlib import Path

    from fastllama.convert import convert_hf_checkpoint
    from tests.test_families import build, relative_error
    from tests.tp_worker import run_ids_case

    build("mixtral", tmp_path)
    path = str(quantize.quantize(convert_hf_checkpoint(tmp_path), "int4", 32))
    out = tmp_path / "out.pt"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "tests/tp_worker.py", "--ids", str(out), path],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    sharded, alone = torch.load(out)[path], run_ids_case(path)
    assert sharded["local_heads"] == 2 and sharded["tokens"] == alone["tokens"]
    assert relative_error(sharded["logits"], alone["logits"]) <= 1e-2
