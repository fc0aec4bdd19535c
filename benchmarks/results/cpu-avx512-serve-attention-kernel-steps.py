"""serve.Engine's step shapes with the attention kernel off (serve's setting before) and on, in turn in one process
(36a8a1a; run as python cpu-avx512-serve-attention-kernel-steps.py DEPTH): one row, 8 rows, 8 rows carrying a chunk
of 16 positions, every row at DEPTH; the bundled model in bf16, compiled as serve.py --compile compiles it. The
output: cpu-avx512-serve-attention-kernel-steps.txt."""
import sys, time, statistics, torch
from fastllama import serve, cpu_decode
from fastllama.model import Attention
from fastllama.generate import compiled_steps, find_checkpoint, load_model
torch.set_grad_enabled(False)
model = load_model(find_checkpoint(None), "cpu", "bf16")
steps = compiled_steps(dynamic_prefill=True)
eng = serve.Engine(model, 8, 8192, steps)
depth = int(sys.argv[1])
attn = [m for m in model.modules() if isinstance(m, Attention)]
def kernel(on):
    for m in attn: m.decode_kernel = cpu_decode.decode_attention if on else None
cases = {"1": ([1], None), "8": ([1] * 8, None), "8+16": ([1] * 8, serve.join_chunks(list(range(40)), 16)[1])}
t0 = time.time()
for on in (False, True):
    kernel(on)
    for name, (tok, chunk) in cases.items():
        for _ in range(3): eng.step(tok, [depth] * len(tok), chunk)
print(f"compiled in {time.time() - t0:.0f} s", flush=True)
times = {(on, k): [] for on in (False, True) for k in cases}
for r in range(30):
    for on in (False, True):
        kernel(on)
        for name, (tok, chunk) in cases.items():
            t = time.perf_counter(); eng.step(tok, [depth] * len(tok), chunk); times[(on, name)].append((time.perf_counter() - t) * 1e3)
for (on, name), v in times.items():
    print(f"kernel {'on ' if on else 'off'} {name:6} median {statistics.median(v):6.2f} ms")
