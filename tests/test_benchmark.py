"""scripts/benchmark.py: the HF model it compares against holds our weights, in-memory quantization
is what quantize.py writes, and the whole ladder runs end to end (compiled functions run eagerly:
the plumbing is under test here, not the speed) and writes the JSON the plot reads."""

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastllama import quantize
from fastllama.generate import load_model

REPO = Path(__file__).parent.parent
spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
benchmark = importlib.util.module_from_spec(spec)
spec.loader.exec_module(benchmark)
import ladder_models  # noqa: E402 (scripts/, on the path as benchmark.py puts it)


def test_hf_model_holds_our_weights(model_fp32):
    ids = torch.tensor([[1, 504, 3345, 314, 2451, 28, 253, 1345]])
    hf = benchmark.hf_model_from(model_fp32)
    with torch.no_grad():
        model_fp32.setup_caches(1, 64)
        ours = model_fp32(ids, torch.arange(ids.shape[1]))
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, architecture", [
    ("Qwen2.5-0.5B", "Qwen2ForCausalLM"), ("Qwen3-0.6B", "Qwen3ForCausalLM"), ("Mistral-7B-v0.1", "MistralForCausalLM"),
    ("Gemma-2-2B", "Gemma2ForCausalLM"), ("Gemma-3-12B", "Gemma3ForCausalLM"), ("Phi-3-mini", "MistralForCausalLM"),
    ("MoE-1.3B-A0.4B", "MixtralForCausalLM"), ("Qwen3-30B-A3B", "Qwen3MoeForCausalLM"), ("OLMoE-1B-7B", "OlmoeForCausalLM"),
])
def test_hf_model_of_each_family_holds_our_weights(name, architecture):
    """A family's real shape, shrunk (its variant fields kept), and the HF model the benchmark compares
    against: the same logits, so the family's row compares like with like."""
    from fastllama.model import Transformer
    from shapes import shape

    config = shape(name)
    config.n_layer, config.vocab_size, config.dim, config.intermediate_size = 3, 128, 64, 96
    config.n_head, config.n_local_heads, config.head_dim, config.rope_dim = 4, 2, 16, 16
    if config.n_experts:
        config.n_experts, config.moe_intermediate_size = 8, 32
    if config.sliding_window:  # the family's pattern of sliding layers, over the first three
        config.sliding_window, config.sliding_layers = 8, [i for i in config.sliding_layers if i < 3]
    if config.embedding_scale != 1.0:
        config.embedding_scale = 8.0
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    ids = torch.randint(0, 128, (1, 24))
    hf = benchmark.hf_model_from(model)
    assert type(hf).__name__ == architecture
    with torch.no_grad():
        model.setup_caches(1, 64)
        ours = model(ids, torch.arange(24))
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_quantized_copy_equals_the_quantized_checkpoint(bundled_checkpoint, int4_checkpoint):
    model = load_model(bundled_checkpoint, "cpu", "fp32")  # the precision the bundled checkpoint is stored in
    in_memory = benchmark.quantized_copy(model, model.config, "int4", 32)
    from_file = load_model(int4_checkpoint, "cpu", "fp32")
    linears = set(quantize.linear_names(model))  # quantize.py stores the rest in bf16; here it stays fp32
    quantized = {n: t for n, t in from_file.state_dict().items() if n.rpartition(".")[0] in linears}
    assert len(quantized) == 2 * len(linears)  # int4: packed weight and scales_and_zeros; int8 head: weight, scales
    for name, tensor in quantized.items():
        assert torch.equal(in_memory.state_dict()[name], tensor), name


def eager_everywhere(tmp_path) -> dict:
    """An environment in which every process, torchrun's workers too, runs compiled functions eagerly:
    minutes of compilation would test nothing more here."""
    (tmp_path / "sitecustomize.py").write_text('import torch\ntorch.compiler.set_stance("force_eager")\n')
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))


