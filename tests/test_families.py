"""Every supported family against Hugging Face's own implementation: a tiny random model of each,
built by transformers with the family's features switched on, saved, converted by our converter,
and compared on logits over a prefill and 60 decode steps past a sliding window of 16, on greedy
tokens, batches, quantized loads, speculative decoding and tensor parallelism.

(Compiled decoding of each family's attention variant: tests/test_cpu_decode.py.)"""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastllama import cpu_decode, speculative
from fastllama.convert import convert_hf_checkpoint
from fastllama.generate import generate, load_model

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
WINDOW = 16
CHUNK = 8  # a ring of WINDOW + CHUNK slots, which 100 positions wrap four times
LONGROPE = dict(type="longrope", short_factor=[1.0 + 0.1 * i for i in range(6)],
                long_factor=[2.0 + 0.3 * i for i in range(6)])
FAMILIES = {  # config class, model class, the family's features
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=24)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, sliding_window_pattern=2,
                    rope_scaling=dict(rope_type="linear", factor=4.0), rope_local_base_freq=100.0)),
    # RoPE on 3/4 of each head; longrope's long factors from position 64 on
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(sliding_window=WINDOW, pad_token_id=0, partial_rotary_factor=0.75,
                  original_max_position_embeddings=64, rope_scaling=LONGROPE)),
    # mixtures of experts: top-2 of 4, renormalized; top-2 of 4 with a dense layer; top-3 of 8, not renormalized
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1],
                       norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, pad_token_id=0, eos_token_id=1)),
}


def build(family: str, directory):
    """A tiny random HF model of the family, saved to directory; its norms are perturbed away from their
    initial 1 (Gemma: 0), so that a norm read wrongly shows, and its routers' weights scaled up from
    their near-uniform start."""
    config_name, model_name, features = FAMILIES[family]
    config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**TINY, **features})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("gate.weight"):  # a MoE router: clear choices, which rounding does not flip
                p.mul_(30)
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, HF model, our converted checkpoint) for each family."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, directory)
    return request.param, hf, convert_hf_checkpoint(directory)


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def with_cache(hf) -> dict:
    """forward's arguments for decoding with a new cache. transformers 5.24 (this CPU machine's) names it
    `cache` and warns that `past_key_values`, the only name of earlier versions (the GPU image's 5.17), goes
    in 5.40."""
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    return {name: transformers.DynamicCache(config=hf.config), "use_cache": True}


@torch.no_grad()
def hf_steps(hf, prompt: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """HF's logits for a prefill of prompt, then continuation fed one token at a time, with its cache."""
    cache = with_cache(hf)
    logits = [hf(prompt[None], **cache).logits[0]]
    for token in continuation:
        logits.append(hf(token.view(1, 1), **cache).logits[0])
    return torch.cat(logits)


@torch.no_grad()
def hf_greedy(hf, prompt: torch.Tensor, n: int) -> list[int]:
    cache = with_cache(hf)
    x, out = prompt[None], []
    for _ in range(n):
        x = hf(x, **cache).logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(x))
    return out


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Per position: the largest difference over the largest logit."""
    return ((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()


def test_config_features_reach_the_model(family):
    name, hf, path = family
    c = load_model(path, "cpu", "fp32").config
    sliding = {"qwen2": [2, 3], "mistral": [0, 1, 2, 3], "gemma2": [0, 2], "gemma3": [0, 2], "phi3": [0, 1, 2, 3],
               "mixtral": [0, 1, 2, 3]}.get(name)
    assert c.sliding_layers == sliding and c.sliding_window == (WINDOW if sliding else None)
    assert c.qkv_bias == (name == "qwen2") and c.qk_norm == (name in ("qwen3", "gemma3", "qwen3_moe", "olmoe"))
    assert c.qk_norm_per_head == (name != "olmoe")
    moe = {"mixtral": (4, 2, [0, 1, 2, 3], True), "qwen3_moe": (4, 2, [0, 2, 3], True), "olmoe": (8, 3, [0, 1, 2, 3], False)}
    assert (c.n_experts, c.n_active_experts, c.moe_layers, c.normalize_expert_weights) == moe.get(name, (0, 2, None, True))
    assert (c.norm_offset, c.sandwich_norms, c.activation) == ((1.0, True, "gelu_tanh") if name.startswith("gemma")
                                                               else (0.0, False, "silu"))
    assert c.head_dim == (getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads)
    assert c.rope_dim == (12 if name == "phi3" else c.head_dim)


@torch.no_grad()
def test_logits_match_hf_over_prefill_and_60_decode_steps(family):
    name, hf, path = family
    model = load_model(path, "cpu", "fp32")
    text = ids(100, seed=1)
    model.setup_caches(1, 128, chunk=CHUNK)
    logits = [model(text[None, :40], torch.arange(40))[0]]
    for t in range(40, 100):  # the sliding layers' rings wrap: depths far past the window
        logits.append(model(text[None, t: t + 1], torch.tensor([t]))[0])
    # Phi-3's longrope: HF's cache path switches to the long factors at the crossing of the original
    # context, leaving the keys before it on the short ones; its forward over the whole text takes the
    # long ones everywhere, as ours does for a cache past the original context
    reference = hf(text[None]).logits[0] if name == "phi3" else hf_steps(hf, text[:40], text[40:])
    assert relative_error(torch.cat(logits), reference) <= 1e-4


@torch.no_grad()
def test_longrope_takes_one_set_of_factors_for_the_whole_cache(tmp_path):
    """A cache within Phi-3's original context (64 here) takes the short factors at every position, a
    cache past it the long ones, as HF's forward over a text of that length does."""
    hf = build("phi3", tmp_path)
    model = load_model(convert_hf_checkpoint(tmp_path), "cpu", "fp32")
    for length, cache in ((60, 64), (100, 128)):
        text = ids(length, seed=8)
        model.setup_caches(1, cache, chunk=CHUNK)
        assert relative_error(model(text[None], torch.arange(length))[0], hf(text[None]).logits[0]) <= 1e-4


