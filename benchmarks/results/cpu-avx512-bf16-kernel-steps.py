"""serve.Engine's step shapes with each bf16 linear's copy in oneDNN's layout (before; one and two rows keep the
fused loop) and in cpu_linear.cpp's tiles, in turn in one process: one row, 8 rows, 8 rows carrying a chunk of 16
positions, every row at DEPTH; the bundled model in bf16, compiled as serve.py --compile compiles it. Run as
python cpu-avx512-bf16-kernel-steps.py DEPTH [ROUNDS]; the output: cpu-avx512-bf16-kernel-steps.txt."""
import sys, time, statistics, torch
from fastllama import serve, cpu_decode
from fastllama.generate import compiled_steps, find_checkpoint, load_model
torch.set_grad_enabled(False)
model = load_model(find_checkpoint(None), "cpu", "bf16")
steps = compiled_steps(dynamic_prefill=True)
eng = serve.Engine(model, 8, 8192, steps)
depth = int(sys.argv[1])
linears = [m for m in model.modules() if isinstance(m, cpu_decode.FewRowLinear)]
copies = {}
for tiles in (False, True):
    cpu_decode.pack(model, many_rows=not tiles)
    copies[tiles] = [m.packed for m in linears]
def use(tiles):
    for m, p in zip(linears, copies[tiles]): m.packed = p
cases = {"1": ([1], None), "8": ([1] * 8, None), "8+16": ([1] * 8, serve.join_chunks(list(range(40)), 16)[1])}
t0 = time.time()
for tiles in (False, True):
    use(tiles)
    for name, (tok, chunk) in cases.items():
        for _ in range(3): eng.step(tok, [depth] * len(tok), chunk)
print(f"compiled in {time.time() - t0:.0f} s", flush=True)
times = {(t, k): [] for t in (False, True) for k in cases}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
    for tiles in (False, True):
        use(tiles)
        for name, (tok, chunk) in cases.items():
            t = time.perf_counter(); eng.step(tok, [depth] * len(tok), chunk); times[(tiles, name)].append((time.perf_counter() - t) * 1e3)
for name in cases:
    a, b = statistics.median(times[(False, name)]), statistics.median(times[(True, name)])
    print(f"{name:6} oneDNN {a:6.2f} ms  tiles {b:6.2f} ms  {a / b:.2f}x")
