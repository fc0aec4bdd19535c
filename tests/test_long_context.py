"""A step reads only the cache slots its depth needs (decode.key_positions): the same logits as reading
the whole cache, and one compiled graph for every depth."""

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

from fastllama import cpu_decode, decode
from fastllama.errors import UserError
from fastllama.cpu_decode import FOLDED_ATTENTION_POSITIONS, SHORT_ATTENTION_KEYS
from fastllama.model import Attention, KVCache, ModelArgs, Transformer

CONFIG = dict(vocab_size=64, n_layer=2, n_head=4, n_local_heads=2, dim=32, block_size=512)


def filled_model(depths: list[int], **overrides) -> tuple[Transformer, torch.Tensor]:
    """A tiny fp32 model whose cache (400 slots) holds random prompts of the given lengths, one per row."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**CONFIG, **overrides)).eval()
    model.setup_caches(len(depths), 400)
    ids = torch.randint(0, 64, (len(depths), max(depths)))
    decode.prefill_logits(model, ids, torch.tensor(depths), decode.EAGER)
    return model, ids


def counted_decode_step(model: Transformer):
    """The model's decode step on CPU, compiled as generate() compiles it (fullgraph, fixed shapes), and the
    list each graph it compiles is appended to."""
    cpu_decode.apply(model)
    torch._dynamo.reset()
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    return torch.compile(decode.decode_one_token, backend=inductor, fullgraph=True, dynamic=False), graphs


@pytest.mark.parametrize("depth", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("kv_cache_dtype", [None, torch.int8])
@torch.no_grad()
def test_reading_the_filled_slots_equals_reading_the_whole_cache(depth, kv_cache_dtype, monkeypatch):
    # row 0 at the depth, row 1 shallower: the slots read end just past row 0's position
    depths = [depth, max(1, depth - 7)]
    model, ids = filled_model(depths)
    if kv_cache_dtype is not None:
        model.setup_caches(2, 400, kv_cache_dtype=kv_cache_dtype)
        decode.prefill_logits(model, ids, torch.tensor(depths), decode.EAGER)
    x, pos = torch.tensor([[5], [9]]), torch.tensor(depths)[:, None]
    whole = model(x, pos)
    read = []  # the slots each attention call was given
    attend = Attention.attend
    monkeypatch.setattr(Attention, "attend", lambda self, q, k, v, mask: read.append(k.shape[2]) or attend(
        self, q, k, v, mask))
    for n in (depth + 1, decode.key_positions(model, depth + 1).shape[1]):
        read.clear()
        filled = model(x, pos, key_positions=model.positions[:, :n])  # the same entries rewritten
        torch.testing.assert_close(filled, whole, rtol=1e-5, atol=1e-5)
        assert read == [n] * CONFIG["n_layer"]


@torch.no_grad()
def test_compiled_decoding_reads_the_filled_slots_in_one_graph_for_every_depth(monkeypatch):
    model, _ = filled_model([300, 20])
    step, graphs = counted_decode_step(model)
    x = torch.tensor([[3], [4]])
    # depths in four blocks of a CPU's reads, up to the whole cache (400 slots: the block at 399 is cut to them)
    for depth in (20, 300, 399, 260):
        pos = torch.tensor([[depth], [20]])
        keys = decode.key_positions(model, depth + 1)
        assert keys.shape[1] == min(-(-(depth + 1) // decode.CPU_KV_BLOCK) * decode.CPU_KV_BLOCK, 400)
        eager = model(x, pos).argmax(-1)
        assert torch.equal(step(model, x, pos, keys), eager)
    assert len(graphs) == 1


@pytest.mark.skipif(cpu_decode.attention_kernel() is None, reason="the attention kernel needs AVX2 or AVX-512 and a C++ compiler")
@torch.no_grad()
def test_through_the_attention_kernel_a_step_past_4096_positions_compiles_no_second_graph():
    """Inductor's CPU code sums more than 4096 elements in another form, behind a guard on the length, so
    the compiled form's softmax over the positions compiled a second graph for a generation that crossed
    4096; in the kernel (head_dim a multiple of 16) no sum over the positions is left to the graph."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**dict(CONFIG, block_size=4700, head_dim=16))).eval()
    model.setup_caches(1, 4700)
    step, graphs = counted_decode_step(model)
    x = torch.tensor([[3]])
    for depth in (300, 4500):
        pos = torch.tensor([[depth]])
        assert torch.equal(step(model, x, pos, decode.key_positions(model, depth + 1)), model(x, pos).argmax(-1))
    assert len(graphs) == 1


def test_caches_are_sized_in_whole_blocks_up_to_the_context():
    """So that every read of a cache is whole blocks of KV_BLOCK (a part block read slowly on a GPU)."""
    assert [decode.padded_length(n, 8192) for n in (1, 256, 257, 8000)] == [256, 256, 512, 8192]
    assert decode.padded_length(390, 400) == 400  # a context of part blocks: its end, never past it