def test_greedy_matches_hf_and_a_ragged_batch_matches_each_alone(family):
    name, hf, path = family
    model = load_model(path, "cpu", "fp32")
    prompts = [ids(40, seed=2), ids(23, seed=3), ids(31, seed=4)]
    ours = generate(model, prompts[0], 32, temperature=0, prefill_chunk=CHUNK)
    assert ours[40:].tolist() == hf_greedy(hf, prompts[0], 32)
    alone = [generate(model, p, 32, temperature=0, prefill_chunk=CHUNK) for p in prompts]
    batch = generate(model, prompts, 32, temperature=0, prefill_chunk=CHUNK)
    assert [b.tolist() for b in batch] == [a.tolist() for a in alone]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_checkpoints_load_and_compute_their_weights(family, mode):
    """The quantized model equals the model whose linears hold what quantization kept of them: every
    tensor (biases and norms too) landed where it belongs."""
    from fastllama import quantize

    name, hf, path = family
    quantized = load_model(quantize.quantize(path, mode, 32), "cpu", "fp32")
    reference = load_model(path, "cpu", "fp32")
    with torch.no_grad():
        reference.output = torch.nn.Linear(TINY["hidden_size"], TINY["vocab_size"], bias=False)  # untied
        reference.output.weight.copy_(load_model(path, "cpu", "fp32").output.weight)
        linears = quantize.linear_names(reference)  # not MoE routers: they are kept in bf16 as norms are
        for name, p in reference.named_parameters():
            if name.rpartition(".")[0] not in linears:
                p.copy_(p.bfloat16())
        for module_name in linears:
            m = reference.get_submodule(module_name)  # a linear, or a MoE layer's stacked experts
            if mode == "int8" or module_name == "output":  # the head is int8 in every mode
                q, scales = quantize.quantize_int8(m.weight)
                m.weight.copy_(q.float() * scales.float()[..., None])
            else:
                k = m.weight.shape[-1]  # zero-padded to whole groups (Qwen3-MoE's experts: 48)
                padded = torch.nn.functional.pad(m.weight, (0, -k % 32))
                m.weight.copy_(quantize.dequantize_int4(*quantize.rtn_int4(padded, 32))[..., :k])
        text = ids(48, seed=5)
        for m in (reference, quantized):
            m.setup_caches(1, 64, chunk=CHUNK)
        expected, got = reference(text[None], torch.arange(48)), quantized(text[None], torch.arange(48))
    # the int kernels take bf16 activations; the int4 kernel of our own rounds them to int8 (a part in 254 of each
    # block of 32's largest) in every product, 2.4-3.9% over the whole model (gemma2, gemma3, olmoe)
    rounded = mode == "int4" and cpu_decode.rounds_activations(4)
    assert relative_error(got, expected) <= (5e-2 if rounded else 2e-2)


def test_speculative_greedy_equals_plain(family):
    from fastllama import quantize

    name, hf, path = family
    model = load_model(path, "cpu", "fp32")
    draft = speculative.DraftModel(load_model(quantize.quantize(path, "int8"), "cpu", "fp32"))
    prompts = [ids(40, seed=6), torch.cat([ids(12, seed=7)] * 3)]  # the second repeats itself: lookups find it
    plain = generate(model, prompts, 40, temperature=0, prefill_chunk=CHUNK)
    for drafter in (draft, speculative.PromptLookup()):
        fast = generate(model, prompts, 40, temperature=0, prefill_chunk=CHUNK, drafter=drafter, speculate_k=5)
        assert [f.tolist() for f in fast] == [p.tolist() for p in plain]


def test_two_ranks_match_one_process(tmp_path_factory):
    """One torchrun of 2 gloo ranks over every family's checkpoint (a launch costs seconds)."""
    checkpoints = {}
    for name in FAMILIES:
        directory = tmp_path_factory.mktemp(f"tp-{name}")
        build(name, directory)
        checkpoints[name] = str(convert_hf_checkpoint(directory))
    out = tmp_path_factory.mktemp("tp-out") / "out.pt"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "tests/tp_worker.py", "--ids", str(out)] + list(checkpoints.values()),
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    sharded = torch.load(out)
    from tests.tp_worker import run_ids_case

    for name, path in checkpoints.items():
        alone = run_ids_case(path)
        assert (alone["local_heads"], sharded[path]["local_heads"]) == (4, 2), name
        assert relative_error(sharded[path]["logits"], alone["logits"]) <= 1e-4, name
        assert sharded[path]["tokens"] == alone["tokens"], name


def test_config_json_of_each_family_is_read_not_guessed(tmp_path):
    """A Qwen2 config without use_sliding_window keeps full attention, whatever sliding_window says,
    and layer_types, where given, decide which layers slide."""
    from fastllama.convert import config_from_hf

    build("qwen2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config_from_hf({**config, "use_sliding_window": False}).sliding_window is None
    gemma = build("gemma2", tmp_path / "g")
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    types = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    assert config_from_hf({**config, "layer_types": types}).sliding_layers == [1]
    assert config_from_hf({k: v for k, v in config.items() if k != "layer_types"}).sliding_layers == [0, 2]
    assert gemma.config.final_logit_softcapping == config_from_hf(config).logit_softcap
