"""Run under torchrun by tests/test_tp.py.
    torchrun --nproc_per_node=N tests/tp_worker.py OUT.pt PRECISION:CHECKPOINT [...]
greedy tokens and prefill logits of each checkpoint, sharded;
    torchrun --nproc_per_node=N tests/tp_worker.py --cli OUT.pt "GENERATE.PY ARGS" ["GENERATE.PY ARGS" ...]
each rank runs generate.py's command line (the same start-up as the CLI's) with each set of arguments
and saves what it generated, and how many checkpoints it quantized, to OUT.pt.RANK;
    torchrun --nproc_per_node=N tests/tp_worker.py --ids OUT.pt CHECKPOINT [...]
prefill logits and greedy tokens of checkpoints without a tokenizer (tests/test_families.py), from
random token ids, through sliding-window rings that wrap."""

import shlex
import sys

import torch

from fastllama import generate as gen, quantize, tp
from fastllama.generate import generate, get_tokenizer, load_model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 4, 5, 6, 7,"]
# in bf16 the last one's greedy path has a top-2 margin of 1.9 logits or more at every step; the
# others have near-ties (0.06) that any change in summation order may flip
CLEAR_MARGIN_PROMPTS = PROMPTS[2:]


@torch.no_grad()
def run_case(checkpoint: str, precision: str, rank: int = 0, world_size: int = 1) -> dict:
    model = load_model(checkpoint, "cpu", precision, rank, world_size)
    tokenizer = get_tokenizer(checkpoint)
    results = {"local_heads": model.layers[0].attention.n_head}
    for prompt in PROMPTS:
        ids = torch.tensor(tokenizer.encode(prompt))
        model.setup_caches(1, 64)
        logits = model(ids[None], torch.arange(len(ids)))[0, -1].float()
        tokens = generate(model, ids, 16, temperature=0)[len(ids):]
        results[prompt] = (logits, tokens)
    return results


@torch.no_grad()
def run_ids_case(checkpoint: str, rank: int = 0, world_size: int = 1) -> dict:
    model = load_model(checkpoint, "cpu", "fp32", rank, world_size)
    prompt = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(8))
    model.setup_caches(1, 64, chunk=8)
    logits = model(prompt[None], torch.arange(40))[0]
    tokens = generate(model, prompt, 24, temperature=0, prefill_chunk=8)[40:].tolist()
    return {"local_heads": model.layers[0].attention.n_head, "logits": logits, "tokens": tokens}


if __name__ == "__main__" and sys.argv[1] in ("--cli", "--ids"):
    rank, world_size = tp.maybe_init_distributed()
    out, args = sys.argv[2], sys.argv[3:]
    if sys.argv[1] == "--cli":
        quantized, quantize_once = [], quantize.quantize
        quantize.quantize = lambda *a, **kw: quantized.append(a) or quantize_once(*a, **kw)
        outputs = [gen.run(gen.parse_args(shlex.split(argv)), rank, world_size) for argv in args]
        torch.save({"outputs": outputs, "quantized": len(quantized)}, f"{out}.{rank}")
    elif rank == 0:
        torch.save({path: run_ids_case(path, rank, world_size) for path in args}, out)
    else:
        [run_ids_case(path, rank, world_size) for path in args]
    torch.distributed.destroy_process_group()
elif __name__ == "__main__":
    rank, world_size = tp.maybe_init_distributed()
    out, cases = sys.argv[1], sys.argv[2:]
    results = {case: run_case(case.split(":", 1)[1], case.split(":", 1)[0], rank, world_size) for case in cases}
    if rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()