def test_compiled_apart_steps_are_the_decode_step_under_code_objects_of_their_own(model_fp32):
    """benchmark.compiled_apart: each call a decode step whose graphs dynamo keeps apart from every other's
    (a code object of its own), which computes what decode_one_token computes (run eagerly here)."""
    from fastllama import decode
    steps = [benchmark.compiled_apart() for _ in range(2)]
    codes = [step.__wrapped__._torchdynamo_orig_callable.__code__ for step in steps]
    assert codes[0] is not codes[1] and all(code is not decode.decode_one_token.__code__ for code in codes)
    model_fp32.setup_caches(1, 64)
    token, length, keys = torch.tensor([[1]]), torch.tensor([[0]]), decode.key_positions(model_fp32, 1)
    with torch.compiler.set_stance("force_eager"), torch.no_grad():
        expected = decode.decode_one_token(model_fp32, token, length, keys)
        assert torch.equal(steps[0](model_fp32, token, length, keys), expected)


def test_ladder_runs_end_to_end(tmp_path):
    env = eager_everywhere(tmp_path)
    out = tmp_path / "ladder.json"
    run = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--model", "SmolLM2-135M", "--random-weights", "--device", "cpu",
         "--prompt_length", "8", "--max_new_tokens", "3", "--runs", "1", "--no-hf", "--quantized", "int8", "int4",
         "--tp", "3", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert list(record["rows"]) == [
        "matmul floor (F.linear)", "floor (compiled mul-sum)", "ours bf16 eager", "ours bf16 compiled",
        "ours int8 (in memory) compiled", "ours int4 g32 (in memory) compiled",
        "ours bf16 compiled, TP 3", "ours int8 (in memory) compiled, TP 3", "ours int4 g32 (in memory) compiled, TP 3"]
    # a decode step's ms is a difference of timings (3 tokens, one run): on a loaded machine it can come out at or
    # below 0 (it did, twice in a day); the floors and the end-to-end speeds cannot
    rows = record["rows"].values()
    assert all(math.isfinite(row["ms_per_token"]) for row in rows) and all(row.get("e2e_tok_s", 1) > 0 for row in rows)
    assert all(record["rows"][floor]["ms_per_token"] > 0 for floor in ["matmul floor (F.linear)", "floor (compiled mul-sum)"])
    assert record["args"]["model"] == "SmolLM2-135M" and record["copy_bandwidth_gbs"] > 0
    for name in record["rows"]:
        assert name in run.stdout  # the printed table

    pytest.importorskip("matplotlib")
    png = tmp_path / "ladder.png"
    subprocess.run([sys.executable, "scripts/plot_ladder.py", str(out), str(png)], cwd=REPO, check=True, timeout=120)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_depths_run_end_to_end(tmp_path):
    """benchmark_depths.py: decode ms/token at each depth per KV cache format, the shallow depth again in a cache
    of its own, prefill of the deepest prompt with its peak memory (eager, as above)."""
    env = eager_everywhere(tmp_path)
    out = tmp_path / "depths.json"
    run = subprocess.run(
        [sys.executable, "scripts/benchmark_depths.py", "--model", "SmolLM2-135M", "--random-weights", "--device", "cpu",
         "--depths", "0", "40", "300", "--max_new_tokens", "3", "--runs", "1", "--quantized", "int4",
         "--kv_cache_dtype", "bf16", "int8", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
        timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["weights"], row["kv_cache"]) for row in rows] == [("int4 g32 (in memory)", "bf16"),
                                                                  ("int4 g32 (in memory)", "int8")]
    for row in rows:
        assert list(row["ms_per_token"]) == ["0", "40", "300"] and all(ms > 0 for ms in row["ms_per_token"].values())
        assert row["own_cache"]["cache_positions"] == 256 and row["cache_positions"] == 512  # whole blocks
        assert row["prefill_tok_s"] > 0 and row["prefill_peak_mb"] >= 0
    assert rows[1]["kv_cache_mb"] < 0.6 * rows[0]["kv_cache_mb"]  # int8 levels and bf16 scales: about half
    assert "int4 g32 (in memory)" in run.stdout


