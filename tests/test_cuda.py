"""The CUDA test set: every CUDA path once, on checkpoints made here (random weights of real shapes), so
that it runs on a GPU machine without the bundled model. `python -m pytest -m cuda`; skipped without a GPU.

Compiled decoding with CUDA graphs (no skips, no recompiles over three prompt lengths, no host sync in a
step), compiled prefill for any length, int8 and int4 against their dequantized weights, sampling,
speculative decoding, the attention kernels against the math backend, NCCL's all-reduce inside the
compiled step, and the benchmark ladder."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastllama import decode, quantize, speculative, tp
from fastllama.generate import compiled_steps, device_forms, generate
from fastllama.model import ModelArgs, Transformer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
benchmark = importlib.util.module_from_spec(spec)
spec.loader.exec_module(benchmark)
# a small model of a real layout: GQA 4 query heads a key/value head, head_dim 64, Llama-3's vocab shape cut down
SMALL = dict(vocab_size=4096, n_layer=4, n_head=8, n_local_heads=2, dim=512, intermediate_size=1408, block_size=2048)


def random_model(dtype=torch.bfloat16, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Transformer(ModelArgs(**{**SMALL, **overrides}))
    for weight in model.parameters():
        weight.data.normal_(0, 0.05)
    model = model.to(dtype).eval()
    device_forms(model)  # as load_model gives it: kernels.py's decode attention
    return model


def quantized(model: Transformer, mode: str) -> Transformer:
    """The model with its linears quantized (round to nearest, int4 groups of 32) and packed for CUDA."""
    return benchmark.quantized_copy(model, model.config, mode, groupsize=32)


@pytest.fixture(autouse=True)
def fresh_compilation():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def prompts(lengths, vocab=SMALL["vocab_size"]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=generator).cuda() for n in lengths]


@torch.no_grad()
def test_compiled_decode_uses_cuda_graphs_without_recompiling_or_syncing():
    model = random_model()
    eager = [generate(model, p, 24, temperature=0) for p in prompts([7, 50, 300])]
    model.setup_caches(1, 1024)  # one cache for the three: decoding at depths in two blocks of slots
    steps = compiled_steps(dynamic_prefill=True)
    compiled = [generate(model, prompts([7])[0], 24, temperature=0, steps=steps)]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled += [generate(model, p, 24, temperature=0, steps=steps) for p in prompts([7, 50, 300])[1:]]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompiles
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    for e, c, n in zip(eager, compiled, [7, 50, 300]):  # bf16: compiled code rounds differently from eager
        assert_greedy_up_to_rounding(model, c, n)
    # a replayed step makes no host sync (called as generate() calls it: other arguments would recompile)
    token, pos = compiled[0][-1:].view(1, 1).cuda(), torch.tensor([[40]], device="cuda")
    keys, sampling = decode.key_positions(model, 41), dict(temperature=0, top_k=None, top_p=None)
    for _ in range(2):
        steps.decode_one_token(model, token, pos, keys, **sampling)
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps.decode_one_token(model, token, pos, keys, **sampling)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@torch.no_grad()
def test_compiled_prefill_takes_any_length_in_one_graph():
    model = random_model(torch.float32)
    model.setup_caches(1, 1024)
    batch = prompts([9, 100, 600])  # 600: three chunks
    lengths = [torch.tensor([len(p)], device="cuda") for p in batch]
    eager = [decode.prefill_logits(model, p[None], n, decode.EAGER) for p, n in zip(batch, lengths)]
    steps = compiled_steps(dynamic_prefill=True)
    compiled = [decode.prefill_logits(model, batch[0][None], lengths[0], steps)]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled += [decode.prefill_logits(model, p[None], n, steps) for p, n in zip(batch[1:], lengths[1:])]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-3, atol=1e-3)


# Llama-3.1-8B's linear shapes (n, k): qkv, wo, gate+up, down, the head; and k = 4000, no multiple of 128
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (512, 4000)]


@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("mode", ["int8", "int4"])
@torch.no_grad()
def test_quantized_kernels_match_their_dequantized_weights(mode, n, k):
    w = torch.randn(n, k, device="cuda") * torch.randn(n, 1, device="cuda").exp()
    groupsize = 128
    if mode == "int8":
        m = quantize.Int8Linear(k, n, device="cuda")
        m.weight, m.scales = quantize.quantize_int8(w)
        reference = m.weight.float() * m.scales.float()[:, None]
    else:
        m = quantize.Int4Linear(k, n, groupsize, device="cuda")
        m.weight, m.scales, m.mins = quantize.rtn_int4(F.pad(w, (0, m.padded_in - k)), groupsize)
        reference = quantize.dequantize_int4(m.weight, m.scales, m.mins)[:, :k]
    quantize.pack_for_device(m, quantize.SCHEMES[mode].from_options(groupsize))
    int8 = "triton" if quantize.kernels else "dequantize"  # without Triton, inductor fuses the conversion
    assert m.kernel == (int8 if mode == "int8" else "cuda")
    step = torch.compile(m, fullgraph=True)
    for rows in (1, 6, 64):
        x = torch.randn(1, rows, k, device="cuda", dtype=torch.bfloat16)
        expected = F.linear(x.float(), reference)
        for y in (m(x), step(x)):
            assert y.dtype == torch.bfloat16
            assert ((y.float() - expected).abs().max() / expected.abs().max()).item() <= 2e-2, (mode, n, k, rows)


@torch.no_grad()
def test_an_iq4_linear_is_rounded_to_plain_int4_for_tinygemm():
    """A GGUF file's IQ4 weights, copied (their 4 bits stand for IQ4_LEVELS): tinygemm takes levels 0 .. 15 only,
    so packing rounds the weight to them, near it (a weight packed as it is would be far)."""
    n, k = 4096, 4096
    m = quantize.Int4Linear(k, n, 32, dtype=torch.float16, device="cuda", iq4=True)
    m.weight.copy_(torch.randint(0, 256, m.weight.shape, dtype=torch.uint8, device="cuda"))
    m.scales.copy_(torch.rand(m.scales.shape, device="cuda") / 1000 + 1e-4)
    m.mins.zero_()
    levels = torch.tensor(quantize.IQ4_LEVELS, dtype=torch.int8)
    reference = quantize.dequantize_int4(m.weight, m.scales, m.mins, levels=levels)
    m.pack(quantize.int4_kernel(m.weight.device, n))
    assert m.kernel == "cuda" and m.levels is None
    x = torch.randn(1, 6, k, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x.float(), reference)
    assert ((m(x).float() - expected).abs().max() / expected.abs().max()).item() <= 0.15


@pytest.mark.parametrize("mode", ["int8", "int4"])
@torch.no_grad()
def test_quantized_models_decode_compiled(mode):
    """Each token the compiled steps choose is the eager model's greedy one up to rounding: within 3% of
    the logits' range of the best, the eager forward reading the compiled text. Not token equality:
    random weights give near-ties (top-2 gaps of 0.001 in a range of 0.36), and int8's conversion fused
    into the compiled product rounds differently from eager's (on an H200 the 4th token parted)."""
    model = quantized(random_model(), mode)
    prompt = prompts([20])[0]
    tokens = generate(model, prompt, 16, temperature=0, steps=compiled_steps())
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert_greedy_up_to_rounding(model, tokens, len(prompt))


