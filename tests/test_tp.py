"""Tensor parallelism on CPU: 3 gloo processes (SmolLM2-135M has 9 heads and 3 key/value heads) give
the single process's greedy tokens, and its logits within a tolerance."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastllama import cpu_decode, generate as gen, tp
from fastllama.errors import UserError
from fastllama.model import ModelArgs
from shapes import shape
from tests.tp_worker import CLEAR_MARGIN_PROMPTS, PROMPTS, run_case

# max |diff| / max |logit|: the sharded sums are added in another order; in bf16 (8 bits of mantissa)
# that moves logits of ~20 by up to ~0.6 after 30 layers, about what bf16 itself costs against fp32
TOLERANCE = {"fp32": 1e-4, "bf16": 4e-2}


@pytest.fixture(scope="module")
def sharded_results(bundled_checkpoint, quantized_dir, int4_checkpoint, tmp_path_factory):
    from fastllama import quantize

    int8 = quantize.quantize(bundled_checkpoint, "int8", output=quantized_dir / "int8.safetensors")
    cases = [f"fp32:{bundled_checkpoint}", f"bf16:{bundled_checkpoint}", f"bf16:{int8}", f"bf16:{int4_checkpoint}"]
    out = tmp_path_factory.mktemp("tp") / "results.pt"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                          "tests/tp_worker.py", str(out)] + cases, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("case", ["fp32 bf16-weights", "bf16", "int8", "int4"])
def test_three_ranks_match_one(case, sharded_results):
    key = list(sharded_results)[["fp32 bf16-weights", "bf16", "int8", "int4"].index(case)]
    precision, checkpoint = key.split(":", 1)
    single = run_case(checkpoint, precision)
    tolerance = TOLERANCE[precision]
    bits = {"int4": 4, "int8": 8}.get(case)
    if bits and cpu_decode.rounds_activations(bits):
        # the int kernels of our own round activations to int8: a sum added in another order can move a value
        # across a rounding boundary, a level (a part in 127 of its block's largest) where bf16 alone moves it an ulp
        tolerance *= 2
    assert sharded_results[key]["local_heads"] == 3  # each rank held a third of the 9 heads
    for prompt in PROMPTS:
        logits, tokens = sharded_results[key][prompt]
        ref_logits, ref_tokens = single[prompt]
        assert ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item() <= tolerance
        if precision == "fp32" or prompt in CLEAR_MARGIN_PROMPTS:
            assert tokens.tolist() == ref_tokens.tolist(), (case, prompt)


def torchrun(nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *args], capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parent.parent)


def test_the_command_line_under_torchrun(bundled_checkpoint, tmp_path):
    """generate.py's own start-up on 3 ranks: sampling draws the same tokens on every rank (a shared
    seed), a replicated int4 self-draft is made once (one rank writes it, the others wait for the
    finished file) and gives every rank the same output."""
    checkpoint = tmp_path / "model"  # the bundled model in a directory of its own, without an int4 copy yet
    checkpoint.mkdir()
    for f in bundled_checkpoint.parent.iterdir():
        if f.is_file() and "_int" not in f.name:
            (checkpoint / f.name).symlink_to(f.resolve())
    common = f"--checkpoint_path {checkpoint} --precision fp32 --max_new_tokens 12 --prompt 'Tell me a story'"
    run = torchrun(3, "tests/tp_worker.py", "--cli", str(tmp_path / "out.pt"),
                   f"{common} --temperature 0.8 --top_k 50", f"{common} --temperature 0.8 --draft self-int4",
                   f"{common} --temperature 0 --draft self-int4")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"out.pt.{rank}") for rank in range(3)]
    assert [rank["quantized"] for rank in ranks] == [1, 0, 0]  # one rank, once
    as_lists = [[[o.tolist() for o in outputs] for outputs in rank["outputs"]] for rank in ranks]
    assert as_lists[1] == as_lists[0] and as_lists[2] == as_lists[0]
    tokenizer = gen.get_tokenizer(checkpoint)
    prompt = torch.tensor(tokenizer.encode_prompt("Tell me a story", chat=True))
    single = gen.generate(gen.load_model(checkpoint, "cpu", "fp32"), prompt, 12, temperature=0,
                          stop_ids=tokenizer.stop_ids)
    assert ranks[0]["outputs"][2][0].tolist() == single.tolist()  # greedy fp32: sharded and speculative, the same tokens
    assert (checkpoint / "fastllama_int4.g32.safetensors").is_file() and not list(checkpoint.glob("*.partial"))


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_a_world_size_that_does_not_split_stops_every_rank_with_one_line():
    run = torchrun(2, "generate.py", "--max_new_tokens", "4", timeout=300)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert lines == ["error: this model (9 heads, 3 key/value heads, MLP of 1536) does not split 2 ways; world "
                     "sizes that work: [1, 3]"], run.stderr[-3000:]


RANK_ZERO_FAILS = """
import sys
import torch.distributed as dist
sys.path.insert(0, ".")
from fastllama import tp
from fastllama.errors import UserError
dist.init_process_group("gloo")
rank = dist.get_rank()
def make():
    if rank == 0:
        raise UserError("no such checkpoint") if sys.argv[1] == "user" else OSError("disk full")
    return "made"
