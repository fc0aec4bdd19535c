"""Whole decode steps of a checkpoint loaded as generate.load_model loads it on CPU (the tensors packing keeps in
one allocation: checkpoint.read_safetensors' `together`) against the same checkpoint with each tensor in an
allocation of its own, as before. Tensors of 2 MB or more lie in huge pages either way (THP_MEM_ALLOC_ENABLE=1,
fastllama's default); the one allocation puts the small ones there too. Each side runs in a process of its own
(a process holding both models measured the apart side slower than it runs alone), in turn, PAIRS times; each
process times 15 rounds of 20 compiled steps at DEPTH (random cache contents) and reports their median. Printed:
each pair, the medians of each side and the quartiles of the pairs' ratios (benchmarks/RESULTS.md, "One
allocation for the weights").

    python benchmarks/results/cpu-avx512-one-allocation-steps.py CHECKPOINT DEPTH [PAIRS]
"""
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock


def one_side(apart: bool, ck: str, depth: int) -> str:
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from benchmark import compiled_apart
    from benchmark_depths import fill_at_random
    from fastllama import checkpoint, decode, generate
    torch.set_grad_enabled(False)

    def each_its_own(*args, together=None, **kwargs):
        return checkpoint.read_safetensors(*args, **kwargs)

    with mock.patch.object(generate, "read_safetensors", each_its_own if apart else checkpoint.read_safetensors):
        model = generate.load_model(ck, "cpu", "bf16")
    model.setup_caches(1, decode.padded_length(depth + 64, model.config.block_size))
    torch.manual_seed(0)
    fill_at_random(model)
    step = compiled_apart()
    token, length, keys = torch.tensor([[1]]), torch.tensor([[depth]]), decode.key_positions(model, depth + 1)
    for _ in range(3):
        step(model, token, length, keys)
    times = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(20):
            step(model, token, length, keys)
        times.append((time.perf_counter() - t) / 20 * 1e3)
    allocations = len({t.untyped_storage().data_ptr() for t in model.state_dict().values()})
    return f"{statistics.median(times):.3f} {allocations}"


if __name__ == "__main__":
    if sys.argv[1] == "--side":
        print(one_side(sys.argv[2] == "apart", sys.argv[3], int(sys.argv[4])))
        sys.exit()
    ck, depth, pairs = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 6
    ms = {"apart": [], "one": []}
    for i in range(pairs):
        for side in ("apart", "one") if i % 2 == 0 else ("one", "apart"):
            run = subprocess.run([sys.executable, __file__, "--side", side, ck, depth], capture_output=True, text=True)
            if run.returncode:
                sys.exit(run.stderr)
            median, allocations = run.stdout.split()[-2:]
            ms[side].append(float(median))
            print(f"pair {i + 1}, {side}: {median} ms a step, {allocations} allocations", flush=True)
    q = statistics.quantiles([a / b for a, b in zip(ms["apart"], ms["one"])], n=4)
    print(f"apart {statistics.median(ms['apart']):.3f} ms, one allocation {statistics.median(ms['one']):.3f} ms; "
          f"apart / one by pair, quartiles: {q[0]:.3f} {q[1]:.3f} {q[2]:.3f}")