def test_depths_run_without_prefill(tmp_path):
    """--no-prefill: the steps over random cache contents (a GPU's shortcut past compiling prefill), no
    prefill row."""
    out = tmp_path / "depths.json"
    run = subprocess.run(
        [sys.executable, "scripts/benchmark_depths.py", "--model", "SmolLM2-135M", "--random-weights", "--device", "cpu",
         "--depths", "0", "300", "--max_new_tokens", "2", "--runs", "1", "--kv_cache_dtype", "int8",
         "--no-own-cache", "--no-prefill", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
        timeout=300, env=eager_everywhere(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["prefill_tok_s"] is None and all(ms > 0 for ms in row["ms_per_token"].values())
    assert run.stdout.count("cache filled at random") == 2 and "prefill tok/s" not in run.stdout
    refused = subprocess.run([sys.executable, "scripts/benchmark_depths.py", "--model", "Gemma-2-2B", "--random-weights",
                              "--depths", "0", "64", "--no-prefill"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "a sliding-window model's ring" in refused.stderr.strip().splitlines()[-1]


def test_depths_rounds_take_ours_and_llama_bench_in_turn(tmp_path):
    """--rounds: ours, then llama-bench, round after round; each figure is the rounds' median and each
    ratio the median of the rounds' own ratios (a stand-in llama-bench, 10 ms a token in its first
    call, 20 in its second)."""
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\n" + """import json, pathlib, sys
calls = pathlib.Path(sys.argv[0]).with_name("calls")
calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
depths = sys.argv[sys.argv.index("-d") + 1].split(",")
print(json.dumps([dict(n_depth=int(d), avg_ts=100 / len(calls.read_text()), model_type="fake", build_commit="0")
                  for d in depths]))
""")
    fake.chmod(0o755)
    out = tmp_path / "depths.json"
    run = subprocess.run(
        [sys.executable, "scripts/benchmark_depths.py", "--model", "SmolLM2-135M", "--random-weights", "--device", "cpu",
         "--depths", "0", "300", "--max_new_tokens", "2", "--runs", "1", "--no-own-cache", "--no-prefill",
         "--rounds", "2", "--gguf", str(fake), "--llama-bench", str(fake), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=eager_everywhere(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines()
             if line.startswith("round ") or "depth 300:" in line or "llama-bench:" in line]
    assert [line.split()[0] for line in lines] == ["round", "torch.bfloat16", "llama-bench:"] * 2
    ours, peer = json.loads(out.read_text())["rows"]
    assert peer["ms_per_token"] == {"0": 15.0, "300": 15.0}
    for d in ("0", "300"):
        by_round = [peer_ms[d] / our_ms[d] for our_ms, peer_ms in zip(ours["ms_per_token_by_round"],
                                                                     peer["ms_per_token_by_round"])]
        assert by_round[0] != by_round[1]
        assert ours["speedup"]["llama-bench"][d] == pytest.approx(sum(by_round) / 2)
        assert ours["ms_per_token"][d] == pytest.approx(sum(r[d] for r in ours["ms_per_token_by_round"]) / 2)
    assert "ours / llama-bench" in run.stdout


def test_speculative_runs_end_to_end(tmp_path, bundled_checkpoint):
    """--speculative: verify steps' cost, then plain decoding against each drafter on the three prompts,
    end to end and past the prefill (eager, as above)."""
    env = eager_everywhere(tmp_path)
    out = tmp_path / "speculative.json"
    run = subprocess.run([sys.executable, "scripts/benchmark.py", "--speculative", "--runs", "1", "--max_new_tokens",
                          "16", "--temperatures", "0", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    costs = [row for row in rows if "verify_cost" in row]
    assert [row["verify_cost"] for row in costs] == ["bf16", "int8", "int4 g32"] and all(row["ratio"] > 0 for row in costs)
    lookup = [row for row in rows if row.get("drafter") == "prompt lookup"]
    assert [row["prompt"] for row in lookup] == ["open-ended", "extract", "code-edit"]
    # past the prefill is a difference of timings: on a loaded machine it can come out at or below 0
    assert all(row["speedup"] > 0 and math.isfinite(row["decode_speedup"]) and row["prefill_s"] > 0 for row in lookup)


def test_speculative_on_random_weights_measures_verify_steps_and_drafts_all_right(tmp_path):
    """--speculative --model: the verify steps' cost and, on a random prompt, decoding whose drafts are the
    plain run's own tokens ("foreseen"): in fp32 every verify step keeps all k of them."""
    out = tmp_path / "speculative.json"
    run = subprocess.run([sys.executable, "scripts/benchmark.py", "--speculative", "--model", "SmolLM2-135M",
                          "--random-weights", "--device", "cpu", "--precision", "fp32", "--prompt_length", "8",
                          "--max_new_tokens", "25", "--runs", "1", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=eager_everywhere(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["verify_cost"] for row in rows if "verify_cost" in row] == ["fp32", "int8", "int4 g32"]
    [foreseen] = [row for row in rows if "drafter" in row]
    assert (foreseen["drafter"], foreseen["prompt"]) == ("foreseen", "random")
    assert foreseen["accepted_counts"] == [0] * 5 + [4] and foreseen["plain_steps"] == 0, foreseen


def test_speculative_verify_only_times_the_verify_steps_it_is_given(tmp_path):
    """--verify-cost picks whose verify steps are timed, and --verify-only leaves out the decoding: what a
    short GPU call runs when the others are measured already."""
    out = tmp_path / "speculative.json"
    run = subprocess.run([sys.executable, "scripts/benchmark.py", "--speculative", "--model", "SmolLM2-135M",
                          "--random-weights", "--device", "cpu", "--precision", "fp32", "--runs", "1", "--verify-cost",
                          "int8", "--verify-only", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=eager_everywhere(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert [row["verify_cost"] for row in json.loads(out.read_text())["rows"]] == ["int8"]
    assert "drafter" not in run.stdout


def test_apart_ladder_runs_end_to_end(tmp_path):
    """--apart: a child process a compiled rung, each measured in every round, the rows in the table's order."""
    out = tmp_path / "ladder.json"
    run = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--model", "SmolLM2-135M", "--random-weights", "--device", "cpu",
         "--prompt_length", "8", "--max_new_tokens", "3", "--runs", "2", "--no-hf", "--quantized", "int8", "int4",
         "--apart", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=eager_everywhere(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    rungs = ["ours bf16 compiled", "ours int8 (in memory) compiled", "ours int4 g32 (in memory) compiled"]
    assert list(record["rows"]) == ["matmul floor (F.linear)", "floor (compiled mul-sum)", *rungs]
    assert record["failed"] == {}
    for name in rungs:
        row = record["rows"][name]
        assert len(row["full_s"]) == len(row["first_s"]) == 2 and row["e2e_tok_s"] > 0 and name in run.stdout


CHILD = """
import sys
sys.path.insert(0, {scripts!r})
import apart
channel = apart.Channel()
assert channel.heard("build")
print("a line on stdout, which the channel sends to stderr")
open({log!r}, "a").write(sys.argv[1] + "\\n")
channel.say("built")
if sys.argv[1] == "fails":
    sys.exit(3)
channel.say("ready", first_run_s=1.0)
while channel.heard("run"):
    channel.say("times", full=2.0, first=0.5)
"""


def test_apart_reports_a_child_that_fails_and_measures_the_others(tmp_path):
    log = tmp_path / "built.txt"
    child = CHILD.format(scripts=str(REPO / "scripts"), log=str(log))
    said = benchmark.apart.measure({name: [sys.executable, "-c", child, name] for name in ("fails", "a", "b")}, runs=3)
    assert log.read_text().split() == ["fails", "a", "b"]  # built one at a time, in the order given
    assert said["fails"] == {"error": "exited with 3 before it said ready (its output is above)"}
    for name in ("a", "b"):
        assert said[name] == {"first_run_s": 1.0, "full_s": [2.0] * 3, "first_s": [0.5] * 3}


def test_release_frees_what_the_rung_does_not_hold():
    model = ladder_models.random_model(benchmark.shape("SmolLM2-135M"), argparse.Namespace(precision="bf16", device="cpu"))
    int8 = benchmark.quantized_copy(model, model.config, "int8", 32)
    benchmark.apart.release(model, keep=int8)
    assert model.layers[0].attention.wqkv.weight.numel() == 0
    embeddings = model.tok_embeddings.weight  # shared: the same memory
    assert embeddings.numel() > 0 and embeddings.data_ptr() == int8.tok_embeddings.weight.data_ptr()
    assert all(t.numel() > 0 for t in int8.parameters())


@pytest.mark.parametrize("script,argv,message", [
    ("benchmark.py", [], "pip install -e '.[bench]', or pass --no-hf"),  # transformers missing
    ("benchmark.py", ["--no-hf", "--device", "cuda"], "no CUDA device"),
    # it used to relaunch itself forever
    ("benchmark.py", ["--no-hf", "--tp", "1"], "--tp takes world sizes of 2 or more"),
    ("benchmark.py", ["--no-hf", "--max_new_tokens", "1"], "--max_new_tokens must be 2 or more"),
    ("benchmark_depths.py", ["--depths", "8100"], "depth 8100 and 128 new tokens exceed the model's context of 8192"),
    ("benchmark_depths.py", ["--depths", "0"], "the deepest above 0"),
    ("benchmark_depths.py", ["--depths", "16", "--rounds", "0"], "--rounds takes 1 or more"),
    # 9 heads split 3 ways, not int4 groups of 128 over their 576 input columns: said before measuring
    ("benchmark.py", ["--no-hf", "--tp", "3", "--quantized", "int4", "--groupsize", "128"],
     "int4 groups of 128) does not split 3"),
    ("benchmark.py", ["--no-hf", "--quantized", "missing.safetensors"], "missing.safetensors does not exist"),
    ("benchmark.py", ["--no-hf", "--quantized", "int4", "--groupsize", "0"], "--groupsize must be one of"),
    ("benchmark.py", ["--no-hf", "--dense-twin"], "--dense-twin goes with a mixture-of-experts --model"),
    ("benchmark.py", ["--no-hf", "--verify-only"], "--verify-cost and --verify-only belong to --speculative"),
    # our own checkout: a model.py and a generate.py, but not gpt-fast's
    ("benchmark.py", ["--no-hf", "--gpt-fast", "."], "is not a gpt-fast checkout"),
    ("benchmark.py", ["--harness", "--tp", "2"], "--tp shards the ladder's rungs"),
    ("benchmark.py", ["--no-hf", "--apart", "--tp", "2"], "--apart measures the compiled rungs alone"),
])
def test_bad_setups_are_one_line_before_measuring(tmp_path, script, argv, message):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "transformers").mkdir()  # an installation without transformers
    (tmp_path / "transformers" / "__init__.py").write_text('raise ImportError("not installed")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, f"scripts/{script}", "--model", "SmolLM2-135M", "--random-weights", *argv],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0 and message in run.stderr.splitlines()[-1] and "Traceback" not in run.stderr


def test_the_ladder_refuses_a_quantized_checkpoint_before_measuring(int4_checkpoint):
    """It quantizes from bf16 weights (its table's floor counts them), so a quantized file goes to --quantized."""
    run = subprocess.run([sys.executable, "scripts/benchmark.py", "--no-hf", "--checkpoint_path", str(int4_checkpoint)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1] == (f"error: {int4_checkpoint} is quantized: the ladder starts from the unquantized "
                                           f"checkpoint; give that as --checkpoint_path and this one as --quantized "
                                           f"{int4_checkpoint}")
