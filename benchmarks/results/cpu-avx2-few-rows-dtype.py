"""A short prompt's products in bf16 against fp32 (the weight converted a block at a time: cpu_decode.linear_in)
over every linear of the bundled model, eager, as compiled prefill's op calls them where oneDNN has no bf16
kernels (benchmarks/RESULTS.md, "A short prompt's products where bf16 is slow"). Median of 5 passes.

    python benchmarks/results/cpu-avx2-few-rows-dtype.py
"""
import statistics
import time

import torch

from fastllama import cpu_decode, generate

torch.set_grad_enabled(False)
model = generate.load_model(generate.find_checkpoint(None), "cpu", "bf16")
linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
for rows in (2, 4, 8, 15):
    ms = {}
    for dtype in (torch.bfloat16, torch.float32):
        xs = {m.in_features: torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in linears}
        passes = []
        for _ in range(5):
            start = time.perf_counter()
            for m in linears:
                cpu_decode.linear_in(dtype, xs[m.in_features], m.weight, m.bias)
            passes.append((time.perf_counter() - start) * 1e3)
        ms[dtype] = statistics.median(passes)
    print(f"{rows} rows: bf16 {ms[torch.bfloat16]:.1f} ms, fp32 {ms[torch.float32]:.1f} ms over {len(linears)} "
          f"linears", flush=True)
