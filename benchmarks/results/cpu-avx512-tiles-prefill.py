"""The server's prompt prefill (Engine.prefill, compiled for any length) with each bf16 linear's copy in oneDNN's layout, in
cpu_linear.cpp's tiles (read by chunks of at most cpu_decode.TILE_ROWS positions, the plain weight by longer ones), and with
no copy (the plain weights), in turn in one process, median of 9: one chat, two chats, and a random prompt of 500 positions
(chunks of 256 and 244); or, given lengths, a random prompt of each. Run as python cpu-avx512-tiles-prefill.py; the output:
cpu-avx512-tiles-prefill.txt (and -2.txt, a second run); python cpu-avx512-tiles-prefill.py 64 96 128: ...-lengths.txt."""
import sys, time, statistics, torch
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
cases = {"1 chat": [chats[0]], "2 chats": chats, "500 positions": [torch.randint(0, 40000, (500,)).tolist()]}
if sys.argv[1:]:
    cases = {f"{n} positions": [torch.randint(0, 40000, (n,)).tolist()] for n in map(int, sys.argv[1:])}
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
