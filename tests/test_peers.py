"""scripts/peers.py: gpt-fast's own code on our weights decodes what ours and HF's do, its own int8 computes
close to ours, and what it cannot run is one line. Needs a gpt-fast checkout (GPT_FAST_PATH, default the one
beside the repository in shared/peers/), skipped without one: CI's clean clone has none."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastllama.errors import UserError
from fastllama.generate import generate
from fastllama.model import ModelArgs, Transformer
from shapes import shape

REPO = Path(__file__).parent.parent
GPT_FAST = Path(os.environ.get("GPT_FAST_PATH", Path(__file__).parents[2] / "shared/peers/gpt-fast"))
spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
benchmark = importlib.util.module_from_spec(spec)
spec.loader.exec_module(benchmark)
peers = benchmark.peers


@pytest.fixture(scope="module")
def gf():
    if not (GPT_FAST / "generate.py").is_file():
        pytest.skip(f"no gpt-fast checkout at {GPT_FAST} (set GPT_FAST_PATH)")
    return peers.load_gpt_fast(GPT_FAST)


@pytest.fixture(scope="module")
def llama() -> Transformer:
    """Llama 3.1's kind at a small shape: grouped key/value heads, its RoPE scaling (at head_dim 16 and its base,
    frequencies in all three of its bands), random fp32 weights large enough for the tokens to vary."""
    config = ModelArgs(block_size=131072, vocab_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=128, rope_base=500000.0,
                       rope_scaling=shape("Llama-3.1-8B").rope_scaling)
    torch.manual_seed(1)
    model = Transformer(config).eval()
    with torch.no_grad():
        for weight in model.parameters():
            weight.normal_(0, 0.3)
    return model


def test_gpt_fast_ours_and_hf_decode_the_same_greedy_tokens(gf, llama):
    prompt = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(0))
    theirs = peers.gpt_fast_model(gf, llama, 8 + 16)
    # our tensors themselves, w1 and w3 the halves of our w13; only wqkv (reordered) is new
    mlp = llama.layers[0].feed_forward.w13.weight
    assert theirs.layers[0].feed_forward.w3.weight.data_ptr() == mlp[128:].data_ptr()
    assert theirs.output.weight.data_ptr() == llama.output.weight.data_ptr()
    hf = benchmark.hf_model_from(llama)
    hf.generation_config.eos_token_id = None  # its config's default (2) would end it early; the others go on

    ours = generate(llama, prompt, 16, temperature=0)[8:]
    gpt_fast = peers.runner(gf, theirs, prompt, compiled=False)(16)[0]
    hf_tokens = hf.generate(prompt[None], max_new_tokens=16, do_sample=False, pad_token_id=0)[0, 8:]
    assert len(set(ours.tolist())) > 4  # not one token over and over
    assert ours.tolist() == gpt_fast.tolist() == hf_tokens.tolist()


def test_gpt_fast_int8_is_its_own_and_close_to_ours(gf, llama):
    """Its handler's int8 (amax / 127.5, fp32 scales here) and ours (amax / 127, bf16 scales) round apart: with
    the weights of seeds 0-3 their logits (largest about 3) differed by 0.057-0.094 (0.094 at this seed, 1), each
    from the unquantized logits by 0.049-0.086; skipping wqkv's reordering made it 1.5."""
    theirs = peers.gpt_fast_quantized(gf, llama, "int8", 32, 64)
    linears = [m for m in theirs.modules() if type(m).__name__ == "WeightOnlyInt8Linear"]  # wqkv, wo, w1, w2, w3, head
    assert len(linears) == 5 * 2 + 1 and all(m.weight.dtype == torch.int8 for m in linears)
    ours = benchmark.quantized_copy(llama, llama.config, "int8", 32)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours.setup_caches(1, 64)
        torch.testing.assert_close(theirs(ids, torch.arange(24)), ours(ids, torch.arange(24)), atol=0.15, rtol=0)


def test_a_path_that_is_not_gpt_fast_is_one_line():
    ours = (REPO / "fastllama").resolve()
    with pytest.raises(UserError, match=f"^{ours} is not a gpt-fast checkout: its model.py has no transformer_configs$"):
        peers.load_gpt_fast(ours)  # ours: a model.py and a generate.py, but not gpt-fast's


def test_what_gpt_fast_cannot_run_is_one_line(gf):
    with pytest.raises(UserError, match="cannot express this model's tie_embeddings, qkv_bias: "):
        peers.gpt_fast_args(gf, shape("Qwen2.5-0.5B"))
    run = subprocess.run([sys.executable, "scripts/benchmark.py", "--model", "TinyLlama-1.1B", "--random-weights",
                          "--device", "cpu", "--no-hf", "--gpt-fast", str(GPT_FAST), "--quantized", "int4"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1].startswith("error: gpt-fast's int4 runs tinygemm")


def test_gpt_fast_rungs_run_apart(gf, tmp_path):
    """--apart with --gpt-fast: its rungs made in children of their own as ours are (compiled functions run
    eagerly: the plumbing is under test)."""
    (tmp_path / "sitecustomize.py").write_text('import torch\ntorch.compiler.set_stance("force_eager")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "ladder.json"
    run = subprocess.run([sys.executable, "scripts/benchmark.py", "--model", "TinyLlama-1.1B", "--random-weights",
                          "--device", "cpu", "--no-hf", "--apart", "--gpt-fast", str(GPT_FAST), "--quantized", "int8",
                          "--prompt_length", "4", "--max_new_tokens", "2", "--runs", "1", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [name for name in rows if name.endswith(" compiled")] == [
        "ours bf16 compiled", "ours int8 (in memory) compiled", "gpt-fast bf16 compiled", "gpt-fast int8 compiled"]
