"""cpu_linear.cpp's int8_rows over tiles, the compiled multiply-and-sum Int8Linear packed "cpu-fused" runs, and
PyTorch's _weight_int8pack_mm over the plain weight, in turn, on the bundled model's shapes in int8 (30 layers' qkv,
wo, w13, w2, and the head: 135 MB, streamed from memory; the scales applied, bf16 out, as Int8Linear does): ms and
the weight's bytes a second at 1, 2, 4 and 8 rows (median of 21); then one weight at a time at 16, 64 and 512 rows
(median of 7), as GFLOP/s: int8_rows over the tiles against cpu_decode.linear_in over the plain weight (what prefill ran
before). Random levels. Run as python cpu-avx512-int8-kernel.py; the output: cpu-avx512-int8-kernel.txt."""
import statistics, time, torch
from fastllama import cpu_decode
assert cpu_decode.int8_kernel() is not None, "needs AVX-512 BF16"
torch.manual_seed(0)
torch._dynamo.config.recompile_limit = 64  # a graph for each shape and row count


@torch.compile(fullgraph=True, dynamic=False)
def fused(x, w, s):
    return (cpu_decode.few_rows_product(x, w) * s).to(x.dtype)


def tiles(x, w, s):
    return (torch.ops.fastllama.int8_rows(x, w) * s).to(x.dtype)


def pytorch(x, w, s):
    return torch.ops.aten._weight_int8pack_mm(x, w, s)


FORMS = {"tiles": (lambda w: cpu_decode.tiles_layout(w), tiles), "compiled loop": (lambda w: w, fused),
         "PyTorch int8": (lambda w: w, pytorch)}
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = [torch.randint(-127, 128, s, dtype=torch.int8) for s in shapes]
scales = [torch.rand(s[0], dtype=torch.bfloat16) / 100 for s in shapes]
copies = {name: [layout(w) for w in weights] for name, (layout, _) in FORMS.items()}
nbytes = sum(w.numel() for w in weights)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; the bundled model's shapes in int8, {nbytes / 1e6:.0f} MB")
for rows in (1, 2, 4, 8):
    x = torch.randn(rows, 1536, dtype=torch.bfloat16)
    xs = {k: x[:, :k].contiguous() for k in (576, 1536)}
    times = {name: [] for name in FORMS}
    for i in range(22):
        for name, (_, product) in FORMS.items():
            t = time.perf_counter()
            for w, c, s in zip(weights, copies[name], scales):
                product(xs[w.shape[1]], c, s)
            if i:  # the first compiles
                times[name].append(time.perf_counter() - t)
    print(f"{rows} rows: " + ", ".join(f"{name} {statistics.median(v) * 1e3:.2f} ms ({nbytes / statistics.median(v) / 1e9:.1f} GB/s)"
                                      for name, v in times.items()), flush=True)
for n, k in [(3072, 576), (576, 1536), (49152, 576)]:
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    tiled = cpu_decode.tiles_layout(w)
    one = {"int8_rows": lambda x: torch.ops.fastllama.int8_rows(x, tiled),
           "linear_in": lambda x: cpu_decode.linear_in(torch.bfloat16, x, w)}
    for rows in (16, 64, 512):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        times = {name: [] for name in one}
        for _ in range(7):
            for name, product in one.items():
                t = time.perf_counter(); product(x); times[name].append(time.perf_counter() - t)
        print(f"{n} x {k}, {rows} rows: " + ", ".join(f"{name} {2 * rows * n * k / statistics.median(v) / 1e9:.0f} GFLOP/s"
                                                     for name, v in times.items()), flush=True)
