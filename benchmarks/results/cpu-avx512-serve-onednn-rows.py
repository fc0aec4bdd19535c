"""oneDNN's bf16 products over the bundled model's linears (30 layers' wqkv, wo, w13, w2, and the output head), each
through its packed weight as FewRowLinear calls it, at 1 to 256 rows: time a pass, the arithmetic's rate and the weights'
read rate. The output: cpu-avx512-serve-onednn-rows.txt."""
import time

import torch

torch.set_grad_enabled(False)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
ws = [torch.randn(o, i, dtype=torch.bfloat16) for o, i in shapes]
flops_row = sum(2 * o * i for o, i in shapes)
for M in (1, 8, 16, 24, 64, 256):
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in ws]
    xs = {i: torch.randn(M, i, dtype=torch.bfloat16) for i in (576, 1536)}
    for rep in range(2):
        t = time.perf_counter()
        for _ in range(5):
            for (o, i), w, p in zip(shapes, ws, packed):
                torch.ops.mkldnn._linear_pointwise(xs[i], p, None, "none", [], "")
        dt = (time.perf_counter() - t) / 5
    bytes_ = sum(o * i * 2 for o, i in shapes)
    print(f"M={M:4} {dt*1e3:7.2f} ms a pass  {flops_row*M/dt/1e9:6.1f} GFLOP/s  {bytes_/dt/1e9:5.1f} GB/s of weights")
