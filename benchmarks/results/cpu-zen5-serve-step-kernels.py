"""The server's decode step of 1 and of 8 rows at depth 100 (serve.Engine, compiled as serve.py --compile compiles
it), profiled with inductor's kernels named (cpp.enable_kernel_profile): 20 steps each, self time by op and kernel.

    python benchmarks/results/cpu-zen5-serve-step-kernels.py CHECKPOINT
"""
import sys, torch
torch._inductor.config.cpp.enable_kernel_profile = True
from fastllama import serve
from fastllama.generate import compiled_steps, find_checkpoint, load_model
from torch.profiler import profile
torch.set_grad_enabled(False)
model = load_model(find_checkpoint(sys.argv[1]), "cpu", "bf16")
eng = serve.Engine(model, 8, 8192, compiled_steps(dynamic_prefill=True))
for rows in (1, 8):
    for _ in range(5): eng.step([1] * rows, [100] * rows)
for rows in (1, 8):
    with profile() as p:
        for _ in range(20): eng.step([1] * rows, [100] * rows)
    print("=====", rows, "rows")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=70))
