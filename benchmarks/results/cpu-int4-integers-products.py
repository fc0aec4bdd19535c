"""The int4 products of a checkpoint's int4 linears (the bundled model's: 120), REV's cpu_linear.cpp against the
checkout's, each built for this CPU (-march=native) and, on a CPU with AVX-512, also for AVX2 (-mno-avx512f: the
AVX2 form on this core, a proxy for a CPU without AVX-512, not one). All the linears from one C++ loop a pass
(cpu-avx2-int4-calls.py's), so that the weights come from memory; the forms in turn, rounds; the median ms of a
pass and the median of the rounds' ratios of REV's form to the checkout's of the same build. Written for
2026-12-01's change of the int4 products to integers, whose layout differs from REV's: REV's is made from the
checkout's, piece by piece (old_layout); with --same-layout, a REV since that change takes the checkout's. First,
how far the forms' outputs part from the library's own build on the last linear, 3 rows.

    python benchmarks/results/cpu-int4-integers-products.py REV CHECKPOINT ROUNDS ROWS,ROWS,... [--same-layout]
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

root = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root))  # the repo's modules, installed or not
from fastllama import generate  # noqa: E402

LOOP = r"""
namespace {
at::Tensor int4_each(const at::Tensor& x, const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& sms) {
  at::Tensor y;
  for (size_t i = 0; i < ws.size(); i++) y = int4_rows(x.narrow(1, 0, ws[i].size(1) * 32).contiguous(), ws[i], sms[i]);
  return y;
}
}  // namespace
TORCH_LIBRARY(NS_loop, m) { m.def("int4_each(Tensor x, Tensor[] ws, Tensor[] sms) -> Tensor", &int4_each); }
"""


def old_layout(w):
    """The checkout's pieces (byte 64c + 4i + j of a tile's block: output i, inputs 4c + j low, 16 + 4c + j high)
    as REV's chunks (byte 32c + 2i + e: inputs 4c + e low, 4c + 2 + e high)."""
    b = w.reshape(-1, 4, 16, 4)
    q = torch.stack([b & 15, b >> 4], 4).permute(0, 2, 4, 1, 3).reshape(-1, 16, 32)  # (tile-block, i, input)
    q = q.view(-1, 16, 8, 2, 2).permute(0, 2, 1, 4, 3)  # (tile-block, c, i, e, low/high)
    return (q[..., 0] | q[..., 1] << 4).reshape(w.shape)


def build(ns: str, rev: str | None, avx2: bool):
    """cpu_linear.cpp of rev (None: the checkout) under the op namespace ns, with the loop; its int4_each"""
    def source(name):
        if rev is None:
            return (root / "fastllama" / name).read_text()
        return subprocess.run(["git", "show", f"{rev}:fastllama/{name}"], capture_output=True, text=True, check=True,
                              cwd=root).stdout
    d = Path(tempfile.mkdtemp())
    s = source("cpu_linear.cpp").replace("(fastllama, m)", f"({ns}, m)").replace("(fastllama, CPU, m)", f"({ns}, CPU, m)")
    (d / "cpu_linear.cpp").write_text(s + LOOP.replace("NS", ns))
    (d / "cpu_vectors.h").write_text(source("cpu_vectors.h"))
    flags = ["-O3", "-march=native", "-fopenmp"] + (["-mno-avx512f"] if avx2 else [])
    cpp_extension.load(ns, [str(d / "cpu_linear.cpp")], extra_cflags=flags, is_python_module=False, build_directory=str(d))
    return getattr(torch.ops, ns + "_loop").int4_each


def main():
    rev, checkpoint, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rows_list = [int(r) for r in sys.argv[4].split(",")]
    torch.set_grad_enabled(False)
    model = generate.load_model(checkpoint, "cpu")  # builds the checkout's kernels (torch.ops.fastllama)
    linears = [m for m in model.modules() if getattr(m, "kernel", None) == "cpu-tiles" and hasattr(m, "scales_and_zeros")]
    builds = ["native"] + (["AVX2"] if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX") else [])
    forms = {}
    for b in builds:
        forms[f"{rev} {b}"] = (build(f"rev_{b.lower()}", rev, b == "AVX2"), "rev")
        forms[f"checkout {b}"] = (build(f"checkout_{b.lower()}", None, b == "AVX2"), "checkout")
    ws = {"checkout": [m.weight for m in linears]}
    ws["rev"] = ws["checkout"] if "--same-layout" in sys.argv else [old_layout(m.weight).contiguous() for m in linears]
    sms = [m.scales_and_zeros for m in linears]
    K = max(w.shape[1] * 32 for w in ws["checkout"])
    MB = sum(t.numel() * t.element_size() for t in ws["checkout"] + sms) / 1e6

    x = torch.randn(3, K).bfloat16()
    ref = torch.ops.fastllama.int4_rows(x[:, :ws["checkout"][-1].shape[1] * 32].contiguous(), ws["checkout"][-1], sms[-1])
    for name, (f, layout) in forms.items():
        y = f(x, ws[layout], sms)
        print(f"{name}: against the library's build, max |diff| / max |y| {((y - ref).abs().max() / ref.abs().max()).item():.2e}"
              f", identical: {torch.equal(y, ref)}")
    for M in rows_list:
        x = torch.randn(M, K).bfloat16()

        def ms(f, layout, passes=5 if M < 64 else 1):
            f(x, ws[layout], sms)
            t0 = time.perf_counter()
            for _ in range(passes):
                f(x, ws[layout], sms)
            return (time.perf_counter() - t0) / passes * 1e3

        times = {name: [] for name in forms}
        for _ in range(rounds):
            for name, (f, layout) in forms.items():
                times[name].append(ms(f, layout))
        print(f"rows {M}, {len(linears)} linears, {MB:.1f} MB, {torch.get_num_threads()} threads, {rounds} rounds")
        for b in builds:
            old, new = times[f"{rev} {b}"], times[f"checkout {b}"]
            ratio = statistics.median(a / c for a, c in zip(old, new))
            print(f"  {b}: {rev} {statistics.median(old):.3f} ms, checkout {statistics.median(new):.3f} ms "
                  f"({MB / statistics.median(new):.1f} GB/s); {rev} / checkout {ratio:.3f}")


if __name__ == "__main__":
    main()
