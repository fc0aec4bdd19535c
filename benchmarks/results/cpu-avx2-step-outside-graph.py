"""Where a compiled decode step's time goes, outside inductor's graph: the step (generate's decode_one_token as
compiled_steps() compiles it) at depth 16, timed whole and inside the graph (CompiledFxGraph.__call__ wrapped
with a clock), and the step's guards checked alone (its cache entry's guard manager, 300 checks). Each setting in a
process of its own: NAME=VALUE sets torch._dynamo.config.NAME before anything compiles; `skip_guard_eval_unsafe`
times the steps under torch.compiler.set_stance(skip_guard_eval_unsafe=True) after the first.

    python benchmarks/results/cpu-avx2-step-outside-graph.py CHECKPOINT [bf16|int8] [NAME=VALUE | skip_guard_eval_unsafe]
"""
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo's modules, installed or not
from fastllama import decode  # noqa: E402
from fastllama import generate as gen  # noqa: E402

torch.set_grad_enabled(False)
checkpoint, kv = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bf16"
setting = sys.argv[3] if len(sys.argv) > 3 else "default"
if "=" in setting:
    name, value = setting.split("=")
    setattr(torch._dynamo.config, name, value == "True")

from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: E402
from torch._inductor.output_code import CompiledFxGraph  # noqa: E402

torch.manual_seed(0)
model = gen.load_model(checkpoint, "cpu")
model.setup_caches(1, 256, kv_cache_dtype=gen.KV_CACHE_DTYPES[kv])
steps = gen.compiled_steps()
token, length = torch.zeros((1, 1), dtype=torch.long), torch.tensor([16])
inside = [0.0]
graph_call = CompiledFxGraph.__call__


def timed_graph(self, inputs):
    start = time.perf_counter()
    out = graph_call(self, inputs)
    inside[0] += time.perf_counter() - start
    return out


CompiledFxGraph.__call__ = timed_graph


def run(n):
    t = token
    for i in range(n):
        t = steps.decode_one_token(model, t, length[:, None] + i, decode.key_positions(model, 17 + i))
    return t


run(40)  # compiles
stance = (torch.compiler.set_stance(skip_guard_eval_unsafe=True) if setting == "skip_guard_eval_unsafe"
          else contextlib.nullcontext())
rounds = []
with stance:
    for _ in range(9):
        inside[0] = 0.0
        start = time.perf_counter()
        run(64)
        rounds.append(((time.perf_counter() - start) / 64 * 1e3, inside[0] / 64 * 1e3))
entries = _debug_get_cache_entry_list(decode.decode_one_token.__code__)
f_locals = dict(model=model, cur_token=token, input_pos=length[:, None], keys=decode.key_positions(model, 17),
                sampling={})
guards = entries[0].guard_manager
assert guards.check(f_locals)
start = time.perf_counter()
for _ in range(300):
    guards.check(f_locals)
check_ms = (time.perf_counter() - start) / 300 * 1e3
step, graph = statistics.median(s for s, _ in rounds), statistics.median(g for _, g in rounds)
print(f"{setting}, {kv} cache: step {step:.2f} ms, inside the graph {graph:.2f}, outside "
      f"{statistics.median(s - g for s, g in rounds):.2f}; the guards checked alone {check_ms:.3f} ms "
      f"({len(entries)} cache entr{'y' if len(entries) == 1 else 'ies'})")