def assert_greedy_up_to_rounding(model: Transformer, tokens: torch.Tensor, n: int):
    """Each token after the first n (the prompt) is the model's greedy one up to rounding: within 3% of
    the logits' range of the best, the eager forward reading the whole text in the caches set up."""
    tokens = tokens.cuda()  # generate returns them on the host
    logits = model(tokens[None, :-1], torch.arange(len(tokens) - 1, device="cuda"))[0, n - 1:].float()  # (new, V)
    best, worst = logits.amax(-1), logits.amin(-1)
    chosen = logits.gather(-1, tokens[n:, None]).squeeze(-1)
    assert ((best - chosen) / (best - worst)).max() <= 0.03


@torch.no_grad()
def test_sampling_is_seeded_and_stays_in_the_top_k():
    model = random_model()
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(generate(model, prompts([12])[0], 20, temperature=0.8, top_k=5, steps=compiled_steps()))
    assert torch.equal(runs[0], runs[1])
    logits = torch.randn(4, 100, device="cuda")
    drawn = torch.cat([decode.sample(logits, temperature=1.0, top_k=3) for _ in range(50)], dim=1)
    assert torch.isin(drawn, logits.topk(3).indices).all()


DRAFTERS = {  # each compiles its own steps: one at a time, a lent GPU's limit cuts at most one short
    "prompt-lookup": lambda draft, head: speculative.PromptLookup(),
    "draft-model": lambda draft, head: speculative.DraftModel(draft),
    # the target's weights (seed 0) in int4 drafting for it
    "int4-self-draft": lambda draft, head: speculative.DraftModel(quantized(random_model(torch.bfloat16), "int4")),
    "draft-model-tree": lambda draft, head: speculative.DraftModel(draft, alternatives=2),  # its mask under CUDA graphs
    "draft-head": lambda draft, head: speculative.HeadDrafter(head),
    "draft-head-tree": lambda draft, head: speculative.HeadDrafter(head, alternatives=2),
}


