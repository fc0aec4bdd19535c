"""Prompts prefilled together by serve.Engine.prefill, whole or their shared beginning once (into one row, then
copied), timed in turn in one process: 2, 4 and 8 prompts of 36 positions that share their first 24, as the
benchmark's chats do. The bundled model in bf16, compiled as serve.py --compile compiles it. Run as
python cpu-avx512-serve-burst-prefill.py; the output: cpu-avx512-serve-burst-prefill.txt."""
import sys, time, statistics, torch
from fastllama import serve
from fastllama.generate import compiled_steps, find_checkpoint, load_model
torch.set_grad_enabled(False)
model = load_model(find_checkpoint(None), "cpu", "bf16")
eng = serve.Engine(model, 8, 8192, compiled_steps(dynamic_prefill=True))
eng.warm()
torch.manual_seed(0)
prefix = torch.randint(100, 40000, (24,)).tolist()
cases = {}
for g in (2, 4, 8):
    prompts = [prefix + torch.randint(100, 40000, (12,)).tolist() for _ in range(g)]
    cases[(g, 0)] = prompts; cases[(g, 24)] = prompts
for (g, sh), p in cases.items():
    for _ in range(2): eng.prefill(p, False, sh)
times = {k: [] for k in cases}
for r in range(10):
    for (g, sh), p in cases.items():
        t = time.perf_counter(); eng.prefill(p, False, sh); times[(g, sh)].append((time.perf_counter() - t) * 1e3)
for (g, sh), v in times.items():
    print(f"{g} prompts of 36, shared {sh:2}: median {statistics.median(v):6.1f} ms")
