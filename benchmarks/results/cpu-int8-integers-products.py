"""The int8 products of a checkpoint's int8 linears (`quantize.py --mode int8` of the bundled model: 120 and the
head), REV's cpu_linear.cpp against the checkout's, each built for this CPU (-march=native) and, on a CPU with
AVX-512, also for AVX2 (-mno-avx512f: the AVX2 form on this core, a proxy for a CPU without AVX-512, not one). All
the linears from one C++ loop a pass, so that the weights come from memory; the forms in turn, rounds; the median
ms of a pass and the median of the rounds' ratios of REV's form to the checkout's of the same build. Written for
2026-12-01's change of the int8 products to integers (x rounded to int8 a block of 32 inputs, as the int4 products
take it), whose layout differs from REV's bf16-pair tiles: REV's is made from the plain levels by
cpu_decode.tiles_layout. On AVX-512 a third form: the checkout's with a one-row pass loading its pieces 64 bytes at
a time, as the passes of more rows do (the checkout's loads 32). First, how far each form's outputs part from the
exact product of x as each takes it, on the head, 3 rows. With --head, the head alone. With --same-layout, a REV
since that change takes the checkout's layout, and x as the checkout takes it.

    python benchmarks/results/cpu-int8-integers-products.py REV CHECKPOINT ROUNDS ROWS,ROWS,... [--head] [--same-layout]
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
from fastllama import cpu_decode, generate, quantize  # noqa: E402

LOOP = r"""
namespace {
at::Tensor int8_each(const at::Tensor& x, const std::vector<at::Tensor>& ws, const std::vector<int64_t>& ks) {
  at::Tensor y;
  for (size_t i = 0; i < ws.size(); i++) y = int8_rows(x.narrow(1, 0, ks[i]).contiguous(), ws[i]);
  return y;
}
}  // namespace
TORCH_LIBRARY(NS_loop, m) { m.def("int8_each(Tensor x, Tensor[] ws, int[] ks) -> Tensor", &int8_each); }
"""


def plain(w):
    """The levels (n, k) of a weight in the checkout's layout (quantize.int8_rows_layout's inverse)."""
    n, k = w.shape[0] * 16, w.shape[1] * 32
    flat, out = w.reshape(n, k), torch.empty(n, k, dtype=torch.int8)
    for r in range(0, n, 64):
        rows = flat[r: r + 64]
        out[r: r + 64] = rows.reshape(k // 32, -1, 8, 16, 4).permute(1, 3, 0, 2, 4).reshape(rows.shape)
    return out


ONE_ROW_LOADS = "int8_piece<R == 1>"  # the checkout's choice of loads, which the third form replaces


def build(ns: str, rev: str | None, avx2: bool, wide_loads: bool = False):
    """cpu_linear.cpp of rev (None: the checkout) under the op namespace ns, with the loop; its int8_each.
    wide_loads: a one-row pass's pieces loaded 64 bytes at a time."""
    def source(name):
        if rev is None:
            return (root / "fastllama" / name).read_text()
        return subprocess.run(["git", "show", f"{rev}:fastllama/{name}"], capture_output=True, text=True, check=True,
                              cwd=root).stdout
    d = Path(tempfile.mkdtemp())
    s = source("cpu_linear.cpp").replace("(fastllama, m)", f"({ns}, m)").replace("(fastllama, CPU, m)", f"({ns}, CPU, m)")
    if wide_loads:
        assert ONE_ROW_LOADS in s
        s = s.replace(ONE_ROW_LOADS, "int8_piece<false>")
    (d / "cpu_linear.cpp").write_text(s + LOOP.replace("NS", ns))
    (d / "cpu_vectors.h").write_text(source("cpu_vectors.h"))
    flags = ["-O3", "-march=native", "-fopenmp"] + (["-mno-avx512f"] if avx2 else [])
    cpp_extension.load(ns, [str(d / "cpu_linear.cpp")], extra_cflags=flags, is_python_module=False, build_directory=str(d))
    return getattr(torch.ops, ns + "_loop").int8_each


def rounded(x):
    """x as the checkout's int8 products take it: each block of 32 rounded to int8 against its largest magnitude"""
    blocks = x.float().unflatten(-1, (-1, 32))
    largest = blocks.abs().amax(-1, keepdim=True)
    levels = torch.round(blocks * torch.where(largest > 0, torch.tensor(127.0) / largest, 0))
    return (levels * (largest / 127)).flatten(-2)


def main():
    rev, checkpoint, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rows_list = [int(r) for r in sys.argv[4].split(",")]
    torch.set_grad_enabled(False)
    model = generate.load_model(checkpoint, "cpu")  # builds the checkout's kernels (torch.ops.fastllama)
    linears = [m for m in model.modules() if isinstance(m, quantize.Int8Linear) and m.kernel == "cpu-tiles"]
    if "--head" in sys.argv:
        linears = linears[-1:]
    builds = ["native"] + (["AVX2"] if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX") else [])
    forms = {}
    for b in builds:
        forms[f"{rev} {b}"] = (build(f"rev8_{b.lower()}", rev, b == "AVX2"), "rev")
        forms[f"checkout {b}"] = (build(f"checkout8_{b.lower()}", None, b == "AVX2"), "checkout")
    if builds[-1] == "AVX2":  # the checkout's one-row pass with 64-byte loads
        forms["checkout native, 64-byte loads"] = (build("wide8_native", None, False, wide_loads=True), "checkout")
    ws = {"checkout": [m.weight for m in linears]}
    levels = [plain(w) for w in ws["checkout"]]
    same = "--same-layout" in sys.argv
    ws["rev"] = ws["checkout"] if same else [cpu_decode.tiles_layout(q) for q in levels]
    ks = [q.shape[1] for q in levels]
    K = max(ks)
    MB = sum(w.numel() for w in ws["checkout"]) / 1e6

    x = torch.randn(3, K).bfloat16()
    head = x[:, :ks[-1]]
    for name, (f, layout) in forms.items():
        y = f(x, ws[layout], ks)
        taken = head.float() if layout == "rev" and not same else rounded(head)
        exact = taken.double() @ levels[-1].double().t()
        against_x = head.double() @ levels[-1].double().t()
        print(f"{name}: max |diff| / max |y| against x as it takes it {((y - exact).abs().max() / exact.abs().max()).item():.2e}"
              f", against x {((y - against_x).abs().max() / against_x.abs().max()).item():.2e}")
    for M in rows_list:
        x = torch.randn(M, K).bfloat16()

        def ms(f, layout, passes=5 if M < 64 else 1):
            f(x, ws[layout], ks)
            t0 = time.perf_counter()
            for _ in range(passes):
                f(x, ws[layout], ks)
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
        if "checkout native, 64-byte loads" in times:
            wide, new = times["checkout native, 64-byte loads"], times["checkout native"]
            ratio = statistics.median(a / c for a, c in zip(wide, new))
            print(f"  native, 64-byte loads: {statistics.median(wide):.3f} ms; over the checkout's {ratio:.3f}")


if __name__ == "__main__":
    main()
