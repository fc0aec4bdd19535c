"""cpu_linear.cpp's bf16_rows over tiles against F.linear over the plain weight, one weight of the bundled model's shapes at a time,
at 64 to 384 rows (median of 15; two runs): F.linear's time over the tiles'. Where TILE_ROWS comes from. Run as
python cpu-avx512-tiles-rows.py; the output: cpu-avx512-tiles-rows.txt."""
import statistics, time, torch
from fastllama import cpu_decode
assert cpu_decode.linear_kernels()
torch.manual_seed(0)
for n, k in [(960, 576), (3072, 576), (576, 1536), (576, 576)]:
    w = torch.randn(n, k).bfloat16(); tb = cpu_decode.tiles_layout(w)
    out = []
    for rows in (64, 96, 128, 192, 256, 384):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        ts = {"tiles": [], "F.linear": []}
        for _ in range(15):
            t = time.perf_counter(); torch.ops.fastllama.bf16_rows(x, tb); ts["tiles"].append(time.perf_counter() - t)
            t = time.perf_counter(); torch.nn.functional.linear(x, w); ts["F.linear"].append(time.perf_counter() - t)
        out.append(f"{rows}: {statistics.median(ts['F.linear']) / statistics.median(ts['tiles']):.2f}")
    print(n, k, "tiles speedup over F.linear", ", ".join(out), flush=True)
