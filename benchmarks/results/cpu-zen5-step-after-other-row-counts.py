"""Does a server step's time grow with the row counts compiled for the same step before it (dynamo's cache entries
of one code object)? The server's Engine on a checkpoint (default: the bundled model), 8 rows, depth 100: one row's
step timed (medians of 40, five times) with only its own graph compiled, then after 2, 3, 4, 6 and 8 rows compiled;
then 8 rows; then 1 and 8 rows in turn.

    python benchmarks/results/cpu-zen5-step-after-other-row-counts.py [CHECKPOINT]
"""
import statistics, sys, time, torch
from fastllama import serve
from fastllama.generate import compiled_steps, find_checkpoint, load_model
torch.set_grad_enabled(False)
model = load_model(find_checkpoint(sys.argv[1] if len(sys.argv) > 1 else None), "cpu", "bf16")
steps = compiled_steps(dynamic_prefill=True)
eng = serve.Engine(model, 8, 8192, steps)
depth = 100
def t(rows, n=40):
    out = []
    for _ in range(n):
        s = time.perf_counter(); eng.step([1] * rows, [depth] * rows); out.append((time.perf_counter() - s) * 1e3)
    return statistics.median(out)
for _ in range(3): eng.step([1], [depth])
print("1 row, its entry alone:", " ".join(f"{t(1):.3f}" for _ in range(5)), flush=True)
for rows in (2, 3, 4, 6, 8):
    for _ in range(3): eng.step([1] * rows, [depth] * rows)
print("1 row after 2,3,4,6,8 compiled:", " ".join(f"{t(1):.3f}" for _ in range(5)), flush=True)
print("8 rows:", " ".join(f"{t(8):.3f}" for _ in range(5)), flush=True)
print("1 and 8 in turn:", end=" ")
a, b = [], []
for _ in range(40):
    a.append(t(1, 1)); b.append(t(8, 1))
print(f"1 row {statistics.median(a):.3f}, 8 rows {statistics.median(b):.3f}")
