"""Ad hoc A/B (benchmarks/RESULTS.md, "Verify steps of a few tokens: attention written out"): a compiled
plain step and verify step of k + 1 tokens at a depth, with each Attention's written_out_rows at 0 (the
fused kernel) and 16 (written out), alternating in one process, 7 rounds of 20 steps, medians.
    [C=checkpoint] [K=1] [D=100] python benchmarks/results/cpu-avx512-verify-attention-written-out-ab.py"""
import os, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fastllama import generate as gen, decode, speculative, cpu_decode
from fastllama.model import Attention
torch.set_grad_enabled(False)
torch._dynamo.config.recompile_limit = 64
model = gen.load_model(os.environ.get("C"), "cpu", os.environ.get("P", "bf16"))
decode.compile_steps(); speculative.compile_steps()
depth, k = int(os.environ.get("D", "100")), int(os.environ.get("K", "1"))
model.setup_caches(1, decode.padded_length(depth + 64, model.config.block_size))
cpu_decode.pack(model)
token = torch.zeros(1, 1, dtype=torch.long)
positions = depth + torch.arange(1 + k)[None]
keys = decode.key_positions(model, depth + 1 + k)
plain = lambda: decode.decode_one_token(model, token, positions[:, :1], keys)
verify = lambda: speculative.target_step(model, token.expand(1, k + 1), positions[:, : k + 1], keys)
def t(f):
    f(); s = time.perf_counter(); [f() for _ in range(20)]; return (time.perf_counter() - s) / 20 * 1e3
res = {w: [] for w in (0, 16)}
def written_out_rows(w):
    for m in model.modules():
        if isinstance(m, Attention): m.written_out_rows = w
for w in (0, 16): written_out_rows(w); verify(); verify()
for r in range(7):
    for w in (0, 16):
        written_out_rows(w)
        p, v = t(plain), t(verify)
        res[w].append((p, v, v / p))
for w, rows in res.items():
    print(f"{os.environ.get('C', 'bf16')} k={k} depth={depth} written_out_rows={w}: plain {statistics.median(r[0] for r in rows):.2f} verify {statistics.median(r[1] for r in rows):.2f} ratio {statistics.median(r[2] for r in rows):.3f}")
