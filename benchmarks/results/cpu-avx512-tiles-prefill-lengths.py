"""As cpu-avx512-tiles-prefill.py, for random prompts of 64, 96 and 128 positions, where the tiles meet the plain
weights. Run as python cpu-avx512-tiles-prefill-lengths.py; the output: cpu-avx512-tiles-prefill-lengths.txt."""
import time, statistics, torch
from fastllama import serve, cpu_decode
from fastllama.generate import compiled_steps, find_checkpoint, load_model, get_tokenizer
torch.set_grad_enabled(False)
torch._dynamo.config.recompile_limit = 64
ck = find_checkpoint(None)
model = load_model(ck, "cpu", "bf16")
eng = serve.Engine(model, 8, 8192, compiled_steps(dynamic_prefill=True))
tok = get_tokenizer(ck)
chats = [tok.encode_dialog([{"role": "user", "content": p}]) for p in ["Tell me about Paris.", "Explain how a bicycle works."]]
torch.manual_seed(0)
linears = [m for m in model.modules() if isinstance(m, cpu_decode.FewRowLinear)]
copies = {}
for name, many in (("oneDNN copy", True), ("tiles", False)):
    cpu_decode.pack(model, many_rows=many); copies[name] = [m.packed for m in linears]
copies["plain weights"] = [None] * len(linears)
def use(name):
    for m, p in zip(linears, copies[name]): m.packed = p
cases = {f"{n} positions": [torch.randint(0, 40000, (n,)).tolist()] for n in (64, 96, 128)}
for name in copies:
    use(name)
    for c in cases.values():
        for _ in range(2): eng.prefill(c, False)
times = {(n, k): [] for n in copies for k in cases}
for _ in range(9):
    for name in copies:
        use(name)
        for k, c in cases.items():
            t = time.perf_counter(); eng.prefill(c, False); times[(name, k)].append((time.perf_counter() - t) * 1e3)
for k in cases:
    ms = {n: statistics.median(times[(n, k)]) for n in copies}
    print(f"{k} ({[len(c) for c in cases[k]]} positions): " + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items())
          + f"; tiles {ms['oneDNN copy'] / ms['tiles']:.2f}x oneDNN's copy, {ms['plain weights'] / ms['tiles']:.2f}x the plain weights")
