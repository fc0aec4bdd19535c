"""What this machine's cores read from memory: a plain sum of 32-byte vectors over a buffer far larger than the
caches, each thread its own contiguous part (an extension built here, AVX2), on 1 and on all threads, median of
15 passes; and scripts/benchmark.py's copy_bandwidth_gbs (a large copy, bytes read plus written, median of 5)
beside it. The products and the attention of a decode step read their bytes against this.

    python benchmarks/results/cpu-read-bandwidth.py [MiB]
"""
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from benchmark import copy_bandwidth_gbs, timed  # noqa: E402

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <vector>

// each tensor in turn, halved (split evenly) between the threads
int64_t read_sum(const std::vector<at::Tensor>& ts) {
  int64_t s = 0;
  for (const at::Tensor& t : ts) {
    const uint8_t* p = t.data_ptr<uint8_t>();
    std::vector<int64_t> part(at::get_num_threads(), 0);
    at::parallel_for(0, t.numel() / 64, 1, [&](int64_t begin, int64_t end) {
      __m256i a = _mm256_setzero_si256(), b = a;
      for (int64_t i = begin; i < end; i++) {
        a = _mm256_add_epi32(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i)));
        b = _mm256_add_epi32(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i + 32)));
      }
      part[at::get_thread_num()] += _mm256_extract_epi32(_mm256_add_epi32(a, b), 0);
    });
    for (int64_t v : part) s += v;
  }
  return s;
}

TORCH_LIBRARY(read_bandwidth, m) { m.def("read_sum(Tensor[] ts) -> int", &read_sum); }
"""


def build():
    """torch.ops.read_bandwidth.read_sum(tensors): also the plain read of cpu-avx2-int4-calls.py."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "read_sum.cpp").write_text(SOURCE)
        cpp_extension.load("read_bandwidth", [str(Path(tmp) / "read_sum.cpp")], build_directory=tmp,
                           extra_cflags=["-O3", "-mavx2", "-fopenmp"], is_python_module=False)
    return torch.ops.read_bandwidth.read_sum


def read_gbs(read_sum, buf):
    def read():
        return read_sum([buf])
    read()
    return buf.numel() / statistics.median(timed(read, "cpu") for _ in range(15)) / 1e9


if __name__ == "__main__":
    read_sum = build()
    buf = torch.ones((int(sys.argv[1]) if len(sys.argv) > 1 else 512) << 20, dtype=torch.uint8)
    threads = torch.get_num_threads()
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        print(f"{n} thread{'s' if n > 1 else ''}: read {read_gbs(read_sum, buf):.1f} GB/s, "
              f"copy {copy_bandwidth_gbs('cpu', buf.numel()):.1f} GB/s (read + written), {buf.numel() >> 20} MiB")
