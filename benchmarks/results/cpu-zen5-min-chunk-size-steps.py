"""inductor's cpp.min_chunk_size (the fewest elements a thread of a parallel loop takes) at its default 512 and at
65536, two compiled decode steps of one model in one process, taken in turn: 1 and 8 rows at depth 100.

    python benchmarks/results/cpu-zen5-min-chunk-size-steps.py CHECKPOINT [ROUNDS]
"""
import statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import benchmark_depths as bd
from benchmark import compiled_apart
from fastllama import decode
torch.set_grad_enabled(False)
args = bd.model_arguments("").parse_args(["--checkpoint_path", sys.argv[1]])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 60
model = bd.load(args)
model.setup_caches(8, 1024)
bd.fill_at_random(model)
depth = 100
steps = {}
for size in (512, 65536):
    torch._inductor.config.cpp.min_chunk_size = size
    steps[size] = compiled_apart()
    for rows in (1, 8):
        for _ in range(3):
            steps[size](model, torch.zeros((rows, 1), dtype=torch.long), torch.full((rows, 1), depth), decode.key_positions(model, depth + 1, rows))
torch._inductor.config.cpp.min_chunk_size = 512
def timed(size, rows):
    tok, pos, keys = torch.zeros((rows, 1), dtype=torch.long), torch.full((rows, 1), depth), decode.key_positions(model, depth + 1, rows)
    s = time.perf_counter(); steps[size](model, tok, pos, keys); return (time.perf_counter() - s) * 1e3
times = {(s, r): [] for s in steps for r in (1, 8)}
for i in range(rounds):
    for s in (steps if i % 2 == 0 else list(steps)[::-1]):
        for r in (1, 8):
            times[s, r].append(timed(s, r))
for r in (1, 8):
    a, b = times[512, r], times[65536, r]
    q = statistics.quantiles([x / y for x, y in zip(a, b)], n=4)
    print(f"{r} rows: min_chunk_size 512 {statistics.median(a):.3f} ms, 65536 {statistics.median(b):.3f} ms; 512 / 65536 "
          f"{statistics.median(a) / statistics.median(b):.3f} (rounds' quartiles {q[0]:.3f}-{q[2]:.3f})", flush=True)
