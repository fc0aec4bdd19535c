"""cpu_linear.cpp's bf16_rows over tiles, oneDNN's bf16 product over its packed layout, and F.linear over the plain
weight, in turn, on the bundled model's weights (30 layers' qkv, wo, w13, w2, and the head: 269 MB, streamed from
memory): ms and the weight's bytes a second at 1, 4 and 8 rows (median of 21); then one weight at a time at 16, 64
and 512 rows (median of 7), as GFLOP/s. Random bf16 weights. Run as python cpu-avx512-bf16-kernel.py; the output:
cpu-avx512-bf16-kernel.txt."""
import statistics, time, torch
from fastllama import cpu_decode
assert cpu_decode.bf16_kernel() is not None, "needs AVX-512 BF16"
torch.manual_seed(0)
def onednn(x, packed): return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
FORMS = {"tiles": (cpu_decode.tiles_layout, torch.ops.fastllama.bf16_rows),
         "oneDNN packed": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, cpu_decode.FEW_ROWS), onednn),
         "F.linear": (lambda w: w, torch.nn.functional.linear)}
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = [torch.randn(s, dtype=torch.bfloat16) / 20 for s in shapes]
copies = {name: [layout(w) for w in weights] for name, (layout, _) in FORMS.items()}
nbytes = sum(w.numel() * 2 for w in weights)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; the bundled model's weights, {nbytes / 1e6:.0f} MB")
for rows in (1, 4, 8):
    x = torch.randn(rows, 1536, dtype=torch.bfloat16)
    xs = {k: x[:, :k].contiguous() for k in (576, 1536)}
    times = {name: [] for name in FORMS}
    for _ in range(21):
        for name, (_, product) in FORMS.items():
            t = time.perf_counter()
            for w, c in zip(weights, copies[name]):
                product(xs[w.shape[1]], c)
            times[name].append(time.perf_counter() - t)
    print(f"{rows} rows: " + ", ".join(f"{name} {statistics.median(v) * 1e3:.2f} ms ({nbytes / statistics.median(v) / 1e9:.1f} GB/s)"
                                      for name, v in times.items()), flush=True)
for n, k in [(3072, 576), (576, 1536), (49152, 576)]:
    w = torch.randn(n, k, dtype=torch.bfloat16) / 20
    one = {name: layout(w) for name, (layout, _) in FORMS.items()}
    for rows in (16, 64, 512):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        times = {name: [] for name in FORMS}
        for _ in range(7):
            for name, (_, product) in FORMS.items():
                t = time.perf_counter(); product(x, one[name]); times[name].append(time.perf_counter() - t)
        print(f"{n} x {k}, {rows} rows: " + ", ".join(f"{name} {2 * rows * n * k / statistics.median(v) / 1e9:.0f} GFLOP/s"
                                                     for name, v in times.items()), flush=True)