@pytest.mark.parametrize("store, bound", [(torch.int8, 0.5 / 127), (torch.float8_e4m3fn, 2 ** -4)])
def test_scaled_kv_formats_read_back_within_their_rounding(store, bound):
    """Each key and value vector comes back within half a level of its own scale (int8) or e4m3's
    relative step (fp8), and in half the bytes of bf16 (plus a scale per vector). fp8 runs on a GPU
    only (setup_caches refuses it elsewhere), but its arithmetic is the same here."""
    cache = KVCache(2, 16, 3, 64, torch.float32, store_dtype=store)
    k, v = torch.randn(2, 5, 3, 64) * torch.rand(2, 5, 3, 1) * 10, torch.randn(2, 5, 3, 64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    cache.write(pos, k, v)
    k_read, v_read = cache.read(2, 16, 0, torch.float32)
    for x, read in ((k, k_read), (v, v_read)):
        written = read[torch.arange(2)[:, None], :, pos]  # (B, T, n_kv, hd)
        scale = x.abs().amax(-1, keepdim=True)
        assert ((written - x).abs() <= bound * scale + 1e-6).all()
    assert cache.k_cache.element_size() == 1


@pytest.mark.parametrize("T", [2, 4, 5])  # 8, 16 and 20 query rows a key/value head
@torch.no_grad()
def test_compiled_verify_attention_is_written_out_up_to_its_rows_and_matches_the_math_backend(T, monkeypatch):
    """On CPU (cpu_decode.apply), a compiled forward of a few positions writes its attention out while its
    query heads times its positions number at most cpu_decode.ATTENTION_ROWS a key/value head, and calls the
    fused kernel past that: the same attention either way, under a mask of rows at different depths."""
    torch.manual_seed(0)
    attention = Attention(ModelArgs(n_head=8, n_local_heads=2, dim=512, vocab_size=64, n_layer=1))
    cpu_decode.apply(attention)
    fused_calls, fused = [], Attention.fused
    monkeypatch.setattr(Attention, "fused", lambda self, *args, **kw: fused_calls.append(1) or fused(self, *args, **kw))
    q, k, v = torch.randn(2, 8, T, 64), torch.randn(2, 2, 160, 64), torch.randn(2, 2, 160, 64)
    positions = torch.tensor([[50], [120]]) + torch.arange(T)
    mask = (torch.arange(160) <= positions[..., None]).unsqueeze(1)  # (B, 1, T, S)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch._dynamo.reset()
    compiled = torch.compile(attention.attend, fullgraph=True, dynamic=False)(q, k, v, mask)
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)
    assert bool(fused_calls) == (4 * T > cpu_decode.ATTENTION_ROWS)


@pytest.mark.parametrize("n_kv", [2, 8])
@pytest.mark.parametrize("T", [6, 40])
@torch.no_grad()
def test_attention_compiled_as_prefill_is_with_symbolic_shapes(n_kv, T):
    """Compiled as prefill is (dynamic=True, fullgraph), where the inputs' sizes are symbolic: the fused
    kernel's arguments stay plain (a symbolic enable_gqa stopped the compile, on an H200: 2026-11-26), and
    the attention is the math backend's. With T static and few (a verify step's), grouped heads take the
    folded form, the call that failed there."""
    torch.manual_seed(0)
    attention = Attention(ModelArgs(n_head=8, n_local_heads=n_kv, dim=512, vocab_size=64, n_layer=1))
    cpu_decode.apply(attention)
    q, k, v = torch.randn(1, 8, T, 64), torch.randn(1, n_kv, 160, 64), torch.randn(1, n_kv, 160, 64)
    mask = (torch.arange(160) <= torch.arange(100, 100 + T)[:, None])[None, None]  # (1, 1, T, S)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_kv != 8)
    if T <= FOLDED_ATTENTION_POSITIONS:
        torch._dynamo.mark_static(q, 2)
        torch._dynamo.mark_static(mask, 2)
    torch._dynamo.reset()
    compiled = torch.compile(attention.attend, fullgraph=True, dynamic=True)(q, k, v, mask)
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)


def test_an_fp8_cache_without_a_gpu_that_has_it_is_one_line():
    model = Transformer(ModelArgs(**CONFIG))
    with pytest.raises(UserError, match="fp8 KV cache needs a GPU with fp8"):
        model.setup_caches(1, 64, kv_cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("n_kv", [1, 2, 8])
@pytest.mark.parametrize("T", [1, 6, 16, 17, 40])
@pytest.mark.parametrize("S", [96, 160])  # at most SHORT_ATTENTION_KEYS and more
@torch.no_grad()
@pytest.mark.parametrize("on_cpu", [False, True])
def test_attention_of_every_form_matches_the_math_backend(n_kv, T, S, on_cpu):
    """Written out (one row, or few keys on CPU), the fused kernel given each key/value head's query heads as
    one head's rows (on a GPU always, on CPU for at most 16 positions) and as grouped heads (longer, on CPU):
    the same attention, under a cache mask, as PyTorch's math backend, with the GPU's choice of form and
    with the CPU's (cpu_decode.attention_path)."""
    assert 96 <= SHORT_ATTENTION_KEYS < 160 and FOLDED_ATTENTION_POSITIONS == 16  # the cases straddle them
    torch.manual_seed(0)
    attention = Attention(ModelArgs(n_head=8, n_local_heads=n_kv, dim=512, vocab_size=64, n_layer=1))
    if on_cpu:
        cpu_decode.apply(attention)
    grouped = "folded" if n_kv < 8 else "fused"
    if T == 1 or (on_cpu and S <= SHORT_ATTENTION_KEYS):
        assert attention.path(T, S) == "written"
    else:
        assert attention.path(T, S) == (grouped if not on_cpu or T <= FOLDED_ATTENTION_POSITIONS else "fused")
    q = torch.randn(2, 8, T, 64)
    k, v = (torch.randn(2, n_kv, S, 64) for _ in range(2))
    positions = torch.tensor([[50], [70]]) + torch.arange(T)  # rows at different depths
    mask = (torch.arange(S) <= positions[..., None]).unsqueeze(1)  # (B, 1, T, S)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_kv != 8)
    torch.testing.assert_close(attention.attend(q, k, v, mask), reference, rtol=1e-5, atol=1e-5)
