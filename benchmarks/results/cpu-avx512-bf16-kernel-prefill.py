"""The server's prompt prefill (Engine.prefill, compiled, one chat and two) with each bf16 linear's copy in oneDNN's layout,
which prefill's products read, and in cpu_linear.cpp's tiles, which they do not (they read the plain weights), in turn
in one process, median of 10. Run as python cpu-avx512-bf16-kernel-prefill.py; the output: cpu-avx512-bf16-kernel-prefill.txt."""
import time, statistics, torch
from fastllama import serve, cpu_decode
from fastllama.generate import compiled_steps, find_checkpoint, load_model, get_tokenizer
torch.set_grad_enabled(False)
ck = find_checkpoint(None)
model = load_model(ck, "cpu", "bf16")
eng = serve.Engine(model, 8, 8192, compiled_steps(dynamic_prefill=True))
tok = get_tokenizer(ck)
chats = [tok.encode_dialog([{"role": "user", "content": p}]) for p in ["Tell me about Paris.", "Explain how a bicycle works."]]
linears = [m for m in model.modules() if isinstance(m, cpu_decode.FewRowLinear)]
copies = {}
for tiles in (False, True):
    cpu_decode.pack(model, many_rows=not tiles); copies[tiles] = [m.packed for m in linears]
def use(tiles):
    for m, p in zip(linears, copies[tiles]): m.packed = p
cases = {"1 chat": [chats[0]], "2 chats": chats}
for tiles in (False, True):
    use(tiles)
    for c in cases.values():
        for _ in range(2): eng.prefill(c, False)
times = {(t, k): [] for t in (False, True) for k in cases}
for _ in range(10):
    for tiles in (False, True):
        use(tiles)
        for k, c in cases.items():
            t = time.perf_counter(); eng.prefill(c, False); times[(tiles, k)].append((time.perf_counter() - t) * 1e3)
for k in cases:
    a, b = statistics.median(times[(False, k)]), statistics.median(times[(True, k)])
    print(f"{k} ({[len(c) for c in cases[k]]} positions): oneDNN's copy {a:.1f} ms, plain weights (tiles packed) {b:.1f} ms, {a / b:.2f}x")