@pytest.mark.parametrize("drafter", DRAFTERS)
@torch.no_grad()
def test_speculative_decoding_gives_the_targets_greedy_tokens(drafter):
    """Each drafter, compiled, gives the target's greedy tokens. The head's state and the verify step's
    states outlive the graph call that made them."""
    target = random_model(torch.float32)
    draft = random_model(torch.float32, seed=1, n_layer=1)
    batch = prompts([30, 45])
    batch[1][-12:] = batch[1][10:22]  # something for prompt lookup to find
    plain = generate(target, batch, 24, temperature=0)
    torch.manual_seed(2)
    head = speculative.DraftHead(speculative.DraftHead.config_for(target.config, 512), torch.arange(512)).cuda().eval()
    for out, ref in zip(generate(target, batch, 24, temperature=0, drafter=DRAFTERS[drafter](draft, head),
                                 speculate_k=4, steps=compiled_steps()), plain):
        assert torch.equal(out, ref)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("kv_cache_dtype", [torch.int8, torch.float8_e4m3fn])
@torch.no_grad()
def test_scaled_kv_caches_stay_near_the_bf16_one(kv_cache_dtype):
    if kv_cache_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    model = random_model(torch.float32)
    prompt = prompts([300])[0][None]
    logits = {}
    for dtype in (None, kv_cache_dtype):
        model.setup_caches(1, 512, kv_cache_dtype=dtype)
        decode.prefill_logits(model, prompt, torch.tensor([300], device="cuda"), decode.EAGER)
        logits[dtype] = model(prompt[:, -1:], torch.tensor([[300]], device="cuda"),
                              key_positions=decode.key_positions(model, 301))
    reference = logits[None]
    assert ((logits[kv_cache_dtype] - reference).abs().max() / reference.abs().max()).item() <= 0.05
    model.setup_caches(1, 512, kv_cache_dtype=kv_cache_dtype)
    tokens = generate(model, prompts([40])[0], 16, temperature=0, kv_cache_dtype=kv_cache_dtype,
                      steps=compiled_steps())
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert_greedy_up_to_rounding(model, tokens, 40)  # the eager forward on the same scaled cache