try:
    tp.rank_zero_first(make)
except Exception as e:
    sys.stdout.write(f"rank {rank}: {type(e).__name__}: {e}\\n")  # one write: the ranks' lines do not interleave
    sys.stdout.flush()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("kind", ["user", "other"])
def test_a_failure_on_rank_zero_first_stops_every_rank(kind, tmp_path):
    """rank_zero_first: when make() fails on rank 0, the others, waiting for it, stop too (a user error
    with its own line; any other error with one line naming it, rank 0 with the error itself)."""
    script = tmp_path / "rank_zero_fails.py"
    script.write_text(RANK_ZERO_FAILS)
    run = torchrun(2, str(script), kind, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("rank "))
    assert lines == (["rank 0: UserError: no such checkpoint", "rank 1: UserError: no such checkpoint"] if kind == "user"
                     else ["rank 0: OSError: disk full",
                           "rank 1: UserError: rank 0 failed (OSError: disk full); its traceback says where"])


def test_a_gpu_index_under_torchrun_is_refused(monkeypatch):
    """Each rank takes the GPU of its LOCAL_RANK: --device cuda:1 would put every rank on one GPU."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(UserError, match="leave out --device or pass --device cuda"):
        tp.maybe_init_distributed("cuda:1")


def test_sizes_that_do_not_split_are_refused():
    config = shape("SmolLM2-135M")
    with pytest.raises(UserError, match=r"world sizes that work: \[1, 3\]"):
        tp.check_divisible(config, 2)
    with pytest.raises(UserError, match=r"int4 groups of 256.*world sizes that work: \[1\]"):  # one pads its groups
        tp.check_divisible(config, 3, groupsize=256)
    tp.check_divisible(config, 3, groupsize=32)


def test_cuda_under_torchrun_without_cuda_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device cuda under torchrun, but this PyTorch has no CUDA device"):
        tp.maybe_init_distributed("cuda")


def test_shard_selector_splits_fused_parts_on_their_own_boundaries():
    config = ModelArgs(n_layer=1, n_head=4, n_local_heads=2, dim=32, intermediate_size=48, vocab_size=10)
    select = tp.shard_selector(config, rank=1, world=2)
    q, kv = 4 * 8, 2 * 8
    assert select("layers.0.attention.wqkv.weight", (q + 2 * kv, 32)) == (0, [(16, 32), (40, 48), (56, 64)])
    assert select("layers.0.feed_forward.w13.scales", (96,)) == (0, [(24, 48), (72, 96)])
    assert select("layers.0.attention.wo.weight", (32, 16)) == (1, [(8, 16)])  # int4: k/2 bytes a row
    assert select("layers.0.feed_forward.w2.scales", (32,)) is None  # per output row: every rank needs all
    assert select("tok_embeddings.weight", (10, 32)) is None
