"""The server's step shapes, timed in turn in one process (45df073; run as python cpu-avx512-serve-step-shapes.py 100 --profile):
one row, 8 rows, 8 rows carrying a chunk of 4, 8 or 16 positions, at depth 100; the bundled model in bf16, compiled as
serve.py --compile compiles it. The output: cpu-avx512-serve-step-shapes.txt."""
import sys, time, statistics, torch
from fastllama import serve
from fastllama.generate import compiled_steps, find_checkpoint, load_model
torch.set_grad_enabled(False)
model = load_model(find_checkpoint(None), "cpu", "bf16")
steps = compiled_steps(dynamic_prefill=True)
eng = serve.Engine(model, 8, 8192, steps)
depth = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 100
cases = {"1": ([1] * 1, None), "8": ([1] * 8, None)}
for c in (4, 8, 16):
    cases[f"8+{c}"] = ([1] * 8, serve.join_chunks(list(range(40)), c)[1])
t0 = time.time()
for name, (tok, chunk) in cases.items():
    for _ in range(3): eng.step(tok, [depth] * len(tok), chunk)
print(f"compiled in {time.time() - t0:.0f} s", flush=True)
times = {k: [] for k in cases}
for r in range(30):
    for name, (tok, chunk) in cases.items():
        t = time.perf_counter(); eng.step(tok, [depth] * len(tok), chunk); times[name].append((time.perf_counter() - t) * 1e3)
one = statistics.median(times["1"])
for name, v in times.items():
    v = sorted(v); print(f"{name:6} median {statistics.median(v):6.2f} ms  p90 {v[int(.9 * len(v))]:6.2f}  {statistics.median(v) / one:.2f}x one row")
if "--profile" in sys.argv:
    from torch.profiler import profile
    for name in ("1", "8", "8+16"):
        tok, chunk = cases[name]
        with profile() as p:
            for _ in range(10): eng.step(tok, [depth] * len(tok), chunk)
        print("=====", name); print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