@torch.no_grad()
def test_a_server_step_carrying_a_prompt_is_a_plain_step_and_its_prefill():
    """serve.py's step that carries a joining prompt's chunk, compiled (CUDA graphs, every shape warmed first;
    the chunk's attention in kernels.py's kernel, over the cache's extra row): the running rows' logits are a
    plain step's, and the prompt's last logits its prefill alone's (fp32); prompts prefilled together, more
    than the warm-up ran, compile nothing more."""
    from fastllama import serve
    model = random_model(torch.float32)
    engine = serve.Engine(model, 2, 512, compiled_steps(dynamic_prefill=True), join_chunk=8)
    engine.warm()
    a, b = (p.tolist() for p in prompts([20, 13]))
    engine.prefill([a], False)  # into row 0
    plain = engine.step([a[-1], 0], [len(a), 0])  # row 1 free: at position 0, as the scheduler steps it
    joined = [engine.step([a[-1], 0], [len(a), 0], chunk) for chunk in serve.join_chunks(b, 8)]
    alone = engine.prefill([b], False)
    assert len(joined) == 2
    for logits, _ in joined:
        torch.testing.assert_close(logits[:2], plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(joined[-1][0][2:], alone, rtol=1e-4, atol=1e-4)
    # prompts together, 3 (the cache's rows, the prompt row's too) where the warm-up ran 1 and 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        engine.prefill([a, b, a[:7]], False)


@pytest.mark.parametrize("n_kv", [1, 2, 8])
@pytest.mark.parametrize("T", [1, 6, 200])
@torch.no_grad()
def test_attention_matches_the_math_backend(n_kv, T):
    """Our attention (the written-out decode step, the pinned fused kernels for more rows) against
    PyTorch's math backend, with few key/value heads and a cache mask."""
    model = random_model(n_local_heads=n_kv)
    attention = model.layers[0].attention
    q = torch.randn(2, 8, T, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, n_kv, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    positions = torch.arange(300, 300 + T, device="cuda").expand(2, -1)
    mask = (torch.arange(512, device="cuda") <= positions[..., None]).unsqueeze(1)  # (B, 1, T, 512)
    with sdpa_kernel([SDPBackend.MATH]):
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                   enable_gqa=n_kv != 8)
    for ours in (attention.attend(q, k, v, mask), torch.compile(attention.attend, fullgraph=True)(q, k, v, mask)):
        assert ((ours.float() - reference).abs().max() / reference.abs().max()).item() <= 2e-2


@pytest.mark.parametrize("T", [6, 200])
@torch.no_grad()
def test_grouped_attention_with_a_mask_needs_no_math_backend(T, monkeypatch):
    """Prefill and verify steps of a model with grouped key/value heads, with a mask: their query heads
    folded per key/value head, the memory-efficient kernel takes them (with the math backend
    disallowed, SDPA would raise "No available kernel" otherwise), eager and compiled for any length, with
    the math backend's results."""
    monkeypatch.setattr("fastllama.model.SDPA_BACKENDS", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    attention = random_model(n_local_heads=2).layers[0].attention
    q = torch.randn(1, 8, T, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = (torch.arange(512, device="cuda") <= torch.arange(300, 300 + T, device="cuda")[:, None])[None, None]
    with sdpa_kernel([SDPBackend.MATH]):
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    for attend in (attention.attend, torch.compile(attention.attend, fullgraph=True, dynamic=True)):
        assert ((attend(q, k, v, mask).float() - reference).abs().max() / reference.abs().max()).item() <= 2e-2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.no_grad()
def test_nccl_all_reduce_inside_the_compiled_step(monkeypatch):
    """World size 1 under NCCL: the all-reduce hooks are traced into the CUDA-graphed step, and give the
    unsharded model's tokens."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        plain = random_model(torch.float32)
        with torch.device("meta"):
            sharded = Transformer(plain.config)
        tp.apply_tp(sharded, rank=0, world=1)
        sharded.load_state_dict(plain.state_dict(), assign=True)
        prompt = prompts([25])[0]
        expected = generate(plain, prompt, 16, temperature=0)
        assert torch.equal(generate(sharded.eval(), prompt, 16, temperature=0, steps=compiled_steps()), expected)
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    finally:
        dist.destroy_process_group()


def test_benchmark_ladder_on_a_small_shape(tmp_path):
    out = tmp_path / "ladder.json"
    run = subprocess.run([sys.executable, "scripts/benchmark.py", "--model", "SmolLM2-135M", "--random-weights",
                          "--device", "cuda", "--prompt_length", "16", "--max_new_tokens", "16", "--runs", "1",
                          "--quantized", "int8", "int4", "--hf-compile", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for name in ("ours bf16 compiled", "ours int8 (in memory) compiled", "ours int4 g32 (in memory) compiled",
                 "HF bf16 static cache + compile"):
        assert rows[name]["ms_per_token"] > 0, name
